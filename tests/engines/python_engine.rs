//! Turns through the Python engine (engines/python) as a real process. The
//! Python engine also runs in the conformance, delta history, durable
//! turns, tracing and TLS tests (tests/README.md).

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use ctxgate_tests::TestGateway;
use ctxgate_tests::hosting::*;

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
