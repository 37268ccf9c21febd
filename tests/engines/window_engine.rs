//! The window engine's behaviour: summaries and kept turns, durable state
//! across a SIGKILL, host model summaries through grants, maintenance and
//! subagent forks. In-process engines run on the real SDK server over
//! loopback; the restart test runs the real binary. Last, turns through the
//! binary hosted by a gateway: the engine owns compaction and summarises
//! through the host's model with its grant.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::time::Duration;

use ctxgate::config::ProviderKind;
use ctxgate_engine_sdk::pb::{self, compact_event::Event, context_engine_client::ContextEngineClient};
use ctxgate_engine_sdk::testkit::{TestEngine, TestHost, msg};
use ctxgate_engine_sdk::{LLM_COMPLETE, READ_TRANSCRIPT};
use ctxgate_engine_window::{Config, WindowEngine};
use ctxgate_proto::gateway as api;
use ctxgate_runtime::{connect, engine_client};
use ctxgate_tests::fake_openai::{FakeOpenAi, Kind, Reply};
use ctxgate_tests::hosting::{
    attached, compaction_stream, completed, engine_status, hosting, messages, run_turn, selected,
};
use ctxgate_tests::{EngineProcess, TestGateway, bin, harness, metrics_text, start_window};
use tokio_stream::StreamExt;
use tonic::transport::Channel;

/// `turns` exchanges; turn `t` mentions `file_t.rs` and has a tool pair
/// whose result is `tool_len` bytes long.
fn history(turns: usize, tool_len: usize) -> Vec<pb::AgentMessage> {
    (0..turns)
        .flat_map(|t| {
            [
                msg::user(&format!("u{t}"), &format!("Turn {t}: open file_{t}.rs please")),
                msg::tool_call(&format!("c{t}"), &format!("k{t}"), "read_file"),
                msg::tool_result(&format!("r{t}"), &format!("k{t}"), &"y".repeat(tool_len)),
                msg::assistant(&format!("a{t}"), &format!("file_{t}.rs looks fine")),
            ]
        })
        .collect()
}

async fn engine(config: Config) -> (TestEngine, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let engine = WindowEngine::open(dir.path(), config).unwrap();
    (TestEngine::start(engine).await.unwrap(), dir)
}

async fn ingest(c: &mut ContextEngineClient<Channel>, session: &str, messages: &[pb::AgentMessage]) {
    let r = pb::IngestBatchRequest {
        session_id: session.into(),
        session_key: Some(session.into()),
        messages: messages.to_vec(),
        is_heartbeat: false,
    };
    c.ingest_batch(r).await.unwrap();
}

fn compact_req(session: &str, host: Option<pb::HostAccess>) -> pb::CompactRequest {
    pb::CompactRequest {
        session_id: session.into(),
        session_key: session.into(),
        force: true,
        host,
        ..Default::default()
    }
}

/// Runs Compact to the end: the progress events and the result.
async fn compact(
    c: &mut ContextEngineClient<Channel>,
    req: impl tonic::IntoRequest<pb::CompactRequest>,
) -> Result<(Vec<pb::CompactProgress>, pb::CompactResult), tonic::Status> {
    let mut stream = c.compact(req).await?.into_inner();
    let mut progress = Vec::new();
    while let Some(e) = stream.next().await {
        match e?.event {
            Some(Event::Progress(p)) => progress.push(p),
            Some(Event::Result(r)) => return Ok((progress, r)),
            other => panic!("unexpected event {other:?}"),
        }
    }
    panic!("stream ended without a result")
}

async fn assemble(
    c: &mut ContextEngineClient<Channel>,
    session: &str,
    messages: Vec<pb::AgentMessage>,
    budget: Option<u64>,
) -> pb::AssembleResult {
    let r = pb::AssembleRequest { session_id: session.into(), messages, token_budget: budget, ..Default::default() };
    c.assemble(r).await.unwrap().into_inner()
}

fn ids(messages: &[pb::AgentMessage]) -> Vec<&str> {
    messages.iter().map(|m| m.id.as_str()).collect()
}

