//! The OpenClaw plugin host (engines/openclaw-host) serving the real
//! lossless-claw 0.15.3 (pinned in the host's package-lock.json): the
//! host's own tests and the conformance kit (its script), the tools it
//! declares, and lossless-claw through the gateway — 100 turns in a small
//! window build its summary DAG (its own SQLite shows leaf and condensed
//! summaries) with every assembled context within its budget, `lcm_grep`
//! finds a fact from turn 1 in a harness turn, and a `kill -9` of the host
//! is quarantined, answered by legacy and re-admitted with nothing of an
//! accepted turn lost or duplicated.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::path::Path;
use std::time::{Duration, Instant};

use ctxgate::config::{Config, ProviderKind};
use ctxgate_engine_sdk::pb;
use ctxgate_proto::gateway::{self as api, turn_event::Event};
use ctxgate_proto::pb::{Role, content_part::Part, transcript_entry::Entry};
use ctxgate_tests::fake_openai::{FakeOpenAi, Reply};
use ctxgate_tests::harness::{Drive, begin, client, text, tool_call};
use ctxgate_tests::hosting::{attached, compaction_stream, engine_status, hosting, selected, session, transcript};
use ctxgate_tests::{EngineProcess, PATIENCE, TestGateway, counter, metrics_text, repo_root, within};
use tokio_stream::StreamExt;

use crate::sdk_typescript::kit_closing_line;
use ctxgate_tests::run_script;

/// lossless-claw's settings for a small window: a short fresh tail and
/// small chunks, so 100 short turns make leaf summaries and condense them.
const SMALL_WINDOW_CONFIG: &str = r#"{
  "independentLogFile": { "enabled": false },
  "proactiveThresholdCompactionMode": "inline",
  "contextThreshold": 0.75,
  "freshTailCount": 6,
  "leafChunkTokens": 800,
  "leafMinFanout": 4,
  "leafTargetTokens": 150,
  "condensedMinFanout": 2,
  "condensedMinFanoutHard": 2,
  "condensedTargetTokens": 100,
  "summaryPrefixTargetTokens": 100,
  "summaryMaxCallsPerWindow": 10000,
  "summarySpendBackoffMs": 1
}"#;

/// The lossless-claw 0.15 line: after-turn, written for OpenClaw ≤ 2026.7.
const LOSSLESS_0_15: &str = "@martian-engineering/lossless-claw@0.15.3";
/// The 1.x line: durable turns (CommitTurn), for OpenClaw 2026.8 and later.
const LOSSLESS_1: &str = "@martian-engineering/lossless-claw@1.0.0-beta.4";

/// The host serving lossless-claw 0.15.3 with its state in `state`,
/// listening on `listen` (`127.0.0.1:0` or a fixed port to restart on).
async fn start_host(state: &Path, listen: &str, config: &str) -> EngineProcess {
    start_plugin(LOSSLESS_0_15, state, listen, config).await
}

/// [`start_host`] serving `plugin`.
async fn start_plugin(plugin: &str, state: &Path, listen: &str, config: &str) -> EngineProcess {
    std::fs::create_dir_all(state).unwrap();
    let config_file = state.join("plugin.json");
    std::fs::write(&config_file, config).unwrap();
    let (state, config_file) =
        (state.join("lcm").to_str().unwrap().to_owned(), config_file.to_str().unwrap().to_owned());
    let args = [
        "--plugin",
        plugin,
        "--plugin-config",
        config_file.as_str(),
        "--listen",
        listen,
        "--state-dir",
        state.as_str(),
    ];
    EngineProcess::start(repo_root().join("engines/openclaw-host/run.sh"), &args).await.expect("the host starts")
}

/// A gateway selecting the host as "lossless", on the tests' local
/// OpenAI-compatible model with a small window.
fn gateway_config(fake: &FakeOpenAi, endpoint: &str, window: u64) -> Config {
    let timeouts =
        [("afterTurn", 60.0), ("maintain", 60.0), ("compact", 120.0), ("assemble", 30.0), ("bootstrap", 30.0)];
    let mut c = hosting("lossless", endpoint, &timeouts);
    c.models.provider = ProviderKind::Openai;
    c.models.base_url = fake.base_url.clone();
    c.models.model = "gpt-test".into();
    c.models.context_window = window;
    c.models.max_output_tokens = 256;
    c.agents.defaults.compaction.reserve_tokens = Some(500);
    c.gateway.metrics_listen = "127.0.0.1:0".into();
    c
}

