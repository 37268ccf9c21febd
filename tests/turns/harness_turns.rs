//! Harness turns (`ctxgate.v1.Harness/DriveTurn`) through the real gateway
//! (`server::run` in-process, real gRPC, real SQLite) and real engine
//! processes: the tool loop, aborts, capture-only hosts, host
//! requirements, projection, overflow, bad input, and harnesses that go
//! silent or stop reading. The helpers here serve busy_policies.rs too.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::time::Duration;

use ctxgate::config::Config;
use ctxgate_proto::gateway::{self as api, harness_event::Event as H, harness_request::Request as R};
use ctxgate_proto::pb::{Role, transcript_entry::Entry};
use ctxgate_tests::harness::{Drive, begin, client, text, tool_call, tool_result};
use ctxgate_tests::hosting::{attached_gateway, fault_engine};
use ctxgate_tests::{EngineProcess, PATIENCE, TestGateway, metrics_text, start_window, within};
use tokio_stream::StreamExt;
use tonic::Code;

use crate::limited_gateway;

fn sref(key: &str) -> Option<api::SessionRef> {
    Some(api::SessionRef { agent_id: String::new(), session_key: key.into() })
}

/// A config that selects the engine at `endpoint` as "engine".
fn hosting(endpoint: &str) -> Config {
    ctxgate_tests::hosting::hosting("engine", endpoint, &[])
}

/// The fault fixture with `faults` as a process, and a gateway using it.
async fn fault_gateway(faults: &str) -> (EngineProcess, TestGateway) {
    let engine = fault_engine(faults).await;
    let g = attached_gateway("engine", &engine.endpoint, &[]).await;
    (engine, g)
}

/// Whether any engine is quarantined now.
async fn quarantined(g: &TestGateway) -> bool {
    let s = g.client.clone().get_status(api::StatusRequest {}).await.unwrap().into_inner();
    s.engines.iter().any(|e| e.quarantine.is_some())
}

async fn branch(g: &TestGateway, key: &str) -> Vec<ctxgate_proto::pb::TranscriptEntry> {
    let req = api::GetTranscriptRequest { session: sref(key), visible_only: false, ..Default::default() };
    match g.client.clone().get_transcript(req).await {
        Ok(r) => r.into_inner().entries,
        Err(s) if s.code() == Code::NotFound => Vec::new(),
        Err(s) => panic!("{s}"),
    }
}

/// (role, text-ish) of every message on the branch.
pub(crate) async fn shape(g: &TestGateway, key: &str) -> Vec<(Role, String)> {
    branch(g, key)
        .await
        .into_iter()
        .filter_map(|e| match e.entry {
            Some(Entry::Message(m)) => Some((Role::try_from(m.role).unwrap(), ctxgate::provider::message_text(&m))),
            _ => None,
        })
        .collect()
}

pub(crate) fn status_of<T: std::fmt::Debug>(r: Result<T, tonic::Status>) -> tonic::Status {
    r.expect_err("the request is refused")
}

/// One turn with a tool loop: context, tool call, result, context, answer.
/// Returns the two contexts.
async fn tool_turn(drive: &mut Drive, n: usize) -> (api::Context, api::Context) {
    let first = drive.context().await.unwrap();
    let id = format!("call-{n}");
    drive.append(vec![tool_call(&id, "calculator", "{\"expression\":\"6*7\"}")]).await.unwrap();
    drive.append(vec![tool_result(&id, "calculator", "42")]).await.unwrap();
    let second = drive.assemble(vec![]).await.unwrap();
    drive.append(vec![text(Role::Assistant, &format!("answer {n}: 42"))]).await.unwrap();
    (first, second)
}

/// The window engine as a process, and a gateway (with metrics) using it.
struct WindowSetup {
    state: tempfile::TempDir,
    _engine: EngineProcess,
    g: TestGateway,
}

impl WindowSetup {
    async fn start() -> Self {
        let state = tempfile::tempdir().unwrap();
        let engine = start_window(state.path(), &[]).await;
        let mut config = hosting(&engine.endpoint);
        config.gateway.metrics_listen = "127.0.0.1:0".into();
        let g = TestGateway::start(config).await;
        g.wait_attached("engine").await;
        Self { state, _engine: engine, g }
    }