#[tokio::test]
async fn compaction_keeps_the_last_turns_and_summarises_the_rest() {
    let (e, _dir) = engine(Config { keep_turns: 3, chunk_messages: 8, ..Config::default() }).await;
    let mut c = e.client.clone();
    let h = history(10, 1000);
    ingest(&mut c, "s", &h).await;

    let (progress, r) = compact(&mut c, compact_req("s", None)).await.unwrap();
    assert!(r.ok && r.compacted);
    assert_eq!(r.first_kept_entry_id.as_deref(), Some("u7"), "the last 3 turns start at u7");
    assert_eq!(progress.len(), 28 / 8 + 1 + 1, "one event per chunk of 8 of the 28 older messages, plus the final one");
    assert!(progress.iter().all(|p| p.done <= p.total));
    let summary = r.summary.unwrap();
    for t in 0..7 {
        assert!(summary.contains(&format!("file_{t}.rs")), "identifier of turn {t} lost: {summary}");
    }
    assert!(r.tokens_after.unwrap() < r.tokens_before);

    let a = assemble(&mut c, "s", h.clone(), None).await;
    assert!(a.messages[0].id.starts_with("window-summary:s:"));
    assert_eq!(msg::text_of(&a.messages[0]), summary);
    assert_eq!(ids(&a.messages[1..]), ids(&h[28..]), "summary, then the kept turns verbatim");
    assert_eq!(a.estimated_tokens, ctxgate_engine_sdk::estimate::messages_tokens(&a.messages));

    // A second compaction folds the first summary in: old identifiers stay.
    let more = history(14, 1000);
    ingest(&mut c, "s", &more[40..]).await;
    let (_, r2) = compact(&mut c, compact_req("s", None)).await.unwrap();
    let s2 = r2.summary.unwrap();
    assert!(s2.contains("file_0.rs") && s2.contains("file_10.rs"), "{s2}");
}

#[tokio::test]
async fn assemble_under_a_budget_drops_whole_old_turns_and_keeps_the_newest() {
    let (e, _dir) = engine(Config::default()).await;
    let mut c = e.client.clone();
    let h = history(6, 400);
    let per_turn = ctxgate_engine_sdk::estimate::messages_tokens(&h[..4]);
    let a = assemble(&mut c, "b", h.clone(), Some(per_turn * 2)).await;
    assert_eq!(ids(&a.messages), ids(&h[16..]), "the two newest turns fit");
    assert!(a.estimated_tokens <= per_turn * 2);
    // A budget smaller than one turn still keeps the newest turn whole.
    let a = assemble(&mut c, "b", h.clone(), Some(1)).await;
    assert_eq!(ids(&a.messages), ids(&h[20..]));
    ctxgate_engine_sdk::validate::tool_pairs(&a.messages, "messages").unwrap();
}

#[tokio::test]
async fn state_survives_a_sigkill_and_restart() {
    let dir = tempfile::tempdir().unwrap();
    let h = history(9, 50);
    let first = start_window(dir.path(), &["--keep-turns", "2"]).await;
    let mut c = engine_client(connect(&first.endpoint).unwrap());
    ingest(&mut c, "durable", &h).await;
    let (_, r) = compact(&mut c, compact_req("durable", None)).await.unwrap();
    let commit = pb::CommitTurnRequest {
        advancement_key: "turn-9".into(),
        admission: Some(pb::TranscriptTurnAdmission {
            logical_turn_id: "turn-9".into(),
            role: pb::Role::User as i32,
            ..Default::default()
        }),
        terminal: Some(pb::TranscriptEntryAnchor::default()),
        messages: vec![msg::user("u9", "Turn 9: and file_9.rs?")],
        session_id: "durable".into(),
        ..Default::default()
    };
    assert_eq!(c.commit_turn(commit.clone()).await.unwrap().into_inner().status, pb::CommitStatus::Committed as i32);
    first.signal_and_wait("KILL").await.unwrap();

    let second = start_window(dir.path(), &["--keep-turns", "2"]).await;
    let mut c = engine_client(connect(&second.endpoint).unwrap());
    assert_eq!(
        c.commit_turn(commit).await.unwrap().into_inner().status,
        pb::CommitStatus::Duplicate as i32,
        "commit keys survive"
    );
    let mut all = h.clone();
    all.push(msg::user("u9", "Turn 9: and file_9.rs?"));
    let a = assemble(&mut c, "durable", all.clone(), None).await;
    assert_eq!(msg::text_of(&a.messages[0]), r.summary.unwrap(), "the summary survives");
    assert_eq!(ids(&a.messages[1..]), ids(&all[28..]));
    let ingested = c
        .ingest(pb::IngestRequest { session_id: "durable".into(), message: Some(h[0].clone()), ..Default::default() })
        .await
        .unwrap();
    assert!(!ingested.into_inner().ingested, "message ids survive");
}

