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

/// The entry id (`plugins.entries` key) names the engine everywhere in the
/// gateway; the id the engine declares shows only in status beside it.
#[tokio::test]
async fn an_engine_is_named_by_its_entry_id_even_when_it_declares_another() {
    let engine = fault_engine("").await; // declares "fault"
    let mut config = hosting("team-memory", &engine.endpoint, &[]);
    config.gateway.metrics_listen = "127.0.0.1:0".into();
    let g = TestGateway::start(config).await;
    attached(&g, "team-memory").await;

    let s = status(&g).await;
    assert_eq!(s.selected_engine, "team-memory");
    let e = engine_status(&g, "team-memory").await;
    assert_eq!((e.id.as_str(), e.declared_id.as_str()), ("team-memory", "fault"));
    assert!(s.engines.iter().all(|e| e.id != "fault"), "{s:?}");

    let events = run_turn(&g, "named", "hi").await;
    assert!(completed(&events));
    assert_eq!(selected(&events).engine_id, "team-memory");

    let m = ctxgate_tests::metrics_text(g.metrics.unwrap()).await;
    assert!(m.contains("engine=\"team-memory\""), "{m}");
    assert!(!m.contains("engine=\"fault\""), "the declared id leaked into a metric label:\n{m}");
    g.stop().await;
}
