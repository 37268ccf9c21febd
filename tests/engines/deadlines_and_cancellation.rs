//! Deadlines and cancellation on the gateway's calls to an engine process:
//! a call that hangs is cut at its deadline and falls back to legacy, and
//! the engine sees the cancel; a client's cancel reaches the engine at once
//! and is never held against it.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ctxgate_tests::hosting::*;

#[tokio::test]
async fn a_hanging_call_times_out_falls_back_and_the_engine_sees_the_cancel() {
    let (engine, g) = fault_gateway_with("hang", &[("assemble", 0.3)]).await;
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

fn unix_us() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_micros()
}

#[tokio::test]
async fn a_client_cancel_reaches_the_engine_within_50ms_and_never_quarantines() {
    let (engine, g) = fault_gateway_with("hang", &[("assemble", 60.0)]).await;
    let stream = g.client.clone().run_turn(turn_request("a", "wait for me")).await.unwrap().into_inner();
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