#[tokio::test]
async fn summaries_come_from_the_host_model_when_the_grant_allows_it() {
    let (e, _dir) = engine(Config { keep_turns: 1, ..Config::default() }).await;
    let host = TestHost::start().await.unwrap();
    host.on_llm(|req| Ok(format!("MODEL SUMMARY of {} chars", req.messages[0].content.len())));
    let mut c = e.client.clone();
    ingest(&mut c, "llm", &history(3, 10)).await;

    let grant = host.grant("llm", &[LLM_COMPLETE], Duration::from_secs(30));
    let (_, r) = compact(&mut c, compact_req("llm", Some(grant))).await.unwrap();
    assert!(r.summary.unwrap().starts_with("MODEL SUMMARY"));
    assert!(r.details_json.unwrap().contains("\"source\":\"llm\""));
    let calls = host.llm_calls();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].purpose, "context-engine.compaction");

    // A grant without llm_complete: the extractive summariser, no model call.
    ingest(&mut c, "llm", &history(5, 10)[12..]).await;
    let grant = host.grant("llm", &[READ_TRANSCRIPT], Duration::from_secs(30));
    let (_, r) = compact(&mut c, compact_req("llm", Some(grant))).await.unwrap();
    assert!(r.details_json.unwrap().contains("\"source\":\"extractive\""));
    assert_eq!(host.llm_calls().len(), 1);
}

#[tokio::test]
async fn a_failing_host_model_falls_back_to_the_extractive_summary() {
    let (e, _dir) = engine(Config { keep_turns: 1, ..Config::default() }).await;
    let host = TestHost::start().await.unwrap();
    host.on_llm(|_| Err(tonic::Status::unavailable("model down")));
    let mut c = e.client.clone();
    ingest(&mut c, "f", &history(3, 10)).await;
    let grant = host.grant("f", &[LLM_COMPLETE], Duration::from_secs(30));
    let (_, r) = compact(&mut c, compact_req("f", Some(grant))).await.unwrap();
    assert!(r.compacted);
    assert!(r.summary.unwrap().contains("file_0.rs"));
}

#[tokio::test]
async fn a_slow_host_model_is_cut_at_the_deadline_and_changes_nothing() {
    let (e, _dir) = engine(Config { keep_turns: 1, ..Config::default() }).await;
    let host = TestHost::start().await.unwrap();
    host.on_llm(|_| Ok("late".into()));
    host.set_llm_delay(Duration::from_secs(30));
    let mut c = e.client.clone();
    let h = history(3, 10);
    ingest(&mut c, "slow", &h).await;
    let grant = host.grant("slow", &[LLM_COMPLETE], Duration::from_secs(60));
    let mut req = tonic::Request::new(compact_req("slow", Some(grant)));
    req.set_timeout(Duration::from_millis(300));
    let err = compact(&mut c, req).await.expect_err("the deadline cuts the compaction");
    assert!(matches!(err.code(), tonic::Code::DeadlineExceeded | tonic::Code::Cancelled), "{err:?}");
    let a = assemble(&mut c, "slow", h.clone(), None).await;
    assert_eq!(ids(&a.messages), ids(&h), "no summary was saved");
}

#[tokio::test]
async fn bootstrap_imports_the_visible_history_through_the_host() {
    let (e, _dir) = engine(Config::default()).await;
    let host = TestHost::start().await.unwrap();
    let h = history(2, 10);
    let entries = h
        .iter()
        .enumerate()
        .map(|(i, m)| pb::TranscriptEntry {
            id: m.id.clone(),
            seq: i as u64 + 1,
            entry: Some(pb::transcript_entry::Entry::Message(m.clone())),
            ..Default::default()
        })
        .collect();
    host.set_transcript("boot", entries);
    let mut c = e.client.clone();

    // A grant for another session is not used to read this one.
    let other = host.grant("other", &[READ_TRANSCRIPT], Duration::from_secs(30));
    let r = c
        .bootstrap(pb::BootstrapRequest { session_id: "boot".into(), host: Some(other), ..Default::default() })
        .await
        .unwrap()
        .into_inner();
    assert!(!r.bootstrapped);

    let grant = host.grant("boot", &[READ_TRANSCRIPT], Duration::from_secs(30));
    let r = c
        .bootstrap(pb::BootstrapRequest { session_id: "boot".into(), host: Some(grant.clone()), ..Default::default() })
        .await
        .unwrap()
        .into_inner();
    assert!(r.bootstrapped);
    assert_eq!(r.imported_messages, Some(8));
    let again = c
        .bootstrap(pb::BootstrapRequest { session_id: "boot".into(), host: Some(grant), ..Default::default() })
        .await
        .unwrap()
        .into_inner();
    assert!(!again.bootstrapped, "a known session is not imported twice");
}

