//! Durable turns under refusals, quarantines, configuration changes and
//! deletes: each accepted turn reaches its durable engine once, in order;
//! a poison turn blocks only its own session; a deleted session is
//! forgotten by every engine that saw it. Last, the outbox from the start:
//! a durable engine gets CommitTurn instead of AfterTurn, and a commit lost
//! in transport stays queued until the engine is back.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::time::Duration;

use ctxgate_proto::gateway::{self as api, turn_event::Event};
use ctxgate_proto::pb::{self, context_engine_client::ContextEngineClient, transcript_entry::Entry};
use ctxgate_tests::hosting::*;
use ctxgate_tests::{EngineProcess, TestGateway, serve, start_window, write_file};

/// The advancement keys of the engine's `event commit` lines, in order.
fn commit_keys(lines: &[String]) -> Vec<String> {
    lines.iter().map(|l| l.split(' ').nth(2).unwrap().to_owned()).collect()
}

fn warned(events: &[Event], what: &str) -> bool {
    events.iter().any(|e| matches!(e, Event::Warning(w) if w.message.contains(what)))
}

async fn outbox_rows(g: &TestGateway) -> Vec<serde_json::Value> {
    let (code, out) = ctxgate(&["outbox", "ls", "--gateway", &g.endpoint, "--json"]).await;
    assert_eq!(code, Some(0), "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    v["rows"].as_array().unwrap().clone()
}

#[tokio::test]
async fn a_refused_commit_blocks_only_its_session_and_can_be_retried_or_dropped() {
    let (engine, g) = fault_gateway("durable,refuse-poison").await;

    let first = run_turn(&g, "poison-a", "first").await;
    assert!(completed(&first), "the turn is accepted; only its commit waits: {first:?}");
    assert!(warned(&first, "stays queued"), "{first:?}");
    let good = run_turn(&g, "good", "fine").await;
    assert!(completed(&good));
    let line = engine.wait_line(&format!("event commit {}", turn_id(&good)), Duration::from_secs(5)).await;
    assert!(line.is_some(), "other sessions keep committing to the same engine");
    assert!(engine_status(&g, "fault").await.quarantine.is_none(), "a refusal never quarantines the engine");

    // The poisoned session's next turn waits, and says why.
    let blocked = run_turn(&g, "poison-a", "second").await;
    let f = failure(&blocked).expect("the next turn is blocked");
    assert_eq!(f.reason, "engine_backlog");
    assert!(f.message.contains("refused an earlier turn") && f.message.contains("poison turn"), "{}", f.message);
    assert!(f.message.contains("ctxgate outbox retry|drop"), "{}", f.message);

    let rows = outbox_rows(&g).await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    let row = &rows[0];
    assert_eq!(row["session_key"], "poison-a");
    assert_eq!(row["advancement_key"], turn_id(&first).as_str());
    assert_eq!((row["attempts"].as_u64(), row["blocked"].as_bool()), (Some(1), Some(true)), "{row}");
    assert!(row["last_error"].as_str().unwrap().contains("poison turn"), "{row}");
    assert_eq!(row["engine_state"], "in-service");
    let s = status(&g).await;
    assert_eq!((s.outbox_queued, s.outbox_blocked), (1, 1));
    assert_eq!(s.blocked_commits[0].session_key, "poison-a");

    // Retry now: refused once more, then delivered.
    let (code, out) = ctxgate(&["outbox", "retry", "poison-a", "--gateway", &g.endpoint]).await;
    assert_eq!(code, Some(0));
    assert!(out.starts_with("0 queued commit(s) of \"poison-a\" delivered, 1 still waiting."), "{out}");
    assert_eq!(outbox_rows(&g).await[0]["attempts"].as_u64(), Some(2));
    let (_, out) = ctxgate(&["outbox", "retry", "poison-a", "--gateway", &g.endpoint]).await;
    assert!(out.starts_with("1 queued commit(s) of \"poison-a\" delivered, 0 still waiting."), "{out}");
    assert!(engine.wait_line(&format!("event commit {}", turn_id(&first)), Duration::from_secs(5)).await.is_some());

    // The session runs again; its new turn is refused in turn, and dropped.
    let third = run_turn(&g, "poison-a", "third").await;
    assert!(completed(&third) && warned(&third, "stays queued"), "{third:?}");
    let (code, out) = ctxgate(&["outbox", "drop", "poison-a", "--gateway", &g.endpoint]).await;
    assert_eq!(code, Some(0));
    assert!(out.starts_with("1 queued commit(s) of \"poison-a\" dropped"), "{out}");
    let (_, out) = ctxgate(&["outbox", "ls", "--gateway", &g.endpoint]).await;
    assert!(out.starts_with("The outbox is empty"), "{out}");
    let fourth = run_turn(&g, "poison-a", "fourth").await;
    assert!(completed(&fourth), "a dropped row no longer blocks: {fourth:?}");

    // The transcript is untouched by all of it.
    let texts = messages(&g, "poison-a").await;
    let users: Vec<&str> = texts.iter().map(String::as_str).filter(|t| !t.starts_with("(offline model)")).collect();
    assert_eq!(users, ["first", "second", "third", "fourth"], "{texts:?}");
    assert_eq!(texts.len() - users.len(), 3, "three replies (the blocked turn had none): {texts:?}");
    assert!(engine_status(&g, "fault").await.quarantine.is_none());
    g.stop().await;
}

#[tokio::test]
async fn turns_served_by_legacy_while_quarantined_reach_the_engine_in_order_once_it_is_back() {
    let (engine, g) = fault_gateway("durable").await;
    let mut expected = vec![turn_id(&run_turn(&g, "gap", "turn 0").await)];
    engine.wait_lines("event commit ", 1, Duration::from_secs(5)).await.unwrap();

    signal(engine.pid(), "USR1").await; // NOT_SERVING
    wait_engine(&g, "fault", "quarantined", |e| e.quarantine.is_some()).await;
    for i in 1..=5 {
        let t = run_turn(&g, "gap", &format!("turn {i}")).await;
        assert!(completed(&t), "{t:?}");
        assert_eq!(selected(&t).engine_id, "legacy");
        expected.push(turn_id(&t));
    }
    assert_eq!(engine.lines_starting("event commit ").len(), 1, "nothing reaches a quarantined engine");

    signal(engine.pid(), "USR2").await; // SERVING: re-admitted after its penalty
    attached(&g, "fault").await;
    let next = run_turn(&g, "gap", "turn 6").await;
    assert_eq!(selected(&next).engine_id, "fault");
    expected.push(turn_id(&next));
    let lines =
        engine.wait_lines("event commit ", 7, Duration::from_secs(10)).await.expect("all seven turns committed");
    assert_eq!(commit_keys(&lines), expected, "each turn once, in order, the legacy ones before the next engine turn");
    g.stop().await;
}

#[tokio::test]
async fn rows_for_an_engine_that_is_gone_block_nothing_and_a_reload_brings_them_home() {
    let a = fault_engine("durable,commit-fails-first").await;
    let b = fault_engine("durable").await;
    let g = attached_gateway("a", &a.endpoint, &[]).await;
    let first = run_turn(&g, "moved", "first").await;
    assert!(completed(&first) && warned(&first, "stays queued"), "{first:?}");

    // The operator moves the slot to engine b and removes a.
    let only_b = hosting("b", &b.endpoint, &[]);
    g.reload(only_b.clone()).await;
    g.wait_attached("b").await;
    let second = run_turn(&g, "moved", "second").await;
    assert!(completed(&second), "a's queued row does not block b: {second:?}");
    // Both fixtures report the engine id "fault": engine b's own log tells.
    assert!(b.wait_line(&format!("event commit {}", turn_id(&second)), Duration::from_secs(5)).await.is_some());
    let rows = outbox_rows(&g).await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!((rows[0]["engine_id"].as_str(), rows[0]["engine_state"].as_str()), (Some("a"), Some("not-configured")));

    // Engine a is configured again: its row is delivered.
    let mut both = only_b;
    both.plugins.entries.extend(hosting("a", &a.endpoint, &[]).plugins.entries);
    g.reload(both).await;
    let line = a.wait_line(&format!("event commit {}", turn_id(&first)), Duration::from_secs(10)).await;
    assert!(line.is_some(), "delivery resumed after the reload");
    assert!(outbox_rows(&g).await.is_empty());
    g.stop().await;
}

fn session_id(events: &[Event]) -> String {
    events.iter().find_map(|e| if let Event::Admitted(a) = e { Some(a.session_id.clone()) } else { None }).unwrap()
}

async fn delete(g: &TestGateway, key: &str) {
    let r = g.client.clone().delete_session(sref(key)).await.unwrap().into_inner();
    assert_eq!(r.deleted_sessions, 1);
}

#[tokio::test]
async fn a_deleted_session_with_queued_commits_is_never_delivered_and_is_forgotten() {
    let (engine, g) = fault_gateway("durable,commit-fails-first").await;
    let first = run_turn(&g, "del", "first").await;
    assert!(completed(&first));
    assert_eq!(status(&g).await.outbox_queued, 1, "the refused commit waits");
    delete(&g, "del").await;
    assert_eq!(status(&g).await.outbox_queued, 0, "the delete took the queue with it");

    g.client.clone().readmit_engine(api::ReadmitEngineRequest { engine_id: "fault".into() }).await.unwrap();
    let forget = format!("event forget {}", session_id(&first));
    assert!(engine.wait_line(&forget, Duration::from_secs(10)).await.is_some(), "the engine is told to forget");
    // Two more background passes: the deleted turn never arrives.
    let late = engine.wait_line(&format!("event commit {}", turn_id(&first)), Duration::from_millis(1200)).await;
    assert!(late.is_none(), "{late:?}");
    g.stop().await;
}

fn window_rows(db: &std::path::Path, session_id: &str) -> i64 {
    let c = rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY).unwrap();
    ["messages", "commits", "sessions", "summaries"]
        .iter()
        .map(|t| {
            c.query_row(&format!("SELECT COUNT(*) FROM {t} WHERE session_id = ?1"), [session_id], |r| {
                r.get::<_, i64>(0)
            })
            .unwrap()
        })
        .sum()
}

