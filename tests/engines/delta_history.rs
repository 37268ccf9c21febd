//! DELTA history delivery with real engine processes: the window engine
//! gets only what is new each turn, resyncs through `history_gap` after
//! losing its state (no quarantine, no failed turn), keeps a summary with
//! the safeguard headings when the host's model is offline; the Python
//! engine keeps its state across a restart; a durable DELTA engine's
//! commits place each turn at its visible index, aborted turns between;
//! an after-turn engine hears the size of what the model was shown.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::path::Path;
use std::sync::{Arc, Mutex};

use ctxgate_engine_sdk::pb;
use ctxgate_engine_sdk::testkit::{TestEngine, msg};
use ctxgate_engine_sdk::{CallContext, CompactOutcome, ContextEngine, EngineError, Progress};
use ctxgate_proto::extractive::HEADINGS;
use ctxgate_proto::gateway as api;
use ctxgate_proto::pb::Role;
use ctxgate_tests::harness::{Drive, begin, client, text};
use ctxgate_tests::hosting::*;
use ctxgate_tests::{EngineProcess, TestGateway, counter, metrics_text, start_python, start_window};

async fn sent(g: &TestGateway, engine: &str, method: &str) -> u64 {
    let m = metrics_text(g.metrics.unwrap()).await;
    counter(&m, "ctxgate_engine_sent_bytes_total", &format!("engine=\"{engine}\",method=\"{method}\""))
}

async fn gateway_for(id: &str, engine: &EngineProcess) -> TestGateway {
    let mut config = hosting(id, &engine.endpoint, &[]);
    config.gateway.metrics_listen = "127.0.0.1:0".into();
    let g = TestGateway::start(config).await;
    attached(&g, id).await;
    g
}

fn rows(db: &Path, sql: &str) -> i64 {
    let c = rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY).unwrap();
    c.query_row(sql, [], |r| r.get(0)).unwrap()
}

/// SIGKILLs the window engine, deletes its state and starts it again at
/// the same address (as a restarted container or another replica would).
async fn lose_state_and_restart(engine: EngineProcess, dir: &Path) -> EngineProcess {
    let addr = engine.endpoint.strip_prefix("http://").unwrap().to_owned();
    engine.signal_and_wait("KILL").await.unwrap();
    std::fs::remove_dir_all(dir).unwrap();
    let args = ["--listen", addr.as_str(), "--state-dir", dir.to_str().unwrap()];
    EngineProcess::start(ctxgate_tests::bin("ctxgate-engine-window"), &args).await.unwrap()
}

const FILLER: &str = "context that keeps growing with every turn of this long session ";

#[tokio::test]
async fn the_window_engine_gets_only_what_is_new_and_resyncs_after_losing_its_state() {
    let dir = tempfile::tempdir().unwrap();
    let engine = start_window(dir.path(), &[]).await;
    let g = gateway_for("window", &engine).await;
    let turn = |i: usize| format!("turn {i}: {}", FILLER.repeat(30));
    let mut per_turn = Vec::new();
    for i in 0..12 {
        let before = sent(&g, "window", "Assemble").await;
        assert!(completed(&run_turn(&g, "long", &turn(i)).await));
        per_turn.push(sent(&g, "window", "Assemble").await - before);
    }
    // A turn's Assemble carries the new user message, not 24 messages of history.
    let history_bytes = 12 * turn(0).len() as u64;
    assert!(per_turn[11] < history_bytes / 4, "{per_turn:?} vs a history of {history_bytes} bytes");
    assert!(per_turn[11] <= per_turn[1] * 2, "flat, not growing with the session: {per_turn:?}");

    // The engine loses everything and comes back at the same address.
    let _engine = lose_state_and_restart(engine, dir.path()).await;
    attached(&g, "window").await;

    let resynced = run_turn(&g, "long", &turn(12)).await;
    assert!(completed(&resynced), "{resynced:?}");
    assert_eq!(selected(&resynced).engine_id, "window", "served by the engine, not legacy");
    assert!(engine_status(&g, "window").await.quarantine.is_none(), "a gap never quarantines");
    let m = metrics_text(g.metrics.unwrap()).await;
    assert_eq!(counter(&m, "ctxgate_engine_history_gaps_total", "engine=\"window\",method=\"Assemble\""), 1, "{m}");
    let before = sent(&g, "window", "Assemble").await;
    assert!(completed(&run_turn(&g, "long", &turn(13)).await));
    let after = sent(&g, "window", "Assemble").await - before;
    assert!(after < history_bytes / 4, "the next Assemble is a delta again: {after} bytes");
    // The engine holds the whole session again: the 26 turn messages (the
    // last turn's reply through its commit).
    let db = dir.path().join("window.sqlite");
    assert!(rows(&db, "SELECT COUNT(*) FROM messages") >= 28, "resynced history plus the new turns");
    g.stop().await;
}