#[tokio::test]
async fn maintain_elides_old_oversized_tool_results_once() {
    let (e, _dir) = engine(Config { keep_turns: 2, max_tool_result_bytes: 1000, ..Config::default() }).await;
    let mut c = e.client.clone();
    ingest(&mut c, "m", &history(5, 5000)).await;
    let req =
        pb::MaintainRequest { session_id: "m".into(), reason: pb::MaintainReason::Turn as i32, ..Default::default() };
    let r = c.maintain(req.clone()).await.unwrap().into_inner();
    let replaced: Vec<_> = r.replacements.iter().map(|x| x.entry_id.as_str()).collect();
    assert_eq!(replaced, ["r0", "r1", "r2"], "only results older than the 2 kept turns");
    for rep in &r.replacements {
        let m = rep.message.as_ref().unwrap();
        assert_eq!(m.id, rep.entry_id);
        assert!(msg::text_of(m).contains("5000 bytes elided"));
    }
    ctxgate_engine_sdk::validate::result::maintain(&r).unwrap();
    assert!(c.maintain(req).await.unwrap().into_inner().replacements.is_empty());
}

#[tokio::test]
async fn a_commit_says_maintenance_is_due_only_while_an_oversized_tool_result_waits() {
    let (e, _dir) = engine(Config { keep_turns: 1, max_tool_result_bytes: 1000, ..Config::default() }).await;
    let mut c = e.client.clone();
    let turns = [history(1, 10), history(2, 5000)[4..].to_vec(), history(3, 10)[8..].to_vec()];
    let mut due = Vec::new();
    for (i, messages) in turns.into_iter().enumerate() {
        let commit = pb::CommitTurnRequest {
            advancement_key: format!("t{i}"),
            admission: Some(pb::TranscriptTurnAdmission {
                logical_turn_id: format!("t{i}"),
                role: pb::Role::User as i32,
                ..Default::default()
            }),
            terminal: Some(pb::TranscriptEntryAnchor::default()),
            messages,
            session_id: "due".into(),
            ..Default::default()
        };
        let r = c.commit_turn(commit).await.unwrap().into_inner();
        assert_eq!(r.status, pb::CommitStatus::Committed as i32);
        due.push(r.maintenance_due);
    }
    // Small results: nothing to do. A 5000-byte one: due, and still due
    // while it waits (kept) and once it left the kept turn.
    assert_eq!(due, [Some(false), Some(true), Some(true)]);
    let req =
        pb::MaintainRequest { session_id: "due".into(), reason: pb::MaintainReason::Turn as i32, ..Default::default() };
    let r = c.maintain(req).await.unwrap().into_inner();
    assert_eq!(r.replacements.iter().map(|x| x.entry_id.as_str()).collect::<Vec<_>>(), ["r1"]);
    let after = pb::AfterTurnRequest {
        session_id: "due".into(),
        messages: vec![msg::user("u3", "Turn 3"), msg::assistant("a3", "done")],
        ..Default::default()
    };
    let r = c.after_turn(after).await.unwrap().into_inner();
    assert_eq!(r.maintenance_due, Some(false), "elided: nothing waits any more");
}

