//! Subagents: a fork starts from the parent's history through the window
//! engine, children end once and are swept after their ttl; a spawn that
//! fails after the engine prepared it is rolled back; deleting a parent
//! ends its subagents and keeps their sessions.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::time::{Duration, Instant};

use ctxgate::config::Config;
use ctxgate_proto::gateway as api;
use ctxgate_tests::hosting::*;
use ctxgate_tests::{TestGateway, start_window};
use tonic::Code;

#[tokio::test]
async fn subagents_fork_from_the_window_engine_end_and_are_swept() {
    let dir = tempfile::tempdir().unwrap();
    let engine = start_window(dir.path(), &[]).await;
    let g = attached_gateway("window", &engine.endpoint, &[]).await;
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
    let (engine, g) = fault_gateway("slow-prepare").await;
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
async fn deleting_a_parent_ends_its_subagents_and_keeps_their_sessions() {
    let g = TestGateway::start(Config::default()).await;
    let mut c = g.client.clone();
    let spawn = |parent: &str, child: &str| api::SpawnSubagentRequest {
        parent: Some(sref(parent)),
        child_session_key: child.into(),
        context_mode: "fork".into(),
        ttl_ms: None,
    };
    for parent in ["mom", "dad"] {
        assert!(completed(&run_turn(&g, parent, &format!("{parent} speaks")).await));
    }
    for (parent, child) in [("mom", "kid-1"), ("mom", "kid-2"), ("dad", "kid-3")] {
        c.spawn_subagent(spawn(parent, child)).await.unwrap();
    }
    c.delete_session(sref("mom")).await.unwrap();
    let end = |key: &str| api::EndSubagentRequest { child: Some(sref(key)), reason: "completed".into() };
    for kid in ["kid-1", "kid-2"] {
        let e = c.end_subagent(end(kid)).await.unwrap_err();
        assert_eq!(e.code(), Code::NotFound, "{kid}'s subagent record ended with its parent: {e:?}");
        let kept = messages(&g, kid).await;
        assert_eq!(kept.first().map(String::as_str), Some("mom speaks"), "{kid} keeps its transcript: {kept:?}");
    }
    assert!(c.end_subagent(end("kid-3")).await.unwrap().into_inner().ended, "another parent's subagent lives on");
    g.stop().await;
}