#[tokio::test]
async fn with_an_offline_host_model_the_window_summary_has_the_safeguard_headings() {
    let dir = tempfile::tempdir().unwrap();
    let engine = start_window(dir.path(), &[]).await;
    let g = gateway_for("window", &engine).await;
    for i in 0..30 {
        let text = format!("Step {i}: we decided to keep ticket OPS-{i}00 open; edit src/mod_{i}.rs next.");
        assert!(completed(&run_turn(&g, "planted", &text).await));
    }
    let c = rusqlite::Connection::open_with_flags(
        dir.path().join("window.sqlite"),
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
    )
    .unwrap();
    let (summary, covered): (String, i64) =
        c.query_row("SELECT summary, covered_seq FROM summaries", [], |r| Ok((r.get(0)?, r.get(1)?))).unwrap();
    assert!(!summary.contains("(offline model)"), "the offline model's chat text is never a summary: {summary}");
    for h in HEADINGS {
        assert!(summary.contains(h), "{h} missing:\n{summary}");
    }
    assert!(summary.contains("OPS-2000") && summary.contains("src/mod_20.rs"), "recent identifiers:\n{summary}");
    // Compaction after CommitTurn keeps up: all but the kept turns (4) and
    // the threshold's slack (4 more) are summarised.
    assert!(covered >= 60 - 2 * 8, "covered_seq {covered} of 60 messages");
    g.stop().await;
}

#[tokio::test]
async fn the_python_engine_keeps_its_state_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let engine = start_python(dir.path()).await;
    let g = gateway_for("py", &engine).await;
    for i in 0..3 {
        assert!(completed(&run_turn(&g, "kept", &format!("python turn {i}")).await));
    }
    engine.signal_and_wait("KILL").await.unwrap();
    let engine = start_python(dir.path()).await;
    let mut config = hosting("py", &engine.endpoint, &[]);
    config.gateway.metrics_listen = "127.0.0.1:0".into();
    g.reload(config).await;
    attached(&g, "py").await;
    let next = run_turn(&g, "kept", "python turn 3").await;
    assert!(completed(&next), "{next:?}");
    assert_eq!(selected(&next).engine_id, "py");
    let m = metrics_text(g.metrics.unwrap()).await;
    assert_eq!(counter(&m, "ctxgate_engine_history_gaps_total", "engine=\"py\",method=\"Assemble\""), 0, "{m}");
    g.stop().await;
}

#[tokio::test]
async fn a_resync_after_maintenance_rewrites_delivers_the_rewritten_messages_too() {
    use ctxgate_proto::gateway::TurnOutcome;
    use ctxgate_proto::pb::Role;
    use ctxgate_tests::harness::{Drive, begin, client, text, tool_call, tool_result};
    let dir = tempfile::tempdir().unwrap();
    let engine = start_window(dir.path(), &["--keep-turns", "2", "--max-tool-result-bytes", "1000"]).await;
    let g = gateway_for("window", &engine).await;
    let hc = client(&g.endpoint);
    // Tool turns with big results: once older than the kept turns, the
    // engine's Maintain elides them, i.e. the gateway rewrites the branch.
    for i in 0..6 {
        let mut d = Drive::admitted(&hc, begin("tools", &format!("read part {i}"))).await;
        let call = format!("c{i}");
        d.append(vec![tool_call(&call, "read_file", "{}")]).await.unwrap();
        d.append(vec![tool_result(&call, "read_file", &"x".repeat(4_000))]).await.unwrap();
        d.append(vec![text(Role::Assistant, &format!("part {i} read"))]).await.unwrap();
        d.end(TurnOutcome::Accepted).await.unwrap();
    }
    let texts = messages(&g, "tools").await;
    assert!(texts.iter().any(|t| t.contains("elided by the window engine")), "a rewrite happened: {texts:?}");

    let _engine = lose_state_and_restart(engine, dir.path()).await;
    attached(&g, "window").await;
    assert!(completed(&run_turn(&g, "tools", "what did we read?").await));
    // Everything visible before that turn, rewritten copies included, went
    // back to the engine; then that turn's own commit.
    let db = dir.path().join("window.sqlite");
    assert_eq!(rows(&db, "SELECT COUNT(*) FROM messages") as usize, messages(&g, "tools").await.len());
    g.stop().await;
}

