//! The gateway hosting real engine processes: the window engine, the Python
//! engine, and the fault fixture that crashes, hangs, reports NOT_SERVING,
//! answers garbage or oversized replies, or compacts slowly. Every fault
//! must end in the documented outcome, with the quarantine naming the
//! operation and no transcript entry lost.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ctxgate::config::ProviderKind;
use ctxgate_proto::gateway::{self as api, turn_event::Event};
use ctxgate_tests::fake_openai::{FakeOpenAi, Reply};
use ctxgate_tests::hosting::*;
use ctxgate_tests::{EngineProcess, TestGateway, bin, compact_to_end, metrics_text};
use tokio_stream::StreamExt;
use tonic::Code;

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
    let mut config = hosting("window", &engine.endpoint, &[]);
    config.gateway.metrics_listen = "127.0.0.1:0".into();
    config.models.provider = ProviderKind::Openai;
    config.models.base_url = fake.base_url.clone();
    config.models.model = "gpt-test".into();
    let g = TestGateway::start(config).await;
    attached(&g, "window").await;
    for i in 0..6 {
        let events = run_turn(&g, "w", &format!("Turn {i}: look at module_{i}.rs please")).await;
        assert!(completed(&events), "{events:?}");
        assert_eq!(selected(&events).engine_id, "window");
        assert_eq!(selected(&events).reason, "configured");
    }
    // Manual compaction goes to the engine, which owns it; progress streams through.
    let mut stream = g
        .client
        .clone()
        .compact(api::CompactSessionRequest { session: session("w"), custom_instructions: None })
        .await
        .unwrap()
        .into_inner();
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

#[tokio::test]
async fn turns_run_through_the_python_engine() {
    let py_state = tempfile::tempdir().unwrap();
    let engine = ctxgate_tests::start_python(py_state.path()).await;
    let g = TestGateway::start(hosting("py", &engine.endpoint, &[])).await;
    attached(&g, "py").await;
    let events = run_turn(&g, "p", "hello from a polyglot test").await;
    assert!(completed(&events), "{events:?}");
    assert_eq!(selected(&events).engine_id, "py-recency");
    let e = engine_status(&g, "py").await;
    assert!(e.quarantine.is_none(), "{e:?}");
    g.stop().await;
}

#[tokio::test]
async fn an_engine_that_crashes_mid_call_is_quarantined_and_the_turn_completes_on_legacy() {
    let engine = fault_engine("crash-on-assemble").await;
    let g = TestGateway::start(hosting("fault", &engine.endpoint, &[])).await;
    attached(&g, "fault").await;
    let events = run_turn(&g, "c", "first question").await;
    assert!(completed(&events), "same-call fallback answers the turn: {events:?}");
    let e = wait_engine(&g, "fault", "quarantined", |e| e.quarantine.is_some()).await;
    assert_eq!(quarantine_of(&e).0, "Assemble", "{e:?}");
    // The next turn degrades to legacy before it starts, with one warning.
    let events = run_turn(&g, "c", "second question").await;
    assert!(completed(&events));
    assert_eq!(selected(&events).engine_id, "legacy");
    assert!(
        events.iter().any(
            |e| matches!(e, Event::Warning(w) if w.message.contains("degraded to \"legacy\" for this logical turn"))
        )
    );
    assert_eq!(messages(&g, "c").await.len(), 4, "nothing lost");
    g.stop().await;
}

#[tokio::test]
async fn a_hanging_call_times_out_falls_back_and_the_engine_sees_the_cancel() {
    let engine = fault_engine("hang").await;
    let g = TestGateway::start(hosting("fault", &engine.endpoint, &[("assemble", 0.3)])).await;
    attached(&g, "fault").await;
    let events = run_turn(&g, "h", "are you there?").await;
    assert!(completed(&events), "{events:?}");
    let e = engine_status(&g, "fault").await;
    let (op, reason) = quarantine_of(&e);
    assert_eq!(op, "Assemble");
    assert!(reason.contains("did not answer"), "{reason}");
    assert!(
        engine.wait_line("event cancelled Assemble", Duration::from_secs(5)).await.is_some(),
        "the engine saw the deadline"
    );
    g.stop().await;
}