    /// Rows in one of the window engine's own tables.
    fn engine_rows(&self, table: &str) -> i64 {
        let db = rusqlite::Connection::open(self.state.path().join("window.sqlite")).unwrap();
        db.query_row(&format!("SELECT COUNT(*) FROM {table}"), [], |r| r.get(0)).unwrap()
    }
}

#[tokio::test]
async fn a_tool_loop_through_the_window_engine_assembles_before_every_call_and_commits_each_turn_once() {
    let w = WindowSetup::start().await;
    let g = &w.g;
    let hc = client(&g.endpoint);
    for n in 0..3 {
        let mut drive = Drive::open(&hc, begin("loop", &format!("question {n}"))).await.unwrap();
        let (first, second) = tool_turn(&mut drive, n).await;
        assert_eq!((first.sequence, second.sequence), (1, 2));
        // The second context holds the call and its result, in order, at the end.
        let tail: Vec<String> =
            second.messages.iter().rev().take(2).rev().map(ctxgate::provider::message_text).collect();
        assert!(tail[0].contains(&format!("call-{n}")) && tail[1].contains("42"), "{tail:?}");
        assert!(second.token_budget > 0 && second.token_budget <= 32_000 - 1_000);
        let ended = drive.end(api::TurnOutcome::Accepted).await.unwrap();
        assert!(ended.engine_committed, "the window engine took the turn");
        let selected =
            drive.seen.iter().find_map(|e| if let H::EngineSelected(s) = e { Some(s.clone()) } else { None }).unwrap();
        assert_eq!((selected.engine_id.as_str(), selected.reason.as_str()), ("engine", "configured"));
    }
    let got = shape(g, "loop").await;
    let roles: Vec<Role> = got.iter().map(|(r, _)| *r).collect();
    assert_eq!(roles, [Role::User, Role::Assistant, Role::Tool, Role::Assistant].repeat(3), "{got:?}");

    // The engine's own record: each turn committed once, every message once.
    let ids: Vec<String> = branch(g, "loop")
        .await
        .into_iter()
        .filter_map(|e| matches!(e.entry, Some(Entry::Message(_))).then_some(e.id))
        .collect();
    assert_eq!(w.engine_rows("commits"), 3);
    // What the engine received: one CommitTurn a turn (its table's key
    // would hide a repeat).
    let s = g.client.clone().get_status(api::StatusRequest {}).await.unwrap().into_inner();
    let engine = s.engines.iter().find(|e| e.id == "engine").unwrap();
    let commits = engine.methods.iter().find(|m| m.method == "CommitTurn").map_or(0, |m| m.calls);
    assert_eq!(commits, 3, "each turn's CommitTurn was sent once");
    let db = rusqlite::Connection::open(w.state.path().join("window.sqlite")).unwrap();
    let mut stmt = db.prepare("SELECT id FROM messages ORDER BY seq").unwrap();
    let held: Vec<String> = stmt.query_map([], |r| r.get(0)).unwrap().map(Result::unwrap).collect();
    assert_eq!(held, ids, "the engine holds each message once, in transcript order");
    let metrics = metrics_text(g.metrics.unwrap()).await;
    assert!(metrics.contains("ctxgate_turns_by_driver_total{driver=\"harness\",outcome=\"completed\"} 3"), "{metrics}");
    w.g.stop().await;
}