/// A durable DELTA engine that keeps only what its commits say: each
/// turn's first message text and `active_message_position`.
struct Positions {
    commits: Arc<Mutex<Vec<(String, u64)>>>,
}

impl ContextEngine for Positions {
    async fn get_info(&self, _: &CallContext) -> Result<pb::EngineInfo, EngineError> {
        use ctxgate_proto::Method;
        let methods = [Method::GetInfo, Method::Ingest, Method::IngestBatch, Method::Assemble, Method::Compact];
        Ok(pb::EngineInfo {
            id: "positions".into(),
            name: "positions".into(),
            version: "1".into(),
            contract_version: ctxgate_proto::CONTRACT_VERSION.into(),
            transcript_semantics: Some(pb::TranscriptSemantics {
                current_turn_fence: pb::CurrentTurnFence::BeforeCurrentTurnEntryV1 as i32,
                turn_advancement_idempotency: pb::TurnAdvancementIdempotency::AtomicIdempotentV1 as i32,
            }),
            implemented_methods: methods.iter().chain([&Method::CommitTurn]).map(|m| m.name().to_owned()).collect(),
            history_delivery: pb::HistoryDelivery::Delta as i32,
            ..Default::default()
        })
    }

    async fn ingest(&self, _: &CallContext, _: pb::IngestRequest) -> Result<pb::IngestResult, EngineError> {
        Ok(pb::IngestResult { ingested: true })
    }

    async fn ingest_batch(
        &self,
        _: &CallContext,
        req: pb::IngestBatchRequest,
    ) -> Result<pb::IngestBatchResult, EngineError> {
        Ok(pb::IngestBatchResult { ingested_count: req.messages.len() as u64 })
    }

    async fn assemble(&self, _: &CallContext, req: pb::AssembleRequest) -> Result<pb::AssembleResult, EngineError> {
        Ok(pb::AssembleResult { estimated_tokens: 1, messages: req.messages, ..Default::default() })
    }

    async fn compact(
        &self,
        _: &CallContext,
        _: pb::CompactRequest,
        _: Progress,
    ) -> Result<CompactOutcome, EngineError> {
        Ok(CompactOutcome::DelegateToHost(pb::DelegateToHost::default()))
    }

    async fn commit_turn(
        &self,
        _: &CallContext,
        req: pb::CommitTurnRequest,
    ) -> Result<pb::CommitTurnResult, EngineError> {
        let first = req.messages.first().map(msg::text_of).unwrap_or_default();
        let position = req.admission.and_then(|a| a.anchor).map_or(u64::MAX, |a| a.active_message_position);
        self.commits.lock().unwrap().push((first, position));
        Ok(pb::CommitTurnResult { status: pb::CommitStatus::Committed as i32, maintenance_due: None })
    }
}

#[tokio::test]
async fn a_delta_commits_position_is_the_visible_index_with_an_aborted_turn_before_it() {
    let commits = Arc::new(Mutex::new(Vec::new()));
    let engine = TestEngine::start(Positions { commits: commits.clone() }).await.unwrap();
    let g = attached_gateway("positions", &engine.endpoint, &[]).await;
    let hc = client(&g.endpoint);
    let turn = |user: &'static str| {
        let hc = hc.clone();
        async move {
            let mut d = Drive::admitted(&hc, begin("pos", user)).await;
            d.append(vec![text(Role::Assistant, &format!("reply to {user}"))]).await.unwrap();
            d.end(api::TurnOutcome::Accepted).await.unwrap();
        }
    };
    turn("u1").await;
    // Aborted: its user message stays visible, and is never committed.
    drop(Drive::admitted(&hc, begin("pos", "u2")).await);
    turn("u3").await;
    turn("u4").await;
    let visible = messages(&g, "pos").await;
    let index = |text: &str| visible.iter().position(|m| m == text).unwrap() as u64;
    let want: Vec<(String, u64)> = ["u1", "u3", "u4"].iter().map(|u| (u.to_string(), index(u))).collect();
    assert_eq!(want.iter().map(|w| w.1).collect::<Vec<_>>(), [0, 3, 5], "the transcript: {visible:?}");
    assert_eq!(*commits.lock().unwrap(), want, "each commit's position is its visible index");
    g.stop().await;
    engine.stop().await;
}

