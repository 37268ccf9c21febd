//! One trace across processes: a client's `traceparent` on RunTurn, the
//! gateway's turn span and its engine call spans (exported over OTLP by the
//! gateway), and the engine's method spans (exported by the SDK server in
//! the window engine's process), all received by an OTLP/gRPC collector
//! this test runs. And without a collector: a client's `traceparent` is
//! continued into the engine's calls (the fault fixture reports the one it
//! got).

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::sync::{Arc, Mutex};
use std::time::Duration;

use ctxgate::config::OtlpSection;
use ctxgate_proto::gateway as api;
use ctxgate_tests::hosting::*;
use ctxgate_tests::{TestGateway, start_window};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use tokio_stream::StreamExt;

/// A span as received, with the `service.name` of its resource.
#[derive(Debug, Clone)]
struct Got {
    service: String,
    name: String,
    kind: i32,
    trace_id: Vec<u8>,
    span_id: Vec<u8>,
    parent: Vec<u8>,
}

#[derive(Clone, Default)]
struct Collector(Arc<Mutex<Vec<Got>>>);

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        req: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut got = self.0.lock().unwrap();
        for rs in req.into_inner().resource_spans {
            let service = rs
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|a| a.key == "service.name")
                .and_then(|a| match a.value.as_ref()?.value.as_ref()? {
                    Value::StringValue(s) => Some(s.clone()),
                    _ => None,
                })
                .unwrap_or_default();
            for s in rs.scope_spans.into_iter().flat_map(|s| s.spans) {
                got.push(Got {
                    service: service.clone(),
                    name: s.name,
                    kind: s.kind,
                    trace_id: s.trace_id,
                    span_id: s.span_id,
                    parent: s.parent_span_id,
                });
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

/// An OTLP/gRPC collector on loopback: what it received, and its address.
async fn collector() -> (Collector, String) {
    collector_with(None).await
}

/// [`collector`], over TLS with `tls` when given (its address https://).
async fn collector_with(tls: Option<ctxgate_runtime::tls::LiveServerTls>) -> (Collector, String) {
    let collector = Collector::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let scheme = if tls.is_some() { "https" } else { "http" };
    let otlp = format!("{scheme}://{}", listener.local_addr().unwrap());
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    let server = tonic::transport::Server::builder().add_service(TraceServiceServer::new(collector.clone()));
    match tls {
        Some(tls) => {
            let incoming = ctxgate_runtime::accept::tls(incoming, Default::default(), tls);
            tokio::spawn(server.serve_with_incoming(incoming));
        }
        None => {
            tokio::spawn(server.serve_with_incoming(incoming));
        }
    }
    (collector, otlp)
}

/// A gateway exporting to `otlp` with engine `id` at `endpoint`, attached.
async fn gateway(id: &str, endpoint: &str, otlp: &str) -> TestGateway {
    let mut config = hosting(id, endpoint, &[]);
    config.gateway.otlp = Some(OtlpSection { endpoint: otlp.to_owned(), ca: None, service_name: "ctxgate".into() });
    let g = TestGateway::start(config).await;
    attached(&g, id).await;
    g
}

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

/// A turn sent with the client's traceparent, run to its end.
async fn traced_turn(g: &TestGateway, key: &str) {
    turn_with(g, key, &format!("00-{TRACE}-{CLIENT_SPAN}-01")).await;
}

async fn turn_with(g: &TestGateway, key: &str, traceparent: &str) {
    let mut req = tonic::Request::new(api::RunTurnRequest {
        session: session(key),
        message: "hello".into(),
        ..Default::default()
    });
    req.metadata_mut().insert("traceparent", traceparent.parse().unwrap());
    let mut stream = g.client.clone().run_turn(req).await.unwrap().into_inner();
    let mut completed = false;
    while let Some(e) = stream.next().await {
        completed |= matches!(e.unwrap().event, Some(api::turn_event::Event::Completed(_)));
    }
    assert!(completed);
}

/// Checks the trace of a turn's Assemble: the gateway's turn span under the
/// client's, the gateway's call span under the turn, and the engine's
/// method span (exported by `engine_service`) under the call.
async fn assert_one_trace(collector: &Collector, engine_service: &str) {
    let assemble = "contextengine.v1.ContextEngine/Assemble";
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let (turn, call, method) = loop {
        let spans: Vec<Got> =
            collector.0.lock().unwrap().iter().filter(|s| s.trace_id == hex(TRACE)).cloned().collect();
        let turn = spans.iter().find(|s| s.name == "ctxgate.turn/managed").cloned();
        let call = spans.iter().find(|s| s.name == assemble && s.kind == SpanKind::Client as i32).cloned();
        let method = spans.iter().find(|s| s.name == assemble && s.kind == SpanKind::Server as i32).cloned();
        if let (Some(t), Some(c), Some(m)) = (turn, call, method) {
            break (t, c, m);
        }
        assert!(tokio::time::Instant::now() < deadline, "the trace never arrived whole: {spans:#?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!((turn.service.as_str(), turn.kind), ("ctxgate", SpanKind::Server as i32), "{turn:?}");
    assert_eq!(turn.parent, hex(CLIENT_SPAN), "the turn continues the client's span");
    assert_eq!((call.service.as_str(), call.parent.clone()), ("ctxgate", turn.span_id.clone()), "{call:?}");
    assert_eq!(method.service, engine_service, "{method:?}");
    assert_eq!(method.parent, call.span_id, "the engine's span continues the gateway's call");
    let ids = [&turn.span_id, &call.span_id, &method.span_id];
    assert!(ids.iter().all(|i| i.len() == 8) && ids[0] != ids[1] && ids[1] != ids[2], "{ids:?}");
}

#[tokio::test]
async fn one_trace_spans_the_client_the_gateway_and_an_sdk_engine() {
    let (collector, otlp) = collector().await;
    let dir = tempfile::tempdir().unwrap();
    let engine = start_window(dir.path(), &["--otlp-endpoint", &otlp, "--otlp-service-name", "window-engine"]).await;
    let g = gateway("window", &engine.endpoint, &otlp).await;
    traced_turn(&g, "traced").await;
    assert_one_trace(&collector, "window-engine").await;

    // A trace the client did not sample is continued, not exported. Spans
    // leave in order, so once a later turn's spans are in, its would be.
    let (unsampled, later) = ("11111111111111111111111111111111", "22222222222222222222222222222222");
    turn_with(&g, "traced", &format!("00-{unsampled}-{CLIENT_SPAN}-00")).await;
    turn_with(&g, "traced", &format!("00-{later}-{CLIENT_SPAN}-01")).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while !collector.0.lock().unwrap().iter().any(|s| s.trace_id == hex(later) && s.service == "window-engine") {
        assert!(tokio::time::Instant::now() < deadline, "the later turn's spans never arrived");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let leaked: Vec<Got> =
        collector.0.lock().unwrap().iter().filter(|s| s.trace_id == hex(unsampled)).cloned().collect();
    assert!(leaked.is_empty(), "unsampled spans were exported: {leaked:#?}");
    g.stop().await;
}

#[tokio::test]
async fn a_collector_that_is_down_costs_spans_not_turns() {
    // A port nothing listens on.
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let otlp = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let mut config = ctxgate::config::Config::default();
    config.gateway.otlp = Some(OtlpSection { endpoint: otlp, ca: None, service_name: "ctxgate".into() });
    let g = TestGateway::start(config).await;
    for i in 0..20 {
        let events = run_turn(&g, "down", &format!("turn {i}")).await;
        assert!(completed(&events), "{events:?}");
    }
    g.stop().await;
}

#[tokio::test]
async fn the_python_engine_continues_the_trace_too() {
    let (collector, otlp) = collector().await;
    let dir = tempfile::tempdir().unwrap();
    let engine = ctxgate_tests::start_python_with(dir.path(), &["--otlp-endpoint", &otlp]).await;
    let g = gateway("py", &engine.endpoint, &otlp).await;
    traced_turn(&g, "traced").await;
    assert_one_trace(&collector, "ctxgate-engine-python").await;
    g.stop().await;
}

#[tokio::test]
async fn a_clients_traceparent_is_continued_into_the_engines_calls() {
    let (engine, g) = fault_gateway("trace-probe").await;
    let client_trace = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let mut req = tonic::Request::new(api::RunTurnRequest {
        session: session("traced"),
        message: "hello".into(),
        ..Default::default()
    });
    req.metadata_mut().insert("traceparent", client_trace.parse().unwrap());
    let mut stream = g.client.clone().run_turn(req).await.unwrap().into_inner();
    while stream.next().await.is_some() {}
    let line = engine.wait_line("event trace ", Duration::from_secs(5)).await.expect("Assemble ran");
    let got = line.trim_start_matches("event trace ").split(' ').next().unwrap();
    let parts: Vec<&str> = got.split('-').collect();
    assert_eq!(parts.len(), 4, "{line}");
    assert_eq!(parts[1], "4bf92f3577b34da6a3ce929d0e0e4736", "the client's trace: {line}");
    assert_ne!(parts[2], "00f067aa0ba902b7", "the gateway's own span as the parent: {line}");

    // No traceparent from the client: the turn's calls still share one (new) trace.
    let events = run_turn(&g, "untraced", "hello").await;
    assert!(completed(&events));
    let lines = engine.lines_starting("event trace ");
    let last = lines.last().unwrap().trim_start_matches("event trace ");
    assert!(last.starts_with("00-") && !last.contains("4bf92f35"), "a trace of its own: {last}");
}

/// Spans carry session keys: they go to an https:// collector too, its
/// certificate checked against `gateway.otlp.ca` — and to none other.
#[tokio::test]
async fn spans_reach_a_collector_over_tls_whose_certificate_the_ca_signed() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (ca, other) = (ctxgate_tests::certs::Ca::new("otlp CA"), ctxgate_tests::certs::Ca::new("another CA"));
    let (crt, key) = ca.leaf_files(d, "collector", &["127.0.0.1", "localhost"], true, false);
    let option = |p: std::path::PathBuf| ("test".to_owned(), p);
    let files = ctxgate_runtime::tls::ServerFiles {
        cert: option(crt),
        key: option(key),
        client_ca: None,
        client_names: Vec::new(),
    };
    for (trusted, spans) in [(&ca, true), (&other, false)] {
        let (collector, otlp) =
            collector_with(Some(ctxgate_runtime::tls::LiveServerTls::new(files.clone()).unwrap())).await;
        let ca_pem = ctxgate_tests::write_file(d, "trusted.pem", &trusted.pem);
        let mut config = ctxgate::config::Config::default();
        config.gateway.otlp = Some(OtlpSection { endpoint: otlp, ca: Some(ca_pem), service_name: "ctxgate".into() });
        let g = TestGateway::start(config).await;
        traced_turn(&g, "tls").await;
        // A batch goes out every second.
        let mut got = 0;
        for _ in 0..30 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            got = collector.0.lock().unwrap().len();
            if got > 0 {
                break;
            }
        }
        assert_eq!(
            got > 0,
            spans,
            "{got} spans with the collector's CA {}",
            if spans { "trusted" } else { "not trusted" }
        );
        g.stop().await;
    }
}