#[tokio::test]
async fn an_accepted_end_stores_its_messages_with_the_turn_and_bad_ones_abort_it() {
    let w = WindowSetup::start().await;
    let g = &w.g;
    let hc = client(&g.endpoint);
    // The tool loop's result and the final answer come with `end`.
    let mut drive = Drive::open(&hc, begin("last", "question")).await.unwrap();
    drive.context().await.unwrap();
    drive.append(vec![tool_call("call-1", "calculator", "{\"expression\":\"6*7\"}")]).await.unwrap();
    let last = vec![tool_result("call-1", "calculator", "42"), text(Role::Assistant, "the answer: 42")];
    let ended = drive.end_with(api::TurnOutcome::Accepted, last).await.unwrap();
    assert!(ended.engine_committed, "the window engine took the turn");
    let roles = |got: Vec<(Role, String)>| got.into_iter().map(|(r, _)| r).collect::<Vec<_>>();
    assert_eq!(roles(shape(g, "last").await), [Role::User, Role::Assistant, Role::Tool, Role::Assistant]);
    assert_eq!(w.engine_rows("messages"), 4, "the engine was committed the end's messages too");

    // What `append` refuses, `end` refuses, and the turn is aborted.
    let refused = [
        (vec![text(Role::User, "not mine")], "end.messages[0].role"),
        (vec![tool_result("call-9", "calculator", "1")], "end.messages[0].content[0].tool_result.tool_call_id"),
    ];
    for (messages, field) in refused {
        let mut drive = Drive::open(&hc, begin("last", "again")).await.unwrap();
        drive.context().await.unwrap();
        let status = status_of(drive.end_with(api::TurnOutcome::Accepted, messages).await);
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(status.message().contains(field), "{status:?}");
    }
    let mut drive = Drive::open(&hc, begin("last", "and again")).await.unwrap();
    drive.context().await.unwrap();
    let status = status_of(drive.end_with(api::TurnOutcome::Aborted, vec![text(Role::Assistant, "x")]).await);
    assert_eq!((status.code(), status.message().contains("only an accepted turn")), (Code::InvalidArgument, true));
    // The refused turns left the branch; their user messages stay (as an abort leaves them).
    let got = shape(g, "last").await;
    assert_eq!(got.len(), 7, "{got:?}");
    assert!(got[4..].iter().all(|(r, _)| *r == Role::User), "{got:?}");
    assert_eq!(w.engine_rows("commits"), 1);
    w.g.stop().await;
}

#[tokio::test]
async fn dropping_the_stream_mid_tool_loop_aborts_the_turn_and_blames_nobody() {
    let (engine, g) = fault_gateway("hang-on-tools").await;
    let hc = client(&g.endpoint);
    let mut drive = Drive::admitted(&hc, begin("drop", "read my files")).await;
    drive.append(vec![tool_call("c1", "read_file", "{\"path\":\"a\"}")]).await.unwrap();
    drive.append(vec![tool_result("c1", "read_file", "contents")]).await.unwrap();
    drive.send(R::Assemble(api::AssembleContext { pending: vec![] })).await;
    // The engine is inside the second Assemble: leave.
    engine.wait_lines("event assemble", 2, Duration::from_secs(10)).await.expect("the second assemble started");
    drop(drive);
    engine.wait_line("event cancelled Assemble", Duration::from_secs(5)).await.expect("the engine saw the cancel");

    // The next turn starts at once; the aborted one left only its user message.
    let started = std::time::Instant::now();
    let mut next = Drive::admitted(&hc, begin("drop", "next")).await;
    assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
    next.append(vec![text(Role::Assistant, "done")]).await.unwrap();
    next.end(api::TurnOutcome::Accepted).await.unwrap();
    let got = shape(&g, "drop").await;
    assert_eq!(
        got,
        [(Role::User, "read my files".into()), (Role::User, "next".into()), (Role::Assistant, "done".into())],
        "no assistant or tool entry of the aborted turn is on the branch"
    );
    assert!(!quarantined(&g).await, "an abort is never the engine's fault");
    g.stop().await;
}

#[tokio::test]
async fn a_rewrite_while_the_turn_begins_is_followed_by_its_abort() {
    // A turn on legacy first, so the engine meets a session with history.
    let engine = fault_engine("bootstraps,maintain-rewrite").await;
    let g = TestGateway::start(Config::default()).await;
    let hc = client(&g.endpoint);
    let mut d = Drive::admitted(&hc, begin("rw", "first question")).await;
    d.append(vec![text(Role::Assistant, "first answer")]).await.unwrap();
    d.end(api::TurnOutcome::Accepted).await.unwrap();
    g.reload(hosting(&engine.endpoint)).await;
    g.wait_attached("engine").await;

    // Bootstrap, then Maintain(bootstrap) rewrites the first answer: the
    // branch (this turn's admitted message included) is copied.
    let mut d = Drive::admitted(&hc, begin("rw", "second question")).await;
    engine.wait_line("event maintain", Duration::from_secs(5)).await.expect("maintenance ran at bootstrap");
    d.append(vec![tool_call("c", "read_file", "{}")]).await.unwrap();
    d.append(vec![tool_result("c", "read_file", "text")]).await.unwrap();
    let s = status_of(d.append(vec![tool_result("c", "read_file", "again")]).await);
    assert_eq!(s.code(), Code::InvalidArgument, "a second result for one call is refused");
    let got = shape(&g, "rw").await;
    assert_eq!(
        got,
        [
            (Role::User, "first question".into()),
            (Role::Assistant, "rewritten".into()),
            (Role::User, "second question".into())
        ],
        "the aborted turn's tool traffic left the rewritten branch"
    );
    g.stop().await;
}