#[tokio::test]
async fn garbage_and_oversized_replies_are_contract_violations() {
    for (fault, expect) in [("garbage", "broke the contract"), ("oversized", "OutOfRange")] {
        let engine = fault_engine(fault).await;
        let mut config = hosting("fault", &engine.endpoint, &[]);
        config.plugins.entries.get_mut("fault").unwrap().max_message_bytes = 256 * 1024;
        let g = TestGateway::start(config).await;
        attached(&g, "fault").await;
        let events = run_turn(&g, "g", "tell me something").await;
        assert!(completed(&events), "{fault}: {events:?}");
        let e = engine_status(&g, "fault").await;
        let (op, reason) = quarantine_of(&e);
        assert_eq!(op, "Assemble", "{fault}");
        assert!(reason.contains(expect), "{fault}: {reason}");
        assert_eq!(messages(&g, "g").await.len(), 2);
        g.stop().await;
    }
}

#[tokio::test]
async fn not_serving_quarantines_and_serving_again_readmits_within_two_seconds() {
    let engine = fault_engine("").await;
    let g = TestGateway::start(hosting("fault", &engine.endpoint, &[])).await;
    attached(&g, "fault").await;
    let kill = |sig: &str| {
        std::process::Command::new("kill").arg(format!("-{sig}")).arg(engine.pid().to_string()).status().unwrap()
    };
    kill("USR1");
    let e = wait_engine(&g, "fault", "quarantined", |e| e.quarantine.is_some()).await;
    assert_eq!(quarantine_of(&e).0, "health");
    assert_eq!(e.health, "NOT_SERVING");
    let events = run_turn(&g, "n", "hi").await;
    assert_eq!(selected(&events).engine_id, "legacy");

    let back = Instant::now();
    kill("USR2");
    wait_engine(&g, "fault", "re-admitted", |e| e.quarantine.is_none()).await;
    let took = back.elapsed();
    eprintln!("re-admitted {took:?} after reporting SERVING again");
    assert!(took < Duration::from_secs(2), "re-admission took {took:?}");
    let events = run_turn(&g, "n", "hi again").await;
    assert_eq!(selected(&events).engine_id, "fault", "the first call after re-admission is a trial, and it passes");
    g.stop().await;
}

#[tokio::test]
async fn an_operator_readmit_lifts_a_quarantine() {
    let engine = fault_engine("garbage").await;
    let g = TestGateway::start(hosting("fault", &engine.endpoint, &[])).await;
    attached(&g, "fault").await;
    run_turn(&g, "r", "x").await;
    assert!(engine_status(&g, "fault").await.quarantine.is_some());
    let r = g
        .client
        .clone()
        .readmit_engine(api::ReadmitEngineRequest { engine_id: "fault".into() })
        .await
        .unwrap()
        .into_inner();
    assert!(r.readmitted);
    assert!(engine_status(&g, "fault").await.quarantine.is_none());
    let e = g.client.clone().readmit_engine(api::ReadmitEngineRequest { engine_id: "nope".into() }).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    g.stop().await;
}

fn unix_us() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_micros()
}

#[tokio::test]
async fn a_client_cancel_reaches_the_engine_within_50ms_and_never_quarantines() {
    let engine = fault_engine("hang").await;
    let g = TestGateway::start(hosting("fault", &engine.endpoint, &[("assemble", 60.0)])).await;
    attached(&g, "fault").await;
    let req = api::RunTurnRequest {
        session: session("a"),
        message: "wait for me".into(),
        system_prompt: None,
        ..Default::default()
    };
    let stream = g.client.clone().run_turn(req).await.unwrap().into_inner();
    engine.wait_line("event assemble", Duration::from_secs(10)).await.unwrap();
    let cancelled_at = unix_us();
    drop(stream);
    let line =
        engine.wait_line("event cancelled Assemble", Duration::from_secs(5)).await.expect("the engine saw the cancel");
    let seen_at: u128 = line.rsplit(' ').next().unwrap().parse().unwrap();
    let delay_ms = seen_at.saturating_sub(cancelled_at) as f64 / 1000.0;
    eprintln!("the engine saw the client's cancel after {delay_ms:.2} ms");
    assert!(delay_ms < 50.0, "{delay_ms} ms");
    let e = engine_status(&g, "fault").await;
    assert!(e.quarantine.is_none(), "an abort is never the engine's fault: {e:?}");
    g.stop().await;
}

