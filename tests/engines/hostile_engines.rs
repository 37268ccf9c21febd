//! Engines that send too much: a flood of compaction progress, a reply
//! whose metadata is the bulk of it, a 16 MiB `purpose`. The gateway stays
//! bounded and up, refuses what is over the contract's limits with a clear
//! status, and the agent keeps its answers.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use ctxgate_proto::gateway as api;
use ctxgate_tests::compact_to_end;
use ctxgate_tests::hosting::{
    completed, engine_status, fault_gateway, fault_gateway_with, quarantine_of, run_turn, selected,
};
use std::time::Duration;

#[tokio::test]
async fn a_progress_flood_is_coalesced_capped_and_the_compaction_completes() {
    let (_engine, g) = fault_gateway_with("progress-flood", &[("compact", 60.0)]).await;
    assert!(completed(&run_turn(&g, "k", "some history first").await));
    let (events, status) = compact_to_end(&g.client, "k").await;
    assert!(status.is_none(), "{status:?}");
    use api::compaction_event::Event as C;
    let progress: Vec<_> = events
        .iter()
        .filter_map(|e| match &e.event {
            Some(C::Progress(p)) => Some(p),
            _ => None,
        })
        .collect();
    assert!(progress.len() < 100_000, "100 000 progress events reached the client one for one");
    assert!(progress.iter().all(|p| p.stage.len() <= 64), "an engine's 4 KiB stage reached the client");
    let done = events.iter().find_map(|e| match &e.event {
        Some(C::Done(d)) => Some(d),
        _ => None,
    });
    assert!(done.is_some_and(|d| d.compacted), "{:?}", events.last());
    assert!(engine_status(&g, "fault").await.quarantine.is_none(), "a chatty engine is not a broken one");
    g.stop().await;
}

#[tokio::test]
async fn a_reply_with_megabytes_of_metadata_is_a_contract_violation_and_the_turn_completes() {
    let (_engine, g) = fault_gateway("huge-metadata").await;
    let events = run_turn(&g, "m", "hello").await;
    assert!(completed(&events), "legacy answered the turn: {events:?}");
    let status = engine_status(&g, "fault").await;
    let (operation, reason) = quarantine_of(&status);
    assert_eq!(operation, "Assemble");
    assert!(reason.contains("metadata"), "{reason}");
    g.stop().await;
}

#[tokio::test]
async fn an_llm_complete_over_its_caps_is_refused_and_the_gateway_keeps_serving() {
    let (engine, g) = fault_gateway_with("huge-purpose", &[("assemble", 30.0)]).await;
    let events = run_turn(&g, "p", "hello").await;
    assert!(completed(&events), "{events:?}");
    assert_eq!(selected(&events).engine_id, "fault");
    let line = engine.wait_line("event purpose", Duration::from_secs(10)).await.unwrap();
    let codes = line.split_whitespace().nth(2).unwrap();
    assert_eq!(
        codes, "ResourceExhausted,ResourceExhausted,ResourceExhausted,ResourceExhausted,ok",
        "a purpose of 16 MiB and of 1 MiB, 1025 messages and 4.8 MiB of content are refused; 1024 messages are not: {line}"
    );
    assert!(completed(&run_turn(&g, "p", "still here?").await));
    g.stop().await;
}

/// An engine's model spend is metered in tokens: past its hourly budget a
/// call is refused (RESOURCE_EXHAUSTED) before it reaches the model, and
/// the turn still completes; within it, the tokens are counted.
#[tokio::test]
async fn an_engines_model_calls_past_its_hourly_token_budget_are_refused() {
    use ctxgate_tests::hosting::{attached, fault_engine, hosting};
    for (budget, last) in [(1_000, "ResourceExhausted"), (10_000_000, "ok")] {
        let engine = fault_engine("huge-purpose").await;
        let mut config = hosting("fault", &engine.endpoint, &[("assemble", 30.0)]);
        config.gateway.limits.host_callbacks.llm_tokens_per_engine_per_hour = budget;
        config.gateway.metrics_listen = "127.0.0.1:0".into();
        let g = ctxgate_tests::TestGateway::start(config).await;
        attached(&g, "fault").await;
        assert!(completed(&run_turn(&g, "p", "hello").await));
        let line = engine.wait_line("event purpose", Duration::from_secs(10)).await.unwrap();
        let codes = line.split_whitespace().nth(2).unwrap();
        assert_eq!(codes.rsplit(',').next(), Some(last), "budget {budget}: {line}");
        let metrics = ctxgate_tests::metrics_text(g.metrics.unwrap()).await;
        let input =
            ctxgate_tests::counter(&metrics, "ctxgate_host_llm_tokens_total", "engine=\"fault\",kind=\"input\"");
        assert_eq!(input > 0, last == "ok", "budget {budget}: {input} input tokens counted");
        g.stop().await;
    }
}