#[tokio::test]
async fn an_explicit_abort_or_failed_end_never_reaches_the_engine_and_rewinds() {
    let w = WindowSetup::start().await;
    let g = &w.g;
    let hc = client(&g.endpoint);
    for outcome in [api::TurnOutcome::Aborted, api::TurnOutcome::Failed] {
        let mut drive = Drive::open(&hc, begin("ends", "try")).await.unwrap();
        tool_turn(&mut drive, 0).await;
        let ended = drive.end(outcome).await.unwrap();
        assert_eq!(ended.outcome, outcome as i32);
        assert!(!ended.engine_committed);
    }
    let got = shape(g, "ends").await;
    assert_eq!(got, [(Role::User, "try".into()), (Role::User, "try".into())]);
    assert_eq!(w.engine_rows("commits"), 0, "aborted and failed turns never advance engine state");
    w.g.stop().await;
}

pub(crate) fn run_req(key: &str, text: &str, busy: api::BusyPolicy) -> api::RunTurnRequest {
    api::RunTurnRequest { session: sref(key), message: text.into(), system_prompt: None, busy_policy: busy as i32 }
}

pub(crate) async fn run_to_end(
    g: &TestGateway,
    req: api::RunTurnRequest,
) -> Result<Vec<api::turn_event::Event>, tonic::Status> {
    run_to_end_owned(g.client.clone(), req).await
}

pub(crate) async fn run_to_end_owned(
    mut client: api::gateway_client::GatewayClient<tonic::transport::Channel>,
    req: api::RunTurnRequest,
) -> Result<Vec<api::turn_event::Event>, tonic::Status> {
    let what = format!("the turn {:?} ending", req.message);
    within(PATIENCE, what, async {
        let mut s = client.run_turn(req).await?.into_inner();
        let mut out = Vec::new();
        while let Some(e) = s.next().await {
            out.push(e?.event.unwrap());
        }
        Ok(out)
    })
    .await
}

#[tokio::test]
async fn a_capture_only_host_records_and_finalizes_but_never_assembles() {
    let w = WindowSetup::start().await;
    let g = &w.g;
    let hc = client(&g.endpoint);
    let capture = |key: &str, user: &str| {
        let mut b = begin(key, user);
        b.host.as_mut().unwrap().capabilities = vec!["after-turn".into()];
        b
    };
    let mut d = Drive::open(&hc, capture("cap", "hello")).await.unwrap();
    d.until(|e| if let H::EngineSelected(s) = e { Some(s.clone()) } else { None }).await.unwrap();
    d.append(vec![text(Role::Assistant, "hi there")]).await.unwrap();
    let ended = d.end(api::TurnOutcome::Accepted).await.unwrap();
    assert!(ended.engine_committed);
    assert!(!d.seen.iter().any(|e| matches!(e, H::Context(_))), "capture-only: no context: {:?}", d.seen);

    let mut d = Drive::open(&hc, capture("cap", "again")).await.unwrap();
    let s = status_of(d.assemble(vec![]).await);
    assert_eq!(s.code(), Code::FailedPrecondition);
    assert!(s.message().contains("assemble-before-prompt"), "{s:?}");
    let got = shape(g, "cap").await;
    assert_eq!(got[..2], [(Role::User, "hello".into()), (Role::Assistant, "hi there".into())]);
    w.g.stop().await;
}

#[tokio::test]
async fn missing_host_capabilities_fail_closed_before_admission_with_openclaws_message() {
    let (_engine, g) = fault_gateway("needs-threads").await;
    let hc = client(&g.endpoint);
    let s = status_of(Drive::open(&hc, begin("threads", "hi")).await.unwrap().context().await);
    assert_eq!(s.code(), Code::FailedPrecondition);
    assert!(
        s.message().starts_with("Context engine \"engine\" cannot run operation \"agent-run\" on agent harness \"test\". Missing host capabilities: thread-bootstrap-projection. Required capabilities: thread-bootstrap-projection. Host capabilities: bootstrap, assemble-before-prompt, after-turn, maintain, compact, runtime-llm-complete. Run it under a harness with persistent threads."),
        "{s:?}"
    );
    assert!(shape(&g, "threads").await.is_empty(), "nothing was admitted");
    assert!(!quarantined(&g).await);

    let mut b = begin("threads", "hi");
    b.host.as_mut().unwrap().capabilities.push("thread-bootstrap-projection".into());
    let d = Drive::admitted(&hc, b).await;
    let sel = d.seen.iter().find_map(|e| if let H::EngineSelected(s) = e { Some(s.clone()) } else { None }).unwrap();
    assert_eq!(sel.engine_id, "engine");
    g.stop().await;
}