#[tokio::test]
async fn a_hung_compact_returns_within_the_timeout_plus_100ms_and_quarantines() {
    let engine = fault_engine("hang").await;
    let mut config = hosting("fault", &engine.endpoint, &[]);
    config.agents.defaults.compaction.timeout_seconds = 1;
    let g = TestGateway::start(config).await;
    attached(&g, "fault").await;
    // A session to compact (assemble hangs too: give the turn a short deadline).
    g.client.clone().new_session(api::SessionRef { agent_id: String::new(), session_key: "k".into() }).await.unwrap();
    let started = Instant::now();
    let (_, status) = compact_to_end(&g.client, "k").await;
    let took = started.elapsed();
    eprintln!("the hung Compact returned after {took:?} (timeout 1 s)");
    assert_eq!(status.unwrap().code(), Code::DeadlineExceeded);
    assert!(took < Duration::from_millis(1100), "{took:?}");
    let e = engine_status(&g, "fault").await;
    assert_eq!(quarantine_of(&e).0, "Compact");
    assert!(engine.wait_line("event cancelled Compact", Duration::from_secs(5)).await.is_some());
    g.stop().await;
}

#[tokio::test]
async fn a_failing_engine_compaction_in_overflow_recovery_falls_back_to_built_in() {
    let fake = FakeOpenAi::start().await;
    let engine = fault_engine("compact-fails").await;
    let mut config = hosting("fault", &engine.endpoint, &[]);
    config.models.provider = ProviderKind::Openai;
    config.models.base_url = fake.base_url.clone();
    config.models.model = "gpt-test".into();
    config.models.context_window = 4_000;
    config.models.max_output_tokens = 256;
    config.agents.defaults.compaction.reserve_tokens = Some(500);
    config.agents.defaults.compaction.keep_recent_tokens = 200;
    let g = TestGateway::start(config).await;
    attached(&g, "fault").await;
    for i in 0..5 {
        assert!(completed(&run_turn(&g, "o", &format!("turn {i} about file_{i}.rs {}", "words ".repeat(40))).await));
    }
    fake.turns([Reply::Overflow, Reply::Overflow, Reply::Text("made it".into())]);
    let events = run_turn(&g, "o", "the overflowing question").await;
    assert!(matches!(events.last(), Some(Event::Completed(c)) if c.text == "made it"), "{events:?}");
    assert!(events.iter().any(|e| matches!(e, Event::Warning(w) if w.message.contains("overflow compaction failed"))));
    assert!(
        events.iter().any(|e| matches!(e, Event::CompactionDone(d) if d.compacted && d.entry_id.is_some())),
        "the second attempt used built-in compaction: {events:?}"
    );
    assert_eq!(quarantine_of(&engine_status(&g, "fault").await).0, "Compact");
    g.stop().await;
}

#[tokio::test]
async fn a_missing_host_capability_degrades_the_turn_with_openclaws_message() {
    let engine = fault_engine("needs-threads").await;
    let g = TestGateway::start(hosting("fault", &engine.endpoint, &[])).await;
    attached(&g, "fault").await;
    let events = run_turn(&g, "t", "hi").await;
    assert!(completed(&events));
    assert_eq!(selected(&events).engine_id, "legacy");
    let warning =
        events.iter().find_map(|e| if let Event::Warning(w) = e { Some(w.message.clone()) } else { None }).unwrap();
    assert!(warning.contains("Context engine \"fault\" cannot run operation \"agent-run\" on ctxgate embedded runner. Missing host capabilities: thread-bootstrap-projection."), "{warning}");
    assert!(engine_status(&g, "fault").await.quarantine.is_none(), "not a failure: no quarantine");
    g.stop().await;
}

