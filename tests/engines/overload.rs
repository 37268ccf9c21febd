//! Overload is not breakage: an engine call over the gateway's cap
//! (`plugins.entries.<id>.maxConcurrentCalls`), or one the engine refuses
//! at its own limit (the SDK's `--max-concurrent-calls`, RESOURCE_EXHAUSTED
//! with a retry pushback), is answered by legacy for that call and never
//! quarantines the engine.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::time::Duration;

use ctxgate::config::{Config, EngineEntry};
use ctxgate_proto::gateway::{self as api, turn_event::Event};
use ctxgate_proto::pb;
use ctxgate_tests::{EngineProcess, TestGateway, bin, metrics_text};
use tokio_stream::StreamExt;

fn hosting(endpoint: &str, max_calls: usize) -> Config {
    let mut c = Config::default();
    let entry = EngineEntry { endpoint: endpoint.into(), max_concurrent_calls: max_calls, ..EngineEntry::default() };
    c.plugins.entries.insert("fault".into(), entry);
    c.plugins.slots.context_engine = Some("fault".into());
    c.gateway.metrics_listen = "127.0.0.1:0".into();
    c
}

async fn run_turn(client: api::gateway_client::GatewayClient<tonic::transport::Channel>, key: &str) -> Vec<Event> {
    let session = Some(api::SessionRef { agent_id: String::new(), session_key: key.into() });
    let req = api::RunTurnRequest { session, message: "hello".into(), system_prompt: None, ..Default::default() };
    let mut stream = client.clone().run_turn(req).await.unwrap().into_inner();
    let mut events = Vec::new();
    while let Some(e) = stream.next().await {
        events.push(e.unwrap().event.unwrap());
    }
    events
}

/// Waits (bounded) until the engine has reported `n` Assemble calls.
async fn assembles(engine: &EngineProcess, n: usize) {
    let seen = engine.wait_lines("event assemble", n, Duration::from_secs(10)).await;
    assert!(seen.is_some(), "the engine never saw assemble #{n}");
}

/// Runs a turn whose Assemble the slow engine holds, and while it is in
/// flight a second turn on another session; returns the second's events.
async fn second_turn_while_one_is_in_flight(g: &TestGateway, engine: &EngineProcess) -> Vec<Event> {
    let before = engine.lines_starting("event assemble").len();
    let first = tokio::spawn(run_turn(g.client.clone(), "first"));
    assembles(engine, before + 1).await;
    let second = run_turn(g.client.clone(), "second").await;
    let first = first.await.unwrap();
    assert!(matches!(first.last(), Some(Event::Completed(_))), "{first:?}");
    second
}

async fn assemble_counters(g: &TestGateway) -> api::MethodCounters {
    let s = g.client.clone().get_status(api::StatusRequest {}).await.unwrap().into_inner();
    let e = s.engines.into_iter().find(|e| e.id == "fault").unwrap();
    assert!(e.quarantine.is_none(), "overload never quarantines: {:?}", e.quarantine);
    e.methods.into_iter().find(|m| m.method == "Assemble").unwrap()
}

#[tokio::test]
async fn a_call_over_the_gateways_cap_is_answered_by_legacy_without_quarantine() {
    let engine =
        EngineProcess::start(bin("ctxgate-fault-engine"), &["--listen", "127.0.0.1:0", "--fault", "slow-assemble"])
            .await
            .unwrap();
    let g = TestGateway::start(hosting(&engine.endpoint, 1)).await;
    g.wait_attached("fault").await;
    let second = second_turn_while_one_is_in_flight(&g, &engine).await;
    assert!(matches!(second.last(), Some(Event::Completed(_))), "{second:?}");
    let counters = assemble_counters(&g).await;
    assert_eq!((counters.shed, counters.fallbacks), (1, 1), "{counters:?}");
    assert_eq!(engine.lines_starting("event assemble").len(), 1, "the shed call never reached the engine");
    let metrics = metrics_text(g.metrics.unwrap()).await;
    assert!(metrics.contains("ctxgate_engine_shed_total{engine=\"fault\",method=\"Assemble\"} 1"), "{metrics}");
    g.stop().await;
}

#[tokio::test]
async fn an_engine_at_its_own_limit_answers_resource_exhausted_and_is_not_quarantined() {
    let args = ["--listen", "127.0.0.1:0", "--fault", "slow-assemble", "--max-concurrent-calls", "1"];
    let engine = EngineProcess::start(bin("ctxgate-fault-engine"), &args).await.unwrap();

    // What any client sees: RESOURCE_EXHAUSTED with a retry pushback.
    let channel = tonic::transport::Endpoint::from_shared(engine.endpoint.clone()).unwrap().connect_lazy();
    let raw = pb::context_engine_client::ContextEngineClient::new(channel);
    let req = || pb::AssembleRequest { session_id: "s".into(), ..Default::default() };
    let held = tokio::spawn({
        let mut c = raw.clone();
        async move { c.assemble(req()).await }
    });
    assembles(&engine, 1).await;
    let refused = raw.clone().assemble(req()).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::ResourceExhausted, "{refused:?}");
    assert!(refused.metadata().contains_key("grpc-retry-pushback-ms"), "{refused:?}");
    held.await.unwrap().unwrap();
    // GetInfo is never refused, even at the limit.
    let held = tokio::spawn({
        let mut c = raw.clone();
        async move { c.assemble(req()).await }
    });
    assembles(&engine, 2).await;
    raw.clone().get_info(pb::GetInfoRequest {}).await.unwrap();
    held.await.unwrap().unwrap();

    // Through the gateway: legacy answers the refused call, no quarantine.
    let g = TestGateway::start(hosting(&engine.endpoint, 256)).await;
    g.wait_attached("fault").await;
    let second = second_turn_while_one_is_in_flight(&g, &engine).await;
    assert!(matches!(second.last(), Some(Event::Completed(_))), "{second:?}");
    let counters = assemble_counters(&g).await;
    assert_eq!(counters.shed, 1, "{counters:?}");
    g.stop().await;
}