#[tokio::test]
async fn an_engines_first_contact_imports_the_history_once() {
    let dir = tempfile::tempdir().unwrap();
    let engine = start_window(dir.path(), &[]).await;
    // The session's history is made before the engine is configured.
    let mut config = ctxgate::config::Config::default();
    config.gateway.metrics_listen = "127.0.0.1:0".into();
    let g = TestGateway::start(config).await;
    for i in 0..5 {
        assert!(completed(&run_turn(&g, "older", &format!("before the engine, turn {i}")).await));
    }
    let mut with_engine = hosting("window", &engine.endpoint, &[]);
    with_engine.gateway.metrics_listen = "127.0.0.1:0".into();
    g.reload(with_engine).await;
    g.wait_attached("window").await;

    let first = run_turn(&g, "older", "the engine's first turn").await;
    assert!(completed(&first) && selected(&first).engine_id == "window", "{first:?}");
    // Bootstrap imported the ten messages through the Host service; no
    // IngestBatch sent them again.
    assert_eq!(sent(&g, "window", "IngestBatch").await, 0, "the history was sent twice");
    let db = dir.path().join("window.sqlite");
    assert_eq!(rows(&db, "SELECT COUNT(*) FROM messages"), 12, "ten imported, then the turn's two");
    // The next turn is a delta after the adopted cursor.
    let before = sent(&g, "window", "Assemble").await;
    assert!(completed(&run_turn(&g, "older", "and the next").await));
    let delta = sent(&g, "window", "Assemble").await - before;
    assert!(delta < 2_000, "the next Assemble is a delta: {delta} bytes");
    g.stop().await;
}

/// A FULL after-turn engine that windows to the newest four messages and
/// records each AfterTurn's reported current token count.
struct Windowed {
    current: Arc<Mutex<Vec<u64>>>,
}

impl ContextEngine for Windowed {
    async fn get_info(&self, _: &CallContext) -> Result<pb::EngineInfo, EngineError> {
        use ctxgate_proto::Method;
        let methods = [Method::GetInfo, Method::Ingest, Method::Assemble, Method::Compact, Method::AfterTurn];
        Ok(pb::EngineInfo {
            id: "windowed".into(),
            name: "windowed".into(),
            version: "1".into(),
            contract_version: ctxgate_proto::CONTRACT_VERSION.into(),
            implemented_methods: methods.iter().map(|m| m.name().to_owned()).collect(),
            ..Default::default()
        })
    }

    async fn ingest(&self, _: &CallContext, _: pb::IngestRequest) -> Result<pb::IngestResult, EngineError> {
        Ok(pb::IngestResult { ingested: true })
    }

    async fn assemble(&self, _: &CallContext, req: pb::AssembleRequest) -> Result<pb::AssembleResult, EngineError> {
        let messages = req.messages[req.messages.len().saturating_sub(4)..].to_vec();
        let estimated_tokens = ctxgate_engine_sdk::estimate::messages_tokens(&messages);
        Ok(pb::AssembleResult { estimated_tokens, messages, ..Default::default() })
    }

    async fn compact(
        &self,
        _: &CallContext,
        _: pb::CompactRequest,
        _: Progress,
    ) -> Result<CompactOutcome, EngineError> {
        Ok(CompactOutcome::DelegateToHost(pb::DelegateToHost::default()))
    }

    async fn after_turn(&self, _: &CallContext, req: pb::AfterTurnRequest) -> Result<pb::AfterTurnResult, EngineError> {
        let current = req.runtime_context.and_then(|c| c.current_token_count).unwrap_or(u64::MAX);
        self.current.lock().unwrap().push(current);
        Ok(pb::AfterTurnResult::default())
    }
}

/// OpenClaw tells afterTurn the prompt tokens of the turn's last model call:
/// an engine (lossless-claw) measures the live context by it. Reported as
/// the whole transcript, a long session looked wedged to the engine.
#[tokio::test]
async fn after_turn_reports_the_context_the_model_was_shown_not_the_whole_transcript() {
    let current = Arc::new(Mutex::new(Vec::new()));
    let engine = TestEngine::start(Windowed { current: current.clone() }).await.unwrap();
    let g = attached_gateway("windowed", &engine.endpoint, &[]).await;
    let mut shown = Vec::new();
    for i in 0..12 {
        let events = run_turn(&g, "long", &format!("turn {i}: {}", "words of some length ".repeat(40))).await;
        assert!(completed(&events), "{events:?}");
        let assembled = events.iter().rev().find_map(|e| match e {
            api::turn_event::Event::Assembled(a) => Some(a.estimated_tokens),
            _ => None,
        });
        shown.push(assembled.expect("the turn assembled"));
    }
    assert_eq!(*current.lock().unwrap(), shown, "each AfterTurn reports its turn's assembled context");
    assert!(shown[11] < shown[0] * 4, "the window holds still as the transcript grows: {shown:?}");
    g.stop().await;
    engine.stop().await;
}