#[tokio::test]
async fn a_grant_reads_only_its_own_session_and_dies_with_its_call() {
    let engine = fault_engine("grant-probe").await;
    let g = TestGateway::start(hosting("fault", &engine.endpoint, &[])).await;
    attached(&g, "fault").await;
    run_turn(&g, "gp", "first").await;
    let events = run_turn(&g, "gp", "second").await;
    assert!(completed(&events));
    // Reads stop at the current-turn fence: the first turn sees nothing,
    // the second sees the first exchange but not its own admitted message.
    let own = engine.lines_starting("event grant-own");
    assert_eq!(own.len(), 2, "{own:?}");
    assert!(own[0].starts_with("event grant-own 0 "), "{own:?}");
    assert!(own[1].starts_with("event grant-own 2 "), "{own:?}");
    let other = engine.wait_line("event grant-other", Duration::from_secs(5)).await.unwrap();
    assert!(other.starts_with("event grant-other PermissionDenied"), "{other}");
    let after = engine.wait_line("event grant-after", Duration::from_secs(5)).await.unwrap();
    assert!(after.starts_with("event grant-after Unauthenticated"), "a revoked grant is refused: {after}");
    g.stop().await;
}

#[tokio::test]
async fn removing_the_selected_entry_on_reload_resets_the_slot_to_legacy() {
    let engine = fault_engine("").await;
    let config = hosting("fault", &engine.endpoint, &[]);
    let g = TestGateway::start(config.clone()).await;
    attached(&g, "fault").await;
    assert_eq!(status(&g).await.selected_engine, "fault");
    let mut without = config;
    without.plugins.entries.clear();
    g.reload(without).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    while status(&g).await.selected_engine != "legacy" {
        assert!(Instant::now() < deadline, "the reload never applied");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let events = run_turn(&g, "rl", "hi").await;
    assert_eq!(selected(&events).engine_id, "legacy");
    g.stop().await;
}

#[tokio::test]
async fn doctor_reports_an_incompatible_engine_and_fix_resets_the_slot() {
    let engine = fault_engine("needs-threads").await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ctxgate.json5");
    let text = format!(
        "{{\n  // the fixture needs a host we are not\n  plugins: {{ slots: {{ contextEngine: 'fault' }}, entries: {{ fault: {{ endpoint: '{}' }} }} }},\n}}\n",
        engine.endpoint
    );
    std::fs::write(&path, &text).unwrap();
    let p = path.to_str().unwrap();

    let (code, out) = ctxgate(&["doctor", "--config", p]).await;
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("- plugins.slots.contextEngine: context engine \"fault\" is incompatible with ctxgate embedded runner (agents.defaults). Missing host capabilities: thread-bootstrap-projection."), "{out}");
    assert!(out.contains("Run \"ctxgate doctor --fix\" to remove the plugins.slots.contextEngine override"), "{out}");

    let (code, out) = ctxgate(&["doctor", "--config", p, "--fix"]).await;
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("Reset plugins.slots.contextEngine to the default \"legacy\""), "{out}");
    assert_eq!(std::fs::read_to_string(path.with_extension("json5.bak")).unwrap(), text, "the original is kept");
    let (code, out) = ctxgate(&["doctor", "--config", p]).await;
    assert_eq!(code, Some(0));
    assert!(out.contains("nothing to check"), "{out}");
}