#[tokio::test]
async fn fork_subagents_start_from_the_parents_summary_and_tail_and_clean_up() {
    let (e, _dir) = engine(Config { keep_turns: 1, ..Config::default() }).await;
    let mut c = e.client.clone();
    let h = history(4, 10);
    ingest(&mut c, "parent", &h).await;
    let (_, parent) = compact(&mut c, compact_req("parent", None)).await.unwrap();

    let isolated = pb::PrepareSubagentSpawnRequest {
        parent_session_key: "parent".into(),
        child_session_key: "iso".into(),
        context_mode: pb::SubagentContextMode::Isolated as i32,
        ..Default::default()
    };
    assert!(!c.prepare_subagent_spawn(isolated).await.unwrap().into_inner().prepared);

    let fork = pb::PrepareSubagentSpawnRequest {
        parent_session_key: "parent".into(),
        child_session_key: "child".into(),
        context_mode: pb::SubagentContextMode::Fork as i32,
        ttl_ms: Some(60_000),
        ..Default::default()
    };
    let prep = c.prepare_subagent_spawn(fork.clone()).await.unwrap().into_inner();
    assert!(prep.prepared);
    let child = assemble(&mut c, "child", vec![msg::user("cu", "child task")], None).await;
    assert_eq!(msg::text_of(&child.messages[0]), parent.summary.clone().unwrap());

    // Rolling back forgets the child; a second rollback is harmless.
    let rb = pb::RollbackSubagentSpawnRequest {
        rollback_token: prep.rollback_token.unwrap(),
        child_session_key: "child".into(),
    };
    c.rollback_subagent_spawn(rb.clone()).await.unwrap();
    c.rollback_subagent_spawn(rb).await.unwrap();
    let child = assemble(&mut c, "child", vec![msg::user("cu", "child task")], None).await;
    assert_eq!(ids(&child.messages), ["cu"]);

    // A deleted subagent is forgotten too.
    c.prepare_subagent_spawn(fork).await.unwrap();
    let ended = pb::OnSubagentEndedRequest {
        child_session_key: "child".into(),
        reason: pb::SubagentEndReason::Deleted as i32,
        ..Default::default()
    };
    c.on_subagent_ended(ended).await.unwrap();
    let child = assemble(&mut c, "child", vec![msg::user("cu", "child task")], None).await;
    assert_eq!(ids(&child.messages), ["cu"]);
}

#[tokio::test]
async fn after_turn_compacts_on_its_own_once_enough_turns_pile_up() {
    let (e, _dir) = engine(Config { keep_turns: 2, auto_compact_after: 2, ..Config::default() }).await;
    let mut c = e.client.clone();
    let h = history(4, 10);
    let turn = |messages: Vec<pb::AgentMessage>| pb::AfterTurnRequest {
        session_id: "auto".into(),
        messages,
        ..Default::default()
    };
    c.after_turn(turn(h.clone())).await.unwrap();
    assert_eq!(ids(&assemble(&mut c, "auto", h.clone(), None).await.messages), ids(&h), "4 turns: not yet");
    let h = history(5, 10);
    c.after_turn(turn(h.clone())).await.unwrap();
    let a = assemble(&mut c, "auto", h.clone(), None).await;
    assert!(a.messages[0].id.starts_with("window-summary:"), "5 turns > 2 kept + 2: compacted");
    assert_eq!(ids(&a.messages[1..]), ids(&h[12..]));
}

/// A gateway hosting `engine` as "window", attached, with metrics and the
/// `fake` model as its provider.
async fn hosted_with_model(engine: &EngineProcess, fake: &FakeOpenAi) -> TestGateway {
    let mut config = hosting("window", &engine.endpoint, &[]);
    config.gateway.metrics_listen = "127.0.0.1:0".into();
    config.models.provider = ProviderKind::Openai;
    config.models.base_url = fake.base_url.clone();
    config.models.model = "gpt-test".into();
    let g = TestGateway::start(config).await;
    attached(&g, "window").await;
    g
}