#[tokio::test]
async fn thread_bootstrap_projection_says_when_to_reinject() {
    let (_engine, g) = fault_gateway("projection").await;
    let hc = client(&g.endpoint);
    let with_threads = |user: &str| {
        let mut b = begin("proj", user);
        b.host.as_mut().unwrap().capabilities.push("thread-bootstrap-projection".into());
        b
    };
    let mut seen = Vec::new();
    for user in ["one", "two", "a new epoch please"] {
        let mut d = Drive::open(&hc, with_threads(user)).await.unwrap();
        let p = d.context().await.unwrap().projection.unwrap();
        seen.push((p.epoch.clone(), p.reinject));
        d.append(vec![text(Role::Assistant, "ok")]).await.unwrap();
        d.end(api::TurnOutcome::Accepted).await.unwrap();
    }
    assert_eq!(seen, [("e1".into(), true), ("e1".into(), false), ("e2".into(), true)]);
    // A host without the capability gets per-turn projection.
    let mut d = Drive::open(&hc, begin("proj", "plain")).await.unwrap();
    assert!(d.context().await.unwrap().projection.is_none());
    g.stop().await;
}

#[tokio::test]
async fn overflow_compacts_and_answers_a_new_context_then_fails_clearly() {
    let mut config = Config::default();
    config.agents.defaults.compaction.keep_recent_tokens = 200;
    let g = TestGateway::start(config).await;
    let hc = client(&g.endpoint);
    for i in 0..6 {
        let mut d = Drive::admitted(&hc, begin("big", &format!("turn {i}: {}", "words ".repeat(150)))).await;
        d.append(vec![text(Role::Assistant, &format!("reply {i}: {}", "more ".repeat(150)))]).await.unwrap();
        d.end(api::TurnOutcome::Accepted).await.unwrap();
    }
    let mut d = Drive::open(&hc, begin("big", "and now?")).await.unwrap();
    let before = d.context().await.unwrap();
    d.send(R::Overflow(api::Overflow { observed_tokens: Some(40_000), pending: vec![] })).await;
    let after = d.context().await.unwrap();
    assert!(
        after.estimated_tokens < before.estimated_tokens,
        "{} -> {}",
        before.estimated_tokens,
        after.estimated_tokens
    );
    assert!(d.seen.iter().any(|e| matches!(e, H::CompactionStarted(s) if s.trigger == "overflow")));
    assert!(d.seen.iter().any(|e| matches!(e, H::CompactionDone(x) if x.compacted)));
    for _ in 0..2 {
        d.send(R::Overflow(api::Overflow::default())).await;
        d.context().await.unwrap();
    }
    d.send(R::Overflow(api::Overflow::default())).await;
    let f = d.until(|e| if let H::Failed(f) = e { Some(f.clone()) } else { None }).await.unwrap();
    assert_eq!(f.reason, "context_overflow");
    let ended = d.end(api::TurnOutcome::Failed).await.unwrap();
    assert_eq!(ended.outcome, api::TurnOutcome::Failed as i32);

    // A manual compaction mid-turn: its events, then done.
    let mut d = Drive::admitted(&hc, begin("big", "compact please")).await;
    d.send(R::Compact(api::CompactNow { custom_instructions: Some("keep file names".into()) })).await;
    let done = d.until(|e| if let H::CompactionDone(x) = e { Some(x.clone()) } else { None }).await.unwrap();
    assert!(d.seen.iter().any(|e| matches!(e, H::CompactionStarted(s) if s.trigger == "manual")));
    assert!(done.tokens_before > 0);
    g.stop().await;
}

