//! Turns through the Python engine (engines/python) as a real process. The
//! Python engine also runs in the conformance, delta history, durable
//! turns, tracing and TLS tests (tests/README.md).

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use ctxgate_tests::hosting::*;

#[tokio::test]
async fn turns_run_through_the_python_engine() {
    let (_py_state, _engine, g) = python_gateway().await;
    let events = run_turn(&g, "p", "hello from a polyglot test").await;
    assert!(completed(&events), "{events:?}");
    assert_eq!(selected(&events).engine_id, "py-recency");
    let e = engine_status(&g, "py").await;
    assert!(e.quarantine.is_none(), "{e:?}");
    g.stop().await;
}