#[tokio::test]
async fn turns_run_through_the_window_engine_as_a_real_process() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().to_str().unwrap().to_owned();
    let engine = EngineProcess::start(
        bin("ctxgate-engine-window"),
        &["--listen", "127.0.0.1:0", "--state-dir", &state, "--keep-turns", "2"],
    )
    .await
    .unwrap();
    // A real (local) model behind the host: the engine's summaries go
    // through Host.LlmComplete with its grant.
    let fake = FakeOpenAi::start().await;
    fake.summary_default(Reply::Text(ctxgate_tests::fake_openai::good_summary("module_0.rs")));
    let g = hosted_with_model(&engine, &fake).await;
    for i in 0..6 {
        let events = run_turn(&g, "w", &format!("Turn {i}: look at module_{i}.rs please")).await;
        assert!(completed(&events), "{events:?}");
        assert_eq!(selected(&events).engine_id, "window");
        assert_eq!(selected(&events).reason, "configured");
    }
    // Manual compaction goes to the engine, which owns it; progress streams through.
    let mut stream = compaction_stream(&g, "w").await;
    let mut progress = 0;
    let mut done = None;
    while let Some(e) = stream.next().await {
        match e.unwrap().event.unwrap() {
            api::compaction_event::Event::Progress(_) => progress += 1,
            api::compaction_event::Event::Done(d) => done = Some(d),
            api::compaction_event::Event::Started(_) => {}
        }
    }
    let done = done.unwrap();
    assert!(done.compacted && done.entry_id.is_none(), "engine-owned: reported, transcript untouched: {done:?}");
    assert!(progress >= 1, "the engine's progress reached the client");
    assert_eq!(messages(&g, "w").await.len(), 12, "every message is still in the transcript");
    // The engine summarised through the host's model, with its grant.
    let metrics = metrics_text(g.metrics.unwrap()).await;
    assert!(
        metrics.contains("ctxgate_host_llm_calls_total{engine=\"window\",operation=\"context-engine.compaction\"}"),
        "{metrics}"
    );
    assert!(metrics.contains("ctxgate_engine_calls_total{engine=\"window\",method=\"Assemble\"} 6"), "{metrics}");

    let e = engine_status(&g, "window").await;
    assert_eq!(e.health, "SERVING");
    assert!(e.quarantine.is_none());
    let assemble = e.methods.iter().find(|m| m.method == "Assemble").unwrap();
    assert_eq!((assemble.calls, assemble.failures), (6, 0));
    g.stop().await;
}

/// A durable engine hears of a harness turn through CommitTurn, from the
/// gateway's outbox; that call carries a grant of what the turn's host
/// allowed, so the window engine's scheduled compaction (at the third turn
/// here) summarises through the gateway's model — and extractively for a
/// host without runtime-llm-complete. (The OpenClaw plugin's turns are
/// such turns.)
#[tokio::test]
async fn a_commit_carries_the_host_callbacks_its_turns_host_allowed() {
    for with_llm in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().to_str().unwrap().to_owned();
        let args = ["--listen", "127.0.0.1:0", "--state-dir", &state, "--keep-turns", "1", "--auto-compact-after", "1"];
        let engine = EngineProcess::start(bin("ctxgate-engine-window"), &args).await.unwrap();
        // The engine's summary prompt is not the gateway's: the fake answers it as a turn.
        let fake = FakeOpenAi::start().await;
        fake.turn_default(Reply::Text("A summary from the model.".into()));
        let g = hosted_with_model(&engine, &fake).await;
        let hc = harness::client(&g.endpoint);
        for i in 0..3 {
            let mut b = harness::begin("h", &format!("Turn {i}: look at module_{i}.rs please"));
            if !with_llm {
                b.host.as_mut().unwrap().capabilities.retain(|c| c != "runtime-llm-complete");
            }
            let mut d = harness::Drive::admitted(&hc, b).await;
            d.append(vec![harness::text(pb::Role::Assistant, &format!("module_{i}.rs looks fine"))]).await.unwrap();
            assert!(d.end(api::TurnOutcome::Accepted).await.unwrap().engine_committed);
        }
        let summary: String = rusqlite::Connection::open(dir.path().join("window.sqlite"))
            .unwrap()
            .query_row("SELECT summary FROM summaries WHERE session_id <> ''", [], |r| r.get(0))
            .expect("the engine compacted at its third turn");
        let metrics = metrics_text(g.metrics.unwrap()).await;
        let llm =
            metrics.contains("ctxgate_host_llm_calls_total{engine=\"window\",operation=\"context-engine.compaction\"}");
        assert_eq!(llm, with_llm, "the model summarised iff the host allowed it: {summary}\n{metrics}");
        assert_eq!(
            summary == "A summary from the model.",
            with_llm,
            "the model's summary, or the extractive one: {summary}"
        );
        assert_eq!(
            fake.count(Kind::Turn),
            usize::from(with_llm),
            "harness turns bring their own model: only the summary asks this one"
        );
        g.stop().await;
    }
}
