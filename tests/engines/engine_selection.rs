//! Which engine the slot selects: a reload that removes the selected
//! entry resets the slot to legacy.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::time::{Duration, Instant};

use ctxgate_tests::TestGateway;
use ctxgate_tests::hosting::*;

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