#[tokio::test]
async fn the_window_engine_forgets_a_deleted_session_but_not_a_reset_one() {
    let dir = tempfile::tempdir().unwrap();
    let engine = start_window(dir.path(), &[]).await;
    let g = attached_gateway("window", &engine.endpoint, &[]).await;
    let kept = run_turn(&g, "kept", "reset me, do not forget me").await;
    let gone = run_turn(&g, "gone", "delete me").await;
    assert!(completed(&kept) && completed(&gone));
    let db = dir.path().join("window.sqlite");
    let (kept_id, gone_id) = (session_id(&kept), session_id(&gone));
    assert!(window_rows(&db, &gone_id) > 0 && window_rows(&db, &kept_id) > 0);

    g.client.clone().reset_session(sref("kept")).await.unwrap();
    delete(&g, "gone").await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while window_rows(&db, &gone_id) > 0 {
        assert!(tokio::time::Instant::now() < deadline, "the window engine still holds the deleted session");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(window_rows(&db, &kept_id) > 0, "a reset archives; the engine keeps the session");
    g.stop().await;
}

#[tokio::test]
async fn the_python_engine_forgets_a_deleted_session() {
    let (_py_state, engine, g) = python_gateway().await;
    let t = run_turn(&g, "gone", "delete me").await;
    assert!(completed(&t), "{t:?}");
    let held: Vec<pb::AgentMessage> = transcript(&g.client, "gone")
        .await
        .into_iter()
        .filter_map(|e| if let Some(Entry::Message(m)) = e.entry { Some(m) } else { None })
        .collect();
    let mut py = ContextEngineClient::connect(engine.endpoint.clone()).await.unwrap();
    let again = |messages: Vec<pb::AgentMessage>| pb::IngestBatchRequest {
        session_id: session_id(&t),
        messages,
        ..Default::default()
    };
    let n = py.ingest_batch(again(held.clone())).await.unwrap().into_inner().ingested_count;
    assert_eq!(n, 0, "the engine holds the turn's messages (after-turn)");

    delete(&g, "gone").await;
    let n = py.ingest_batch(again(held.clone())).await.unwrap().into_inner().ingested_count;
    assert_eq!(n as usize, held.len(), "after the delete the engine held nothing of the session");
    g.stop().await;
}

#[tokio::test]
async fn a_gateway_restarted_while_the_durable_engine_is_down_still_queues_legacy_turns_for_it() {
    use ctxgate_proto::gateway::gateway_client::GatewayClient;
    let dir = tempfile::tempdir().unwrap();
    let engine = fault_engine("durable").await;
    let addr = engine.endpoint.strip_prefix("http://").unwrap().to_owned();
    let config = write_file(dir.path(), "ctxgate.json5", &hosting_json5("fault", &engine.endpoint));
    let state = dir.path().join("state");
    let turn = |url: String, text: &'static str| async move {
        let mut c = GatewayClient::connect(url).await.unwrap();
        let req = api::RunTurnRequest { session: session("restart"), message: text.into(), ..Default::default() };
        let mut s = c.run_turn(req).await.unwrap().into_inner();
        let mut events = Vec::new();
        while let Some(e) = tokio_stream::StreamExt::next(&mut s).await {
            events.push(e.unwrap().event.unwrap());
        }
        events
    };
    let wait_attached = |url: String| async move {
        let mut c = GatewayClient::connect(url).await.unwrap();
        for _ in 0..1500 {
            let s = c.get_status(api::StatusRequest {}).await.unwrap().into_inner();
            if s.engines.iter().any(|e| e.id == "fault" && e.quarantine.is_none() && !e.name.is_empty()) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the engine never attached");
    };

    let gw = serve(&state, Some(&config)).await;
    wait_attached(gw.endpoint.clone()).await;
    let first = turn(gw.endpoint.clone(), "first").await;
    assert!(completed(&first));
    gw.signal_and_wait("KILL").await.unwrap();
    engine.signal_and_wait("KILL").await.unwrap();

    // The gateway starts again with the engine down: it never attaches.
    let gw = serve(&state, Some(&config)).await;
    let mut keys = Vec::new();
    for text in ["second", "third"] {
        let t = turn(gw.endpoint.clone(), text).await;
        assert!(completed(&t) && selected(&t).engine_id == "legacy", "{t:?}");
        keys.push(turn_id(&t));
    }
    let engine =
        EngineProcess::start(ctxgate_tests::bin("ctxgate-fault-engine"), &["--listen", &addr, "--fault", "durable"])
            .await
            .unwrap();
    let lines = engine.wait_lines("event commit ", 2, Duration::from_secs(15)).await.expect("both delivered");
    assert_eq!(commit_keys(&lines), keys, "the turns legacy served reached the engine, in order");
}

#[tokio::test]
async fn durable_engines_get_commit_turn_through_the_outbox_instead_of_after_turn() {
    let (engine, g) = fault_gateway("durable").await;
    let first = run_turn(&g, "d", "first").await;
    let second = run_turn(&g, "d", "second").await;
    assert!(completed(&first) && completed(&second));
    let commits = engine.lines_starting("event commit ");
    assert_eq!(commits.len(), 2, "{commits:?}");
    for (line, events) in commits.iter().zip([&first, &second]) {
        assert!(
            line.starts_with(&format!("event commit {} messages=2 terminal_is_last=true ", turn_id(events))),
            "{line}"
        );
    }
    let methods = engine_status(&g, "fault").await.methods;
    let calls = |m: &str| methods.iter().find(|x| x.method == m).map_or(0, |x| x.calls);
    assert_eq!(
        (calls("CommitTurn"), calls("AfterTurn"), calls("Ingest")),
        (2, 0, 0),
        "durable turns reach the engine only as commits"
    );
    g.stop().await;
}

#[tokio::test]
async fn a_commit_lost_in_transport_quarantines_stays_queued_and_is_delivered_once_the_engine_is_back() {
    // UNAVAILABLE is a transport failure: the engine, not the turn, is at
    // fault (a refusal of the turn itself is in durable_turns.rs).
    let (engine, g) = fault_gateway("durable,commit-fails-first").await;
    let first = run_turn(&g, "q", "first").await;
    assert!(completed(&first), "the reply is stored even though the engine refused the commit");
    assert!(first.iter().any(|e| matches!(e, Event::Warning(w) if w.message.contains("stays queued"))));
    assert_eq!(quarantine_of(&engine_status(&g, "fault").await).0, "CommitTurn");

    // While quarantined, turns run on legacy; the queued commit waits.
    let second = run_turn(&g, "q", "second").await;
    assert_eq!(selected(&second).engine_id, "legacy");
    assert!(engine.lines_starting("event commit ").is_empty());

    // Back in service: the background drain delivers the first turn.
    g.client.clone().readmit_engine(api::ReadmitEngineRequest { engine_id: "fault".into() }).await.unwrap();
    let line = engine.wait_line(&format!("event commit {}", turn_id(&first)), Duration::from_secs(10)).await;
    assert!(line.is_some(), "the queued commit was delivered");
    let line = engine.wait_line(&format!("event commit {}", turn_id(&second)), Duration::from_secs(10)).await;
    assert!(line.is_some(), "and so was the turn legacy served meanwhile");
    let third = run_turn(&g, "q", "third").await;
    assert_eq!(selected(&third).engine_id, "fault");
    assert!(engine.wait_line(&format!("event commit {}", turn_id(&third)), Duration::from_secs(5)).await.is_some());
    assert_eq!(messages(&g, "q").await.len(), 6, "nothing lost");
    // What the engine received, not what it kept (its record would hide a
    // repeat): each turn's commit arrived once, the refused attempt aside.
    for turn in [&first, &second, &third] {
        let id = turn_id(turn);
        let deliveries = engine.lines_starting(&format!("event commit {id} ")).len();
        assert_eq!(deliveries, 1, "turn {id}'s commit was delivered {deliveries} times");
    }
    g.stop().await;
}

#[tokio::test]
async fn a_commit_the_engine_fails_on_every_time_is_held_after_three_and_blocks_only_its_session() {
    let (engine, g) = fault_gateway("durable,fail-crash").await;
    let first = run_turn(&g, "crash-a", "crash me").await;
    assert!(completed(&first) && warned(&first, "stays queued"), "{first:?}");
    // Each failure quarantines the engine; back in service, the outbox sends
    // the row again — three times in all, then it is held.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(40);
    let row = loop {
        let rows = outbox_rows(&g).await;
        assert_eq!(rows.len(), 1, "{rows:?}");
        if rows[0]["blocked"].as_bool() == Some(true) {
            break rows[0].clone();
        }
        assert!(tokio::time::Instant::now() < deadline, "the row was never held: {rows:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(row["advancement_key"], turn_id(&first).as_str());
    assert!(row["last_error"].as_str().unwrap().contains("failed on it 3 times in a row"), "{row}");
    assert_eq!(engine.lines_starting("event commit-failed").len(), 3);

    // Held: the engine comes back and stays in service; the row is not sent.
    wait_engine(&g, "fault", "in service", |e| e.quarantine.is_none()).await;
    let good = run_turn(&g, "good", "fine").await;
    assert_eq!(selected(&good).engine_id, "fault", "{good:?}");
    let line = engine.wait_line(&format!("event commit {}", turn_id(&good)), Duration::from_secs(5)).await;
    assert!(line.is_some(), "other sessions commit to the engine");
    tokio::time::sleep(Duration::from_secs(2)).await; // four outbox passes
    assert_eq!(engine.lines_starting("event commit-failed").len(), 3, "a held row is not sent again on its own");
    assert!(engine_status(&g, "fault").await.quarantine.is_none());

    // The session's next turn waits, and says why and what to do.
    let blocked = run_turn(&g, "crash-a", "second").await;
    let f = failure(&blocked).expect("the next turn is blocked");
    assert_eq!(f.reason, "engine_backlog");
    assert!(f.message.contains("failed on an earlier turn") && f.message.contains("retry|drop"), "{}", f.message);

    // `retry` sends it once more (it fails, and is held again at once).
    let (code, out) = ctxgate(&["outbox", "retry", "crash-a", "--gateway", &g.endpoint]).await;
    assert_eq!(code, Some(0), "{out}");
    assert!(out.starts_with("0 queued commit(s) of \"crash-a\" delivered, 1 still waiting."), "{out}");
    assert_eq!(engine.lines_starting("event commit-failed").len(), 4);
    assert_eq!(outbox_rows(&g).await[0]["blocked"].as_bool(), Some(true));
    // `drop` lets the session's turns reach the engine again.
    wait_engine(&g, "fault", "in service", |e| e.quarantine.is_none()).await;
    let (code, out) = ctxgate(&["outbox", "drop", "crash-a", "--gateway", &g.endpoint]).await;
    assert_eq!(code, Some(0), "{out}");
    let third = run_turn(&g, "crash-a", "third").await;
    assert_eq!(selected(&third).engine_id, "fault", "{third:?}");
    let line = engine.wait_line(&format!("event commit {}", turn_id(&third)), Duration::from_secs(5)).await;
    assert!(line.is_some(), "the session commits again after the drop");
    g.stop().await;
}

#[tokio::test]
async fn forgets_owed_to_a_removed_engine_are_listed_dropped_and_audited() {
    let a = fault_engine("durable").await;
    let b = fault_engine("durable").await;
    let g = attached_gateway("a", &a.endpoint, &[]).await;
    assert!(completed(&run_turn(&g, "old", "seen by a").await));
    // Engine a leaves the config; then the session it saw is deleted.
    g.reload(hosting("b", &b.endpoint, &[])).await;
    g.wait_attached("b").await;
    delete(&g, "old").await;

    let ls = |args: &'static [&'static str]| {
        let endpoint = g.endpoint.clone();
        async move {
            let mut all = vec!["outbox"];
            all.extend_from_slice(args);
            all.extend(["--gateway", endpoint.as_str()]);
            ctxgate(&all).await
        }
    };
    let (code, out) = ls(&["ls", "--json"]).await;
    assert_eq!(code, Some(0), "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let forgets = v["forgets"].as_array().unwrap();
    assert_eq!(forgets.len(), 1, "{v}");
    assert_eq!((forgets[0]["session_key"].as_str(), forgets[0]["engine_id"].as_str()), (Some("old"), Some("a")));
    assert_eq!(forgets[0]["engine_state"], "not-configured");
    let (_, text) = ls(&["ls"]).await;
    assert!(text.contains("ForgetSession calls owed") && text.contains("not-configured"), "{text}");

    // A configured engine's forgets are delivered, never dropped.
    let refused = tokio::process::Command::new(ctxgate_tests::bin("ctxgate"))
        .args(["outbox", "drop-forgets", "b", "--gateway", &g.endpoint])
        .output()
        .await
        .unwrap();
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && err.contains("is configured"), "{err}");
    let (code, out) = ls(&["drop-forgets", "a"]).await;
    assert_eq!((code, out.trim()), (Some(0), "1 owed ForgetSession call(s) to \"a\" dropped."));
    let (_, out) = ls(&["ls", "--json"]).await;
    assert!(serde_json::from_str::<serde_json::Value>(&out).unwrap()["forgets"].as_array().unwrap().is_empty());

    // The drop is in the audit.
    let (code, out) = ls(&["drops", "--json"]).await;
    assert_eq!(code, Some(0), "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let drops = v["drops"].as_array().unwrap();
    assert_eq!(drops.len(), 1, "{v}");
    assert_eq!((drops[0]["kind"].as_str(), drops[0]["session_key"].as_str()), (Some("forget"), Some("old")));
    let (_, text) = ls(&["drops"]).await;
    assert!(text.contains("(ForgetSession)") && text.contains("old"), "{text}");
    g.stop().await;
}
