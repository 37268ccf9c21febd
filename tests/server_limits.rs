//! The client API's server limits: a request over `gateway.limits.maxRequestBytes`
//! is RESOURCE_EXHAUSTED (tonic alone says OUT_OF_RANGE), one under it runs.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use ctxgate::config::Config;
use ctxgate_proto::gateway as api;
use ctxgate_tests::TestGateway;
use tokio_stream::StreamExt;
use tonic::Code;

fn request(text: String) -> api::RunTurnRequest {
    api::RunTurnRequest {
        session: Some(api::SessionRef { agent_id: String::new(), session_key: "limits".into() }),
        message: text,
        ..Default::default()
    }
}

#[tokio::test]
async fn a_request_over_max_request_bytes_is_resource_exhausted_and_one_under_it_runs() {
    let mut config = Config::default();
    config.gateway.limits.max_request_bytes = 64 * 1024;
    let g = TestGateway::start(config).await;
    let over = g.client.clone().run_turn(request("x".repeat(70 * 1024))).await.unwrap_err();
    assert_eq!(over.code(), Code::ResourceExhausted, "{over:?}");

    let mut stream = g.client.clone().run_turn(request("y".repeat(30 * 1024))).await.unwrap().into_inner();
    let mut last = None;
    while let Some(e) = stream.next().await {
        last = e.unwrap().event;
    }
    assert!(matches!(last, Some(api::turn_event::Event::Completed(_))), "{last:?}");
    g.stop().await;
}

#[test]
fn limits_that_cannot_work_are_refused_with_their_key() {
    for (json, key) in [
        ("{ gateway: { limits: { maxRequestBytes: 10 } } }", "gateway.limits.maxRequestBytes"),
        (
            "{ gateway: { limits: { maxConcurrentStreamsPerConnection: 0 } } }",
            "gateway.limits.maxConcurrentStreamsPerConnection",
        ),
        ("{ gateway: { limits: { http2KeepaliveSeconds: 0 } } }", "gateway.limits.http2KeepaliveSeconds"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("c.json5");
        std::fs::write(&file, json).unwrap();
        let err = Config::load(Some(&file), |_| None).unwrap_err().to_string();
        assert!(err.contains(key), "{json}: {err}");
    }
}