#[tokio::test]
async fn doctor_passes_a_compatible_engine_and_the_cli_lists_and_readmits_engines() {
    let engine = fault_engine("garbage").await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ctxgate.json5");
    std::fs::write(
        &path,
        format!(
            "{{ plugins: {{ slots: {{ contextEngine: 'fault' }}, entries: {{ fault: {{ endpoint: '{}' }} }} }} }}",
            engine.endpoint
        ),
    )
    .unwrap();
    let (code, out) = ctxgate(&["doctor", "--config", path.to_str().unwrap()]).await;
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("health: SERVING") && out.contains("host requirements: met"), "{out}");

    let g = TestGateway::start(hosting("fault", &engine.endpoint, &[])).await;
    attached(&g, "fault").await;
    run_turn(&g, "cli", "make it fail").await;
    let (_, out) = ctxgate(&["engines", "ls", "--gateway", &g.endpoint, "--json"]).await;
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v[1]["id"], "fault");
    assert_eq!(v[1]["quarantine"]["operation"], "Assemble");
    assert!(v[1]["methods"].as_array().unwrap().iter().any(|m| m["method"] == "Assemble" && m["failures"] == 1));
    let (code, out) = ctxgate(&["engines", "readmit", "fault", "--gateway", &g.endpoint]).await;
    assert_eq!(code, Some(0));
    assert!(out.contains("re-admitted"), "{out}");
    g.stop().await;
}

#[tokio::test]
async fn subagents_fork_from_the_window_engine_end_and_are_swept() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().to_str().unwrap().to_owned();
    let engine =
        EngineProcess::start(bin("ctxgate-engine-window"), &["--listen", "127.0.0.1:0", "--state-dir", &state])
            .await
            .unwrap();
    let g = TestGateway::start(hosting("window", &engine.endpoint, &[])).await;
    attached(&g, "window").await;
    for i in 0..3 {
        assert!(completed(&run_turn(&g, "parent", &format!("parent turn {i}")).await));
    }
    let mut c = g.client.clone();
    let spawn = |child: &str, mode: &str, ttl: Option<u64>| api::SpawnSubagentRequest {
        parent: Some(sref("parent")),
        child_session_key: child.into(),
        context_mode: mode.into(),
        ttl_ms: ttl,
    };
    let r = c.spawn_subagent(spawn("child", "fork", None)).await.unwrap().into_inner();
    assert!(r.engine_prepared);
    assert_eq!(messages(&g, "child").await, messages(&g, "parent").await, "a fork starts from the parent's history");
    let e = c.spawn_subagent(spawn("child", "fork", None)).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    let e = c.spawn_subagent(spawn("x", "sideways", None)).await.unwrap_err();
    assert_eq!((e.code(), e.message().starts_with("context_mode:")), (Code::InvalidArgument, true));

    let iso = c.spawn_subagent(spawn("iso", "isolated", None)).await.unwrap().into_inner();
    assert!(!iso.engine_prepared, "isolated: the window engine has nothing to prepare");
    assert!(messages(&g, "iso").await.is_empty());

    let end = |key: &str, reason: &str| api::EndSubagentRequest { child: Some(sref(key)), reason: reason.into() };
    assert!(c.end_subagent(end("child", "deleted")).await.unwrap().into_inner().ended);
    assert_eq!(c.get_session(sref("child")).await.unwrap_err().code(), Code::NotFound, "deleted");
    assert!(c.end_subagent(end("iso", "completed")).await.unwrap().into_inner().ended);
    assert!(c.get_session(sref("iso")).await.is_ok(), "completed children stay readable");
    assert_eq!(c.end_subagent(end("iso", "completed")).await.unwrap_err().code(), Code::NotFound, "ended once");

    // A ttl: the sweeper ends it with "swept" and archives the child.
    c.spawn_subagent(spawn("brief", "fork", Some(100))).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let all = c
            .list_sessions(api::ListSessionsRequest { agent_id: None, include_archived: true, ..Default::default() })
            .await
            .unwrap()
            .into_inner();
        let brief: Vec<_> = all.sessions.iter().filter(|s| s.session_key == "brief").collect();
        if brief.iter().any(|s| s.state == "archived") {
            assert_eq!(brief.len(), 1, "archived in place, no fresh session made: {brief:?}");
            break;
        }
        assert!(Instant::now() < deadline, "the sweeper never ended the subagent");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    g.stop().await;
}