/// A gateway metric of the "lossless" engine's `method`.
async fn lossless_counter(g: &TestGateway, name: &str, method: &str) -> u64 {
    counter(&metrics_text(g.metrics.unwrap()).await, name, &format!("engine=\"lossless\",method=\"{method}\""))
}

async fn run_turn(g: &TestGateway, key: &str, text: &str) -> Vec<Event> {
    let req = api::RunTurnRequest { session: session(key), message: text.into(), ..Default::default() };
    within(PATIENCE * 2, format!("the turn {text:?} ending"), async {
        let mut stream = g.client.clone().run_turn(req).await.unwrap().into_inner();
        let mut events = Vec::new();
        while let Some(e) = stream.next().await {
            events.push(e.unwrap().event.unwrap());
        }
        events
    })
    .await
}

/// What the model answers (and writes as each summary).
const REPLY: &str = "Noted. The module and its tests were reviewed; the open question is the retry policy, and the decision was to keep the defaults until the load test runs.";

fn turn_text(i: usize) -> String {
    format!("Turn {i}: we looked at module_{i}.rs and its tests; {}", "the details went on at some length. ".repeat(6))
}

/// Every message lossless-claw holds, as (role, content), in its order.
fn lcm_messages(state: &Path) -> Vec<(String, String)> {
    let db =
        rusqlite::Connection::open_with_flags(state.join("lcm/lcm.db"), rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .unwrap();
    let mut q = db.prepare("SELECT role, content FROM messages ORDER BY conversation_id, seq").unwrap();
    q.query_map([], |r| Ok((r.get(0)?, r.get(1)?))).unwrap().map(Result::unwrap).collect()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[tokio::test]
async fn the_host_passes_its_tests_and_lossless_claw_under_it_passes_the_kit() {
    let (ok, out) = run_script("engines/openclaw-host/run-tests.sh", Duration::from_secs(900)).await;
    eprintln!("{out}");
    assert!(ok, "engines/openclaw-host/run-tests.sh failed");
    assert!(out.lines().any(|l| l.trim() == "ℹ fail 0"), "the host's tests: {out}");
    let (passed, failed, skipped) = kit_closing_line(&out);
    assert_eq!(failed, 0, "{out}");
    assert_eq!(passed + skipped, ctxgate_engine_sdk::conformance::CASES.len());
    // What does not apply to lossless-claw 0.15.3's declared methods:
    // CommitTurn (an after-turn engine). The host is DELTA, so the three
    // DELTA cases run.
    assert_eq!(skipped, 1, "{out}");
}

#[tokio::test]
async fn lossless_claw_declares_its_tools_with_their_audience() {
    let state = tempfile::tempdir().unwrap();
    let host = start_host(state.path(), "127.0.0.1:0", SMALL_WINDOW_CONFIG).await;
    let mut c = ctxgate_runtime::engine_client(ctxgate_runtime::connect(&host.endpoint).unwrap());
    let info = c.get_info(pb::GetInfoRequest {}).await.unwrap().into_inner();
    assert_eq!((info.id.as_str(), info.version.as_str()), ("lossless-claw", "0.15.3"));
    let tools: Vec<(&str, i32)> = info.tools.iter().map(|t| (t.name.as_str(), t.audience)).collect();
    let main = pb::ToolAudience::Main as i32;
    assert_eq!(
        tools,
        [
            ("lcm_grep", main),
            ("lcm_describe", main),
            ("lcm_expand", pb::ToolAudience::Subagent as i32),
            ("lcm_expand_query", main)
        ]
    );
    assert!(info.implemented_methods.iter().any(|m| m == "CallTool"));
    assert!(info.owns_compaction, "lossless-claw owns compaction once its schema migrated");
}

#[tokio::test]
async fn a_hundred_turns_in_a_small_window_build_the_summary_dag_within_budget() {
    hundred_turns(LOSSLESS_0_15).await;
}

#[tokio::test]
async fn lossless_claw_1_builds_its_summary_dag_over_a_hundred_durable_turns() {
    hundred_turns(LOSSLESS_1).await;
}

async fn hundred_turns(plugin: &str) {
    let fake = FakeOpenAi::start().await;
    // Replies (and summaries: the same model) of some substance.
    fake.turn_default(Reply::Text(REPLY.into()));
    let state = tempfile::tempdir().unwrap();
    let host = start_plugin(plugin, state.path(), "127.0.0.1:0", SMALL_WINDOW_CONFIG).await;
    let g = TestGateway::start(gateway_config(&fake, &host.endpoint, 4_000)).await;
    attached(&g, "lossless").await;
    let started = Instant::now();
    for i in 0..100 {
        let events = run_turn(&g, "dag", &turn_text(i)).await;
        assert!(matches!(events.last(), Some(Event::Completed(_))), "turn {i}: {events:?}");
        assert_eq!(selected(&events).engine_id, "lossless", "turn {i} ran on lossless-claw: {events:?}");
        for e in &events {
            if let Event::Assembled(a) = e {
                assert!(
                    a.estimated_tokens <= a.token_budget,
                    "turn {i} assembled {} tokens over its budget {}",
                    a.estimated_tokens,
                    a.token_budget
                );
            }
        }
    }
    eprintln!("100 turns through {plugin} in {:?}", started.elapsed());
    assert_eq!(engine_status(&g, "lossless").await.quarantine, None);
    let db = rusqlite::Connection::open_with_flags(
        state.path().join("lcm/lcm.db"),
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
    )
    .unwrap();
    let count = |kind: &str| -> i64 {
        db.query_row("SELECT count(*) FROM summaries WHERE kind = ?1", [kind], |r| r.get(0)).unwrap()
    };
    let (leaf, condensed) = (count("leaf"), count("condensed"));
    eprintln!("lossless-claw's DAG: {leaf} leaf and {condensed} condensed summaries");
    assert!(leaf > 0 && condensed > 0, "leaf {leaf}, condensed {condensed}");
    let parents: i64 = db.query_row("SELECT count(*) FROM summary_parents", [], |r| r.get(0)).unwrap();
    assert!(parents > 0, "condensed summaries point at their children");
    // Nothing dropped: every turn's user message is held once.
    let held = lcm_messages(state.path());
    for i in 0..100 {
        let n =
            held.iter().filter(|(role, content)| role == "user" && content.starts_with(&format!("Turn {i}:"))).count();
        assert_eq!(n, 1, "turn {i} held {n} times");
    }
    g.stop().await;
}

#[tokio::test]
async fn lcm_grep_in_a_harness_turn_finds_a_fact_planted_in_turn_one() {
    lcm_grep_finds_turn_one(LOSSLESS_0_15).await;
}

#[tokio::test]
async fn lossless_claw_1s_lcm_grep_finds_a_fact_planted_in_turn_one() {
    lcm_grep_finds_turn_one(LOSSLESS_1).await;
}

async fn lcm_grep_finds_turn_one(plugin: &str) {
    let fake = FakeOpenAi::start().await;
    let state = tempfile::tempdir().unwrap();
    let host = start_plugin(plugin, state.path(), "127.0.0.1:0", SMALL_WINDOW_CONFIG).await;
    let g = TestGateway::start(gateway_config(&fake, &host.endpoint, 4_000)).await;
    attached(&g, "lossless").await;
    let hc = client(&g.endpoint);
    let small = |user: &str| {
        let mut b = begin("grep", user);
        b.model.as_mut().unwrap().context_window = 4_000;
        b.model.as_mut().unwrap().max_output_tokens = 500;
        b
    };
    for i in 0..30 {
        let user = if i == 0 { "Remember this: the launch code is ORCHID-7731.".to_owned() } else { turn_text(i) };
        let mut d = Drive::open(&hc, small(&user)).await.unwrap();
        d.context().await.unwrap();
        d.append(vec![text(Role::Assistant, &format!("noted {i}"))]).await.unwrap();
        d.end(api::TurnOutcome::Accepted).await.unwrap();
    }
    let mut d = Drive::open(&hc, small("What was the launch code?")).await.unwrap();
    let ctx = d.context().await.unwrap();
    let offered: Vec<&str> = ctx.engine_tools.iter().map(|t| t.name.as_str()).collect();
    assert!(offered.contains(&"lcm_grep") && !offered.contains(&"lcm_expand"), "main-session tools only: {offered:?}");
    assert!(
        ctx.system_prompt_addition.as_deref().is_some_and(|a| a.contains("Lossless Recall Policy")),
        "before_prompt_build's policy"
    );
    d.append(vec![tool_call("g1", "lcm_grep", r#"{"pattern":"ORCHID-\\d+"}"#)]).await.unwrap();
    let r = d.call_tool("g1").await.unwrap();
    let (answer, is_error) = match r.message.as_ref().and_then(|m| m.content.first()).and_then(|p| p.part.as_ref()) {
        Some(Part::ToolResult(t)) => (t.text.clone(), t.is_error),
        other => panic!("{other:?}"),
    };
    assert!(!is_error && answer.contains("ORCHID-7731"), "lcm_grep found: {answer}");
    d.append(vec![text(Role::Assistant, "The launch code is ORCHID-7731.")]).await.unwrap();
    d.end(api::TurnOutcome::Accepted).await.unwrap();
    let entries = transcript(&g.client, "grep").await;
    let results =
        entries.iter().filter(|e| matches!(&e.entry, Some(Entry::Message(m)) if m.role == Role::Tool as i32)).count();
    assert_eq!(results, 1, "the tool's result is stored once");
    g.stop().await;
}

#[tokio::test]
async fn a_killed_host_is_quarantined_legacy_answers_and_the_restarted_host_has_every_accepted_turn_once() {
    killed_host_keeps_every_turn_once(LOSSLESS_0_15).await;
}

#[tokio::test]
async fn lossless_claw_1_killed_mid_run_holds_every_accepted_turn_exactly_once() {
    killed_host_keeps_every_turn_once(LOSSLESS_1).await;
}

async fn killed_host_keeps_every_turn_once(plugin: &str) {
    let fake = FakeOpenAi::start().await;
    let state = tempfile::tempdir().unwrap();
    let listen = format!("127.0.0.1:{}", free_port());
    let host = start_plugin(plugin, state.path(), &listen, SMALL_WINDOW_CONFIG).await;
    let g = TestGateway::start(gateway_config(&fake, &host.endpoint, 8_000)).await;
    attached(&g, "lossless").await;
    let mut turn = 0;
    for _ in 0..10 {
        let events = run_turn(&g, "k", &turn_text(turn)).await;
        assert_eq!(selected(&events).engine_id, "lossless");
        turn += 1;
    }
    // kill -9 mid-run: the next turn finds the engine gone; its calls fall
    // back to legacy and the gateway quarantines the host.
    host.signal_and_wait("KILL").await.unwrap();
    let events = run_turn(&g, "k", &turn_text(turn)).await;
    assert!(matches!(events.last(), Some(Event::Completed(_))), "the turn completes on the fallback: {events:?}");
    turn += 1;
    assert!(engine_status(&g, "lossless").await.quarantine.is_some(), "the gateway quarantined the host");
    for _ in 0..2 {
        let events = run_turn(&g, "k", &turn_text(turn)).await;
        assert!(matches!(events.last(), Some(Event::Completed(_))), "{events:?}");
        assert_eq!(selected(&events).engine_id, "legacy", "legacy answers while the host is down: {events:?}");
        turn += 1;
    }
    // The restarted host, same state and address, is re-admitted.
    let _host = start_plugin(plugin, state.path(), &listen, SMALL_WINDOW_CONFIG).await;
    let deadline = Instant::now() + Duration::from_secs(90);
    while engine_status(&g, "lossless").await.quarantine.is_some() {
        assert!(Instant::now() < deadline, "the restarted host was never re-admitted");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut assemble_bytes = 0;
    for _ in 0..5 {
        let before = lossless_counter(&g, "ctxgate_engine_sent_bytes_total", "Assemble").await;
        let events = run_turn(&g, "k", &turn_text(turn)).await;
        assert_eq!(selected(&events).engine_id, "lossless", "{events:?}");
        assemble_bytes = lossless_counter(&g, "ctxgate_engine_sent_bytes_total", "Assemble").await - before;
        turn += 1;
    }
    // The host is DELTA: the restarted host held none of the history it
    // had acknowledged, said so (a gap, no quarantine), and was resent it;
    // a turn's Assemble then carries its new messages, not the history.
    assert!(lossless_counter(&g, "ctxgate_engine_history_gaps_total", "Assemble").await >= 1);
    let history = turn_text(0).len() * turn;
    assert!(assemble_bytes < history as u64 / 2, "{assemble_bytes} bytes sent, a history of {history}");
    // Every accepted turn — those the host served, those legacy served
    // while it was down — is held exactly once: nothing lost, nothing twice.
    let held = lcm_messages(state.path());
    for i in 0..turn {
        let n =
            held.iter().filter(|(role, content)| role == "user" && content.starts_with(&format!("Turn {i}:"))).count();
        assert_eq!(n, 1, "turn {i} is held {n} times by lossless-claw");
    }
    let messages =
        transcript(&g.client, "k").await.iter().filter(|e| matches!(e.entry, Some(Entry::Message(_)))).count();
    assert_eq!(held.len(), messages, "lossless-claw holds exactly the gateway's messages");
    g.stop().await;
}

/// lossless-claw's settings as a user leaves them, but for its log file and
/// a fresh tail that fits an 8,000-token window (its default of 64 messages
/// of ~150 tokens does not: it then serves its degraded live fallback, no
/// summaries, as it would in OpenClaw).
const DEFAULT_CONFIG: &str = r#"{ "independentLogFile": { "enabled": false }, "freshTailCount": 16 }"#;

/// The newest model request (of the fake's recent ones) whose last message
/// contains `needle`: a turn's request ends with its user message.
fn request_ending_with(fake: &FakeOpenAi, needle: &str) -> Option<serde_json::Value> {
    fake.recent().into_iter().rev().find(|r| {
        r.pointer("/messages")
            .and_then(|m| m.as_array())
            .and_then(|m| m.last())
            .is_some_and(|m| m.get("role").and_then(|r| r.as_str()) == Some("user") && m.to_string().contains(needle))
    })
}

/// What a user found after 400 turns through lossless-claw 0.15.3: the
/// context no longer held the request being answered. The host handed the
/// plugin the turn inside `messages`, and lossless-claw's budget clamp
/// evicted it with the oldest; OpenClaw hands an engine the history before
/// the turn and appends the turn itself. And AfterTurn reported the whole
/// transcript as the live context (60k tokens in an 8k window), so the
/// plugin believed itself wedged and served its degraded fallback.
#[tokio::test]
async fn after_four_hundred_turns_the_model_still_sees_the_request_it_answers_and_the_summaries() {
    let fake = FakeOpenAi::start().await;
    fake.turn_default(Reply::Text(REPLY.into()));
    let state = tempfile::tempdir().unwrap();
    let host = start_plugin(LOSSLESS_0_15, state.path(), "127.0.0.1:0", DEFAULT_CONFIG).await;
    let g = TestGateway::start(gateway_config(&fake, &host.endpoint, 8_000)).await;
    attached(&g, "lossless").await;
    // ~150 tokens a turn.
    let request =
        |i: usize| format!("Request {i}: look at module_{i}.rs. {}", "It has a long history of changes. ".repeat(16));
    for i in 1..=400 {
        let events = run_turn(&g, "long", &request(i)).await;
        assert!(matches!(events.last(), Some(Event::Completed(_))), "turn {i}: {events:?}");
        assert_eq!(selected(&events).engine_id, "lossless", "turn {i}");
        let asked = request_ending_with(&fake, &format!("Request {i}:"))
            .unwrap_or_else(|| panic!("turn {i}: the model was not asked with the request last"));
        let seen = asked["messages"].to_string();
        for earlier in i.saturating_sub(2).max(1)..i {
            assert!(seen.contains(&format!("Request {earlier}:")), "turn {i}: request {earlier} is gone: {seen:.2000}");
        }
        if i % 40 == 0 {
            let mut s = compaction_stream(&g, "long").await;
            while let Some(e) = s.next().await {
                e.unwrap();
            }
        }
        if i == 400 {
            assert!(seen.contains("<summary"), "the model sees lossless-claw's summaries: {seen:.3000}");
            assert!(!seen.contains("Request 1:"), "and not the whole history");
        }
    }
    assert_eq!(engine_status(&g, "lossless").await.quarantine, None);
    g.stop().await;
}
