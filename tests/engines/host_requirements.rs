//! What an engine asks of its host: an engine whose host requirements the
//! managed runner does not meet degrades the turn to legacy with
//! OpenClaw's message (no quarantine), and host params an engine does not
//! accept are never sent to it.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::time::Duration;

use ctxgate_proto::gateway::turn_event::Event;
use ctxgate_tests::hosting::*;

#[tokio::test]
async fn a_missing_host_capability_degrades_the_turn_with_openclaws_message() {
    let (_engine, g) = fault_gateway("needs-threads").await;
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
async fn host_params_an_engine_does_not_accept_are_not_sent() {
    let (engine, g) = fault_gateway("accepts-nothing").await;
    assert!(completed(&run_turn(&g, "hp", "hi").await));
    let line = engine.wait_line("event params", Duration::from_secs(5)).await.unwrap();
    assert!(line.starts_with("event params key=no prompt=no settings=no context=no host=no "), "{line}");
    g.stop().await;
}