#[tokio::test]
async fn a_spawn_that_fails_after_preparation_is_rolled_back() {
    let engine = fault_engine("slow-prepare").await;
    let g = TestGateway::start(hosting("fault", &engine.endpoint, &[])).await;
    attached(&g, "fault").await;
    assert!(completed(&run_turn(&g, "p", "parent").await));
    let mut c = g.client.clone();
    let req = api::SpawnSubagentRequest {
        parent: Some(sref("p")),
        child_session_key: "kid".into(),
        context_mode: "fork".into(),
        ttl_ms: None,
    };
    let spawning = tokio::spawn(async move { c.spawn_subagent(req).await });
    if engine.wait_line("event prepare kid", Duration::from_secs(10)).await.is_none() {
        panic!("the engine was never asked to prepare: {:?}", spawning.await);
    }
    // Someone takes the child's key while the engine prepares.
    g.client.clone().new_session(sref("kid")).await.unwrap();
    let e = spawning.await.unwrap().unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(
        engine.wait_line("event rollback tok-kid", Duration::from_secs(5)).await.is_some(),
        "the preparation was rolled back"
    );
    g.stop().await;
}

#[tokio::test]
async fn host_params_an_engine_does_not_accept_are_not_sent() {
    let engine = fault_engine("accepts-nothing").await;
    let g = TestGateway::start(hosting("fault", &engine.endpoint, &[])).await;
    attached(&g, "fault").await;
    assert!(completed(&run_turn(&g, "hp", "hi").await));
    let line = engine.wait_line("event params", Duration::from_secs(5)).await.unwrap();
    assert!(line.starts_with("event params key=no prompt=no settings=no context=no host=no "), "{line}");
    g.stop().await;
}

#[tokio::test]
async fn maintenance_rewrites_become_a_new_branch_and_the_old_one_stays() {
    let engine = fault_engine("maintain-rewrite").await;
    let g = TestGateway::start(hosting("fault", &engine.endpoint, &[])).await;
    attached(&g, "fault").await;
    assert!(completed(&run_turn(&g, "m", "please rewrite me").await));
    engine.wait_line("event maintain", Duration::from_secs(5)).await.unwrap();
    let texts = messages(&g, "m").await;
    assert_eq!(texts.len(), 2);
    assert_eq!(texts[0], "rewritten", "the active branch has the replacement");
    let info = g.client.clone().get_session(sref("m")).await.unwrap().into_inner();
    let stored = g.client.clone().list_sessions(api::ListSessionsRequest::default()).await.unwrap().into_inner();
    assert_eq!(info.entries, 2, "the active branch");
    assert_eq!(stored.sessions[0].entries, 4, "the old branch is kept for audit");
    g.stop().await;
}

#[tokio::test]
async fn durable_engines_get_commit_turn_through_the_outbox_instead_of_after_turn() {
    let engine = fault_engine("durable").await;
    let g = TestGateway::start(hosting("fault", &engine.endpoint, &[])).await;
    attached(&g, "fault").await;
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
    let engine = fault_engine("durable,commit-fails-first").await;
    let g = TestGateway::start(hosting("fault", &engine.endpoint, &[])).await;
    attached(&g, "fault").await;
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
    g.stop().await;
}

#[tokio::test]
async fn an_engine_without_a_health_service_counts_as_healthy() {
    let engine = EngineProcess::start(bin("ctxgate-broken-engine"), &["--listen", "127.0.0.1:0", "--honest-info"])
        .await
        .unwrap();
    let g = TestGateway::start(hosting("bare", &engine.endpoint, &[])).await;
    let e = wait_engine(&g, "bare", "attached", |e| e.quarantine.is_none() && !e.name.is_empty()).await;
    assert_eq!(e.health, "SERVING (no health service)");
    let events = run_turn(&g, "b", "hello").await;
    assert!(completed(&events), "{events:?}");
    assert_eq!(selected(&events).engine_id, "broken");
    g.stop().await;
}