#[tokio::test]
async fn a_peers_u64_max_usage_is_refused_and_a_huge_one_still_keeps_the_budget() {
    let g = TestGateway::start(Config::default()).await;
    let hc = client(&g.endpoint);
    let with_usage = |t: &str, n: u64| {
        let mut m = text(Role::Assistant, t);
        m.usage = Some(ctxgate_proto::pb::Usage { output_tokens: Some(n), ..Default::default() });
        m
    };
    // u64::MAX: refused with the field, nothing stored, the gateway up.
    let mut d = Drive::admitted(&hc, begin("usage", "hi")).await;
    let s = status_of(d.append(vec![with_usage("wrapped", u64::MAX)]).await);
    assert_eq!(s.code(), Code::InvalidArgument);
    assert!(s.message().starts_with("append.messages[0].usage.output_tokens: 18446744073709551615 is over"), "{s:?}");
    assert!(shape(&g, "usage").await.iter().all(|(_, t)| t != "wrapped"), "refused input stored nothing");
    // The largest count accepted, twice: the sums saturate rather than
    // wrap, so the next turn sees a history far over its budget and
    // compacts (or says it cannot), never a small wrapped total.
    let mut d = Drive::admitted(&hc, begin("usage2", "hi")).await;
    let big = ctxgate_proto::limits::MAX_USAGE_TOKENS;
    d.append(vec![with_usage("huge one", big), with_usage("huge two", big)]).await.unwrap();
    d.end(api::TurnOutcome::Accepted).await.unwrap();
    let mut d = Drive::open(&hc, begin("usage2", "again")).await.unwrap();
    let mut budget_held = false;
    while let Ok(Some(e)) = d.next().await {
        if let H::Context(c) = &e {
            assert!(
                c.estimated_tokens <= c.token_budget,
                "a context over its budget reached the harness: {} > {}",
                c.estimated_tokens,
                c.token_budget
            );
            budget_held = true;
            break;
        }
    }
    assert!(
        budget_held || d.seen.iter().any(|e| matches!(e, H::Failed(_))),
        "neither a context nor a failure: {:?}",
        d.seen
    );
    // And the gateway serves on.
    let mut d = Drive::admitted(&hc, begin("after", "still here")).await;
    d.end(api::TurnOutcome::Accepted).await.unwrap();
    g.stop().await;
}

