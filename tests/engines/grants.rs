//! Grants: an engine's callbacks to the host (ReadTranscript) carry a grant
//! scoped to the session it was called for and to that call's life.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::time::Duration;

use ctxgate_tests::hosting::*;

#[tokio::test]
async fn a_grant_reads_only_its_own_session_and_dies_with_its_call() {
    let (engine, g) = fault_gateway("grant-probe").await;
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

/// An engine that opens reads of its transcript and never reads them
/// holds at most its grant's in-flight slots (`inFlightPerCall`, 2), and
/// its pages go with its call: read after the call, a hoarded stream ends
/// PERMISSION_DENIED instead of answering the page.
#[tokio::test]
async fn hoarded_transcript_reads_hold_their_slots_and_die_with_their_call() {
    let engine = fault_engine("read-hoard").await;
    let mut config = hosting("fault", &engine.endpoint, &[]);
    config.models.context_window = 1_000_000;
    let g = ctxgate_tests::TestGateway::start(config).await;
    attached(&g, "fault").await;
    // A transcript past what the gateway's connection sends or buffers
    // unread (the engine's HTTP/2 window, 64 KiB, and h2's send buffer,
    // 400 KiB), in chunks of 256 KiB at most, within the model's window.
    for i in 0..4 {
        run_turn(&g, "h", &format!("long message {i} ").repeat(15_000)).await;
    }
    let first = engine.lines_starting("event hoard ").len();
    let events = run_turn(&g, "h", "second").await;
    assert!(completed(&events), "{events:?}");
    let hoard = engine.lines_starting("event hoard ");
    assert!(hoard.len() > first, "{hoard:?}");
    assert!(
        hoard[first].starts_with("event hoard ok ok ResourceExhausted "),
        "the third read finds no slot: {hoard:?}"
    );
    // Each turn's hoard is read half a second after its call.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while engine.lines_starting("event hoard-after").len() < hoard.len() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let after = engine.lines_starting("event hoard-after");
    assert!(after.len() > first, "{after:?}");
    assert!(after[first].starts_with("event hoard-after PermissionDenied"), "the page went with the call: {after:?}");
    g.stop().await;
}