#[tokio::test]
async fn a_malformed_trailer_that_panics_tonic_is_one_failed_call() {
    let engine = EngineProcess::start(bin("ctxgate-trailer-engine"), &[]).await.unwrap();
    let g = TestGateway::start(hosting("trailers", &engine.endpoint, &[])).await;
    // The attach and the health checks fail (tonic panics decoding the
    // trailer inside their tasks); the engine stays out of service.
    let e = wait_engine(&g, "trailers", "seen unhealthy", |e| e.health != "UNKNOWN").await;
    assert!(e.quarantine.is_some(), "{e:?}");
    // The gateway itself keeps working: turns run on legacy.
    for i in 0..3 {
        let events = run_turn(&g, "t", &format!("hello {i}")).await;
        assert!(completed(&events), "{events:?}");
        assert_eq!(selected(&events).engine_id, "legacy");
    }
    assert_eq!(status(&g).await.selected_engine, "trailers");
    // Forced back in by an operator, a real call hits the trailer too: one
    // failed call, answered by legacy, quarantine naming it.
    g.client.clone().readmit_engine(api::ReadmitEngineRequest { engine_id: "trailers".into() }).await.unwrap();
    let events = run_turn(&g, "t", "one more").await;
    assert!(completed(&events), "{events:?}");
    let e = engine_status(&g, "trailers").await;
    let (op, reason) = quarantine_of(&e);
    assert_eq!(op, "Bootstrap", "the turn's first call to it: {e:?}");
    assert!(reason.contains("panicked"), "{reason}");
    g.stop().await;
}

#[tokio::test]
async fn a_health_check_that_never_answers_times_out_and_the_engine_stays_out_of_service() {
    let engine = EngineProcess::start(
        bin("ctxgate-broken-engine"),
        &["--listen", "127.0.0.1:0", "--honest-info", "--hang-health-check"],
    )
    .await
    .unwrap();
    let g = TestGateway::start(hosting("bare", &engine.endpoint, &[])).await;
    // The monitor's Check is bounded (5 s): a hung one is an unreachable
    // engine, not a frozen monitor.
    let started = Instant::now();
    let e = wait_engine(&g, "bare", "unreachable by its health check", |e| e.health == "UNREACHABLE").await;
    let took = started.elapsed();
    assert!(took >= Duration::from_secs(4) && took < Duration::from_secs(12), "after the 5 s bound: {took:?}");
    assert!(e.quarantine.is_some(), "out of service: {e:?}");
    let events = run_turn(&g, "h", "still answering").await;
    assert!(completed(&events) && selected(&events).engine_id == "legacy", "{events:?}");
    g.stop().await;
}

#[tokio::test]
async fn a_clients_traceparent_is_continued_into_the_engines_calls() {
    let engine = fault_engine("trace-probe").await;
    let g = TestGateway::start(hosting("fault", &engine.endpoint, &[])).await;
    attached(&g, "fault").await;
    let client_trace = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let mut req = tonic::Request::new(api::RunTurnRequest {
        session: session("traced"),
        message: "hello".into(),
        ..Default::default()
    });
    req.metadata_mut().insert("traceparent", client_trace.parse().unwrap());
    let mut stream = g.client.clone().run_turn(req).await.unwrap().into_inner();
    while stream.next().await.is_some() {}
    let line = engine.wait_line("event trace ", Duration::from_secs(5)).await.expect("Assemble ran");
    let got = line.trim_start_matches("event trace ").split(' ').next().unwrap();
    let parts: Vec<&str> = got.split('-').collect();
    assert_eq!(parts.len(), 4, "{line}");
    assert_eq!(parts[1], "4bf92f3577b34da6a3ce929d0e0e4736", "the client's trace: {line}");
    assert_ne!(parts[2], "00f067aa0ba902b7", "the gateway's own span as the parent: {line}");

    // No traceparent from the client: the turn's calls still share one (new) trace.
    let events = run_turn(&g, "untraced", "hello").await;
    assert!(completed(&events));
    let lines = engine.lines_starting("event trace ");
    let last = lines.last().unwrap().trim_start_matches("event trace ");
    assert!(last.starts_with("00-") && !last.contains("4bf92f35"), "a trace of its own: {last}");
}