#[tokio::test]
async fn bad_harness_input_is_refused_with_the_field_and_stores_nothing() {
    let g = TestGateway::start(Config::default()).await;
    let hc = client(&g.endpoint);
    let refused = |r: R| {
        let hc = hc.clone();
        async move { Drive::open_with(&hc, r).await.unwrap().status().await }
    };
    let s = refused(R::Assemble(api::AssembleContext::default())).await;
    assert_eq!(s.code(), Code::FailedPrecondition);
    assert!(s.message().starts_with("assemble: the first request"), "{s:?}");

    let mut b = begin("bad", "hi");
    b.host.as_mut().unwrap().capabilities.push("time-travel".into());
    let s = refused(R::Begin(b)).await;
    assert_eq!(s.code(), Code::InvalidArgument);
    assert!(s.message().starts_with("begin.host.capabilities[6]: unknown capability \"time-travel\""), "{s:?}");

    let mut b = begin("bad", "hi");
    b.model.as_mut().unwrap().context_window = 0;
    let s = refused(R::Begin(b)).await;
    assert_eq!((s.code(), s.message()), (Code::InvalidArgument, "begin.model.context_window: must be positive"));

    let mut b = begin("bad", "hi");
    b.session.as_mut().unwrap().session_key = " ".into();
    let s = refused(R::Begin(b)).await;
    assert_eq!((s.code(), s.message()), (Code::InvalidArgument, "begin.session.session_key: is required"));

    let mut b = begin("bad", "hi");
    b.session.as_mut().unwrap().session_key = "bad\nINFO forged".into();
    let s = refused(R::Begin(b)).await;
    assert_eq!(
        (s.code(), s.message()),
        (Code::InvalidArgument, "begin.session.session_key: contains a control character")
    );

    let mut b = begin("bad", "hi");
    b.host.as_mut().unwrap().id = "my-harness".into();
    assert!(refused(R::Begin(b)).await.message().starts_with("begin.host.id:"));
    let mut b = begin("bad", "hi");
    b.user_messages.clear();
    assert!(refused(R::Begin(b)).await.message().starts_with("begin.user_messages:"));
    assert!(shape(&g, "bad").await.is_empty(), "refused begins admit nothing");

    // In a turn: a result without its call, an oversized message.
    let mut d = Drive::admitted(&hc, begin("bad", "hi")).await;
    let s = status_of(d.append(vec![tool_result("nope", "calculator", "1")]).await);
    assert_eq!(s.code(), Code::InvalidArgument);
    assert_eq!(
        s.message(),
        "append.messages[0].content[0].tool_result.tool_call_id: \"nope\" is not a tool call of this turn"
    );
    let mut d = Drive::admitted(&hc, begin("bad", "hi again")).await;
    let s = status_of(d.append(vec![text(Role::Assistant, &"x".repeat(1024 * 1024 + 1))]).await);
    assert_eq!(s.code(), Code::ResourceExhausted);
    assert!(s.message().starts_with("append.messages[0].content:"), "{s:?}");
    let mut d = Drive::admitted(&hc, begin("bad", "roles")).await;
    let s = status_of(d.append(vec![text(Role::User, "sneaky")]).await);
    assert_eq!(s.message(), "append.messages[0].role: must be ROLE_ASSISTANT or ROLE_TOOL");
    let mut d = Drive::admitted(&hc, begin("bad", "metadata")).await;
    let mut m = text(Role::Assistant, "tagged");
    m.metadata = (0..65).map(|i| (format!("k{i}"), "v".into())).collect();
    let s = status_of(d.append(vec![m]).await);
    assert_eq!(s.code(), Code::ResourceExhausted);
    assert!(s.message().starts_with("append.messages[0].metadata:"), "{s:?}");
    // Accepting a turn whose tool call has no result would hand the model a
    // history it refuses.
    let mut d = Drive::admitted(&hc, begin("bad", "dangling")).await;
    d.append(vec![tool_call("open", "calculator", "{}")]).await.unwrap();
    d.send(R::End(api::End { outcome: api::TurnOutcome::Accepted as i32, ..Default::default() })).await;
    let s = d.status().await;
    assert_eq!(s.code(), Code::FailedPrecondition);
    assert!(s.message().contains("tool call \"open\" has no result"), "{s:?}");
    let users: Vec<(Role, String)> = shape(&g, "bad").await;
    let texts: Vec<&str> = ["hi", "hi again", "roles", "metadata", "dangling"].into();
    assert_eq!(
        users,
        texts.iter().map(|t| (Role::User, (*t).to_owned())).collect::<Vec<_>>(),
        "refused appends stored nothing; the refused end left no tool call on the branch"
    );

    // After end: append and a second end are refused; nothing changes.
    for late in [
        R::Append(api::Append { messages: vec![text(Role::Assistant, "late")] }),
        R::End(api::End { outcome: api::TurnOutcome::Accepted as i32, ..Default::default() }),
    ] {
        let mut d = Drive::admitted(&hc, begin("late", "hi")).await;
        d.append(vec![text(Role::Assistant, "answer")]).await.unwrap();
        d.send(R::End(api::End { outcome: api::TurnOutcome::Accepted as i32, ..Default::default() })).await;
        d.send(late).await;
        d.until(|e| matches!(e, H::Ended(_)).then_some(())).await.unwrap();
        let s = d.status().await;
        assert_eq!(s.code(), Code::FailedPrecondition);
        assert!(s.message().contains("the turn has ended"), "{s:?}");
    }
    let texts: Vec<String> = shape(&g, "late").await.into_iter().map(|(_, t)| t).collect();
    assert_eq!(texts, ["hi", "answer", "hi", "answer"]);
    g.stop().await;
}

#[tokio::test]
async fn a_silent_harness_loses_its_turn_after_the_idle_limit() {
    let g = limited_gateway(|l| l.harness_idle_seconds = 1).await;
    let hc = client(&g.endpoint);
    let mut d = Drive::admitted(&hc, begin("idle", "hello")).await;
    d.append(vec![tool_call("c", "calculator", "{}")]).await.unwrap();
    // Then nothing: the gateway ends the stream and frees the session.
    let started = std::time::Instant::now();
    let s = d.status().await;
    assert_eq!(s.code(), Code::DeadlineExceeded, "{s:?}");
    assert!(s.message().contains("harnessIdleSeconds"), "{s:?}");
    assert!(started.elapsed() < Duration::from_secs(10), "{:?}", started.elapsed());
    let events = run_to_end(&g, run_req("idle", "anyone?", api::BusyPolicy::Reject)).await.unwrap();
    assert!(matches!(events.last(), Some(api::turn_event::Event::Completed(_))), "{events:?}");
    let roles: Vec<Role> = shape(&g, "idle").await.into_iter().map(|(r, _)| r).collect();
    assert_eq!(roles, [Role::User, Role::User, Role::Assistant], "the idle turn's tool call left the branch");
    g.stop().await;
}

