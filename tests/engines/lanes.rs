//! Untrusted engines stay in their lane: the Host service is alone on its
//! listener (no client method answers there, no callback on the client
//! API), and an engine that turns its grant against the gateway is held
//! to its budget while other sessions keep their turns.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::time::Duration;

use ctxgate_proto::pb::{self, host_client::HostClient};
use ctxgate_tests::hosting::{completed, engine_status, fault_gateway, run_turn};

#[tokio::test]
async fn from_its_host_endpoint_an_engine_reaches_no_client_api_method() {
    let (engine, g) = fault_gateway("client-api-probe").await;
    assert!(completed(&run_turn(&g, "k", "hello").await));
    let line = engine.wait_line("event client-api", Duration::from_secs(10)).await.unwrap();
    let mut words = line.split_whitespace().skip(2);
    let n: usize = words.next().unwrap().parse().unwrap();
    let codes: Vec<&str> = words.next().unwrap().split(',').collect();
    // Every Gateway and Harness method, each one refused.
    for method in ["RunTurn", "DriveTurn", "ListSessions", "GetTranscript", "DeleteSession", "GetStatus"] {
        assert!(codes.iter().any(|c| c.starts_with(&format!("{method}="))), "{method} was not probed: {line}");
    }
    assert_eq!(codes.len(), n, "{line}");
    let answered: Vec<&&str> = codes.iter().filter(|c| !c.ends_with("=Unimplemented")).collect();
    assert!(answered.is_empty(), "client methods answered on the Host listener: {answered:?}");
    g.stop().await;
}

#[tokio::test]
async fn the_client_listener_serves_no_host_callbacks() {
    let (_engine, g) = fault_gateway("").await;
    let mut host = HostClient::connect(g.endpoint.clone()).await.unwrap();
    let req = pb::ReadTranscriptRequest { grant: "g".into(), session_id: "s".into(), ..Default::default() };
    let code = host.read_transcript(req).await.map(drop).unwrap_err().code();
    assert_eq!(code, tonic::Code::Unimplemented, "the Host service answered on the client API");
    g.stop().await;
}

/// The numbers after `key=` in a flood report.
fn count(line: &str, key: &str) -> u64 {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key).and_then(|v| v.strip_prefix('=')))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key} in {line}"))
}

#[tokio::test]
async fn an_engine_flooding_the_host_is_held_to_its_grant_and_other_sessions_keep_answering() {
    let (engine, g) = fault_gateway("flood").await;
    assert!(completed(&run_turn(&g, "flood-1", "some history to read").await));
    // Two flooding sessions while another session takes its turns.
    let flooding = [
        tokio::spawn({
            let g = g.client.clone();
            async move { ctxgate_tests::hosting::run_turn_on(&g, "flood-1", "again").await }
        }),
        tokio::spawn({
            let g = g.client.clone();
            async move { ctxgate_tests::hosting::run_turn_on(&g, "flood-2", "flood").await }
        }),
    ];
    for i in 0..5 {
        let events = run_turn(&g, "calm", &format!("turn {i}")).await;
        assert!(completed(&events), "a calm session's turn failed during the flood: {events:?}");
    }
    for f in flooding {
        assert!(completed(&f.await.unwrap()), "a flooding session's own turn still completes");
    }
    let lines = engine.wait_lines("event flood", 3, Duration::from_secs(10)).await.unwrap();
    for line in &lines {
        assert!(count(line, "read_ok") > 0, "reads within the budget are served: {line}");
        assert!(count(line, "read_exhausted") > 0, "reads over the budget are RESOURCE_EXHAUSTED: {line}");
        assert!(count(line, "llm_exhausted") > 0, "model calls over the budget are RESOURCE_EXHAUSTED: {line}");
        assert!(count(line, "llm_ok") <= 8, "at most llmPerCall model calls: {line}");
        assert_eq!(count(line, "other"), 0, "every refusal is RESOURCE_EXHAUSTED: {line}");
    }
    assert!(engine_status(&g, "fault").await.quarantine.is_none());
    g.stop().await;
}
