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