#[tokio::test]
async fn a_stream_that_never_begins_is_ended_after_the_begin_limit() {
    let g = limited_gateway(|l| l.harness_begin_seconds = 1).await;
    let (tx, rx) = tokio::sync::mpsc::channel::<api::HarnessRequest>(1);
    let started = std::time::Instant::now();
    let mut events =
        client(&g.endpoint).drive_turn(tokio_stream::wrappers::ReceiverStream::new(rx)).await.unwrap().into_inner();
    // Nothing sent: before `begin` there is no turn, only the clock.
    let s = within(PATIENCE, "the gateway ending a stream with no begin", events.message()).await.unwrap_err();
    assert_eq!(s.code(), Code::DeadlineExceeded, "{s:?}");
    assert!(s.message().contains("harnessBeginSeconds"), "{s:?}");
    assert!(started.elapsed() < Duration::from_secs(5), "within the 1 s limit (generously): {:?}", started.elapsed());
    drop(tx);
    g.stop().await;
}

#[tokio::test]
async fn a_harness_that_stops_reading_loses_its_turn_and_frees_the_session() {
    let g = limited_gateway(|l| l.harness_idle_seconds = 1).await;
    let hc = client(&g.endpoint);
    // Contexts of ~100 KiB each: a few fill every buffer on the way.
    let mut d = Drive::admitted(&hc, begin("deaf", &"big history ".repeat(9_000))).await;
    for _ in 0..80 {
        d.send(R::Assemble(api::AssembleContext::default())).await;
    }
    // The client reads nothing more; the gateway gives the turn up and the
    // session takes the next turn.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        match run_to_end(&g, run_req("deaf", "hello?", api::BusyPolicy::Reject)).await {
            Ok(events) => {
                assert!(matches!(events.last(), Some(api::turn_event::Event::Completed(_))), "{events:?}");
                break;
            }
            Err(s) if s.code() == Code::FailedPrecondition => {
                assert!(tokio::time::Instant::now() < deadline, "the deaf harness still holds the session");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(s) => panic!("{s:?}"),
        }
    }
    drop(d);
    g.stop().await;
}

#[tokio::test]
async fn engines_see_the_harness_as_host_with_its_model_and_capabilities() {
    let (engine, g) = fault_gateway("settings-probe").await;
    let hc = client(&g.endpoint);
    let mut b = begin("who", "hi");
    b.system_prompt_tokens = Some(500);
    let mut d = Drive::admitted(&hc, b).await;
    let line = engine.wait_line("event settings", Duration::from_secs(5)).await.unwrap();
    // Budget: window 32000 − reply reserve 1000 − system prompt 500.
    assert!(
        line.starts_with(
            "event settings host=agent-harness:test harness=test model=test-model budget=30500 max_output=1000 llm=true"
        ),
        "{line}"
    );
    d.end(api::TurnOutcome::Aborted).await.unwrap();
    // Without runtime-llm-complete the engine's grant has no host model.
    let mut b = begin("who", "again");
    b.host.as_mut().unwrap().capabilities.retain(|c| c != "runtime-llm-complete");
    let mut d = Drive::admitted(&hc, b).await;
    let lines =
        engine.wait_lines("event settings", 2, Duration::from_secs(5)).await.expect("the second assemble reported");
    assert!(lines[1].contains("llm=false"), "{lines:?}");
    d.end(api::TurnOutcome::Aborted).await.unwrap();
    g.stop().await;
}

#[tokio::test]
async fn a_turn_too_big_for_one_commit_is_refused_with_resource_exhausted() {
    let g = TestGateway::start(Config::default()).await;
    let hc = client(&g.endpoint);
    let mut d = Drive::admitted(&hc, begin("huge", "read everything")).await;
    let big = "y".repeat(1_000_000);
    let mut stored = 0;
    let refused = loop {
        let call = format!("c{stored}");
        d.append(vec![tool_call(&call, "read_file", "{}")]).await.unwrap();
        match d.append(vec![tool_result(&call, "read_file", &big)]).await {
            Ok(_) => stored += 1,
            Err(s) => break s,
        }
        assert!(stored < 20, "12 MiB of results were accepted into one turn");
    };
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert!(refused.message().contains("limited to 12 MiB in all"), "{}", refused.message());
    assert_eq!(stored, 12, "twelve 1 MB results fit, the thirteenth does not");
}
