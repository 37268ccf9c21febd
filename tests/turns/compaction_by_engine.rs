//! Compaction an engine owns (its `Compact`), hosted by the gateway: a
//! hung Compact returns at the compaction timeout and quarantines the
//! engine; a failing one in overflow recovery falls back to built-in
//! compaction. Built-in compaction is in compaction.rs.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::time::{Duration, Instant};

use ctxgate_proto::gateway::{self as api, turn_event::Event};
use ctxgate_tests::fake_openai::{FakeOpenAi, Reply};
use ctxgate_tests::hosting::*;
use ctxgate_tests::{TestGateway, compact_to_end};
use tonic::Code;

use crate::managed_turns::openai_hosting;

#[tokio::test]
async fn a_hung_compact_returns_within_the_timeout_plus_100ms_and_quarantines() {
    let engine = fault_engine("hang").await;
    let mut config = hosting("fault", &engine.endpoint, &[]);
    config.agents.defaults.compaction.timeout_seconds = 1;
    let g = TestGateway::start(config).await;
    attached(&g, "fault").await;
    // A session to compact (assemble hangs too: give the turn a short deadline).
    g.client.clone().new_session(api::SessionRef { agent_id: String::new(), session_key: "k".into() }).await.unwrap();
    let started = Instant::now();
    let (_, status) = compact_to_end(&g.client, "k").await;
    let took = started.elapsed();
    eprintln!("the hung Compact returned after {took:?} (timeout 1 s)");
    assert_eq!(status.unwrap().code(), Code::DeadlineExceeded);
    assert!(took < Duration::from_millis(1100), "{took:?}");
    let e = engine_status(&g, "fault").await;
    assert_eq!(quarantine_of(&e).0, "Compact");
    assert!(engine.wait_line("event cancelled Compact", Duration::from_secs(5)).await.is_some());
    g.stop().await;
}

#[tokio::test]
async fn a_failing_engine_compaction_in_overflow_recovery_falls_back_to_built_in() {
    let fake = FakeOpenAi::start().await;
    let engine = fault_engine("compact-fails").await;
    let mut config = openai_hosting(&fake, "fault", &engine.endpoint);
    config.agents.defaults.compaction.keep_recent_tokens = 200;
    let g = TestGateway::start(config).await;
    attached(&g, "fault").await;
    for i in 0..5 {
        assert!(completed(&run_turn(&g, "o", &format!("turn {i} about file_{i}.rs {}", "words ".repeat(40))).await));
    }
    fake.turns([Reply::Overflow, Reply::Overflow, Reply::Text("made it".into())]);
    let events = run_turn(&g, "o", "the overflowing question").await;
    assert!(matches!(events.last(), Some(Event::Completed(c)) if c.text == "made it"), "{events:?}");
    assert!(events.iter().any(|e| matches!(e, Event::Warning(w) if w.message.contains("overflow compaction failed"))));
    assert!(
        events.iter().any(|e| matches!(e, Event::CompactionDone(d) if d.compacted && d.entry_id.is_some())),
        "the second attempt used built-in compaction: {events:?}"
    );
    assert_eq!(quarantine_of(&engine_status(&g, "fault").await).0, "Compact");
    g.stop().await;
}
