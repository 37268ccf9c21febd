//! Spans exported over OTLP/gRPC (OpenTelemetry's protocol, with the
//! `opentelemetry-proto` client), when an endpoint is configured: the
//! gateway's turns and engine calls, an SDK engine's methods. Each hop
//! records its span with the ids it sent on (`traceparent`), so the spans
//! of one turn form one trace across processes.
//!
//! Bounded by construction: at most [`QUEUE`] spans wait to be sent; more
//! are dropped and counted (telemetry never slows a turn or grows without
//! limit). A batch goes out every second, or as soon as [`BATCH`] spans
//! wait; a collector that fails or stalls loses that batch (logged once
//! until it recovers), never the turn.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ctxgate_proto::trace::TraceParent;
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, trace_service_client::TraceServiceClient,
};
use opentelemetry_proto::tonic::common::v1::{AnyValue, InstrumentationScope, KeyValue, any_value};
use opentelemetry_proto::tonic::resource::v1::Resource;
use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans, Status, span, status};
use tokio::sync::mpsc;

/// Spans waiting to be sent, at most.
pub const QUEUE: usize = 4096;
/// Spans per export request, at most.
pub const BATCH: usize = 512;
const EVERY: Duration = Duration::from_secs(1);
const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);

/// What a span stands for (OpenTelemetry's span kinds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Serving a call (a turn, an engine method).
    Server,
    /// Making a call (the gateway's call to an engine).
    Client,
}

/// One finished span.
#[derive(Debug, Clone)]
pub struct Span {
    pub name: String,
    pub kind: Kind,
    /// The trace, and this span's own id (`parent_id` is what this hop
    /// sent on as the parent of its calls).
    pub this: TraceParent,
    /// The span that called this one, when there was one.
    pub parent: Option<[u8; 8]>,
    pub start: SystemTime,
    pub end: SystemTime,
    pub attributes: Vec<(&'static str, String)>,
    /// Why it failed, when it did.
    pub error: Option<String>,
}

/// Sends spans to one OTLP/gRPC collector. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Exporter {
    tx: mpsc::Sender<Span>,
    dropped: Arc<AtomicU64>,
}

impl Exporter {
    /// Starts exporting to `endpoint` (OTLP/gRPC, usually port 4317) as
    /// `service`: `http://HOST:PORT`, or `https://HOST:PORT` with the
    /// collector's certificate verified against `ca` (a PEM file, named by
    /// the option `ca.0`; none: the public web roots) — spans carry
    /// session keys and engine names. Must run inside a tokio runtime; the
    /// sender stops when every clone of the exporter is dropped.
    pub fn start(endpoint: &str, service: &str, ca: Option<(&str, &std::path::Path)>) -> Result<Self, String> {
        let (tls, address) = match endpoint.strip_prefix("https://") {
            Some(rest) => (true, rest),
            None => (false, endpoint),
        };
        let parsed: crate::Endpoint = address.parse().map_err(|e| format!("{e}"))?;
        if matches!(parsed, crate::Endpoint::Unix(_)) {
            return Err(format!("{endpoint:?}: OTLP goes to http://HOST:PORT or https://HOST:PORT"));
        }
        let channel = match (tls, ca) {
            (true, ca) => {
                let config = crate::tls::client(ca.map(|(option, path)| crate::tls::Pem::new(option, path)), None)
                    .map_err(|e| e.to_string())?;
                crate::endpoint::tls_channel(&parsed, config).map_err(|e| e.to_string())?
            }
            (false, Some((option, _))) => {
                return Err(format!("{option} is for an https:// endpoint; {endpoint} is plaintext"));
            }
            (false, None) => crate::endpoint::channel(&parsed),
        };
        let client = TraceServiceClient::new(channel);
        let (tx, rx) = mpsc::channel(QUEUE);
        let resource = Resource {
            attributes: vec![kv("service.name", service.to_owned())],
            dropped_attributes_count: 0,
            entity_refs: vec![],
        };
        tokio::spawn(send(client, rx, resource, endpoint.to_owned()));
        Ok(Self { tx, dropped: Arc::default() })
    }

    /// Queues a finished span; drops it (counted) when the queue is full.
    /// A trace its caller did not sample (W3C flags) is not exported.
    pub fn record(&self, span: Span) {
        if span.this.flags & 1 == 0 {
            return;
        }
        if self.tx.try_send(span).is_err() {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Spans dropped so far because the queue was full.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

fn kv(key: &str, value: String) -> KeyValue {
    KeyValue {
        key: key.to_owned(),
        value: Some(AnyValue { value: Some(any_value::Value::StringValue(value)) }),
        ..Default::default()
    }
}

fn nanos(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

fn wire(s: Span) -> opentelemetry_proto::tonic::trace::v1::Span {
    let kind = match s.kind {
        Kind::Server => span::SpanKind::Server,
        Kind::Client => span::SpanKind::Client,
    };
    let status = match s.error {
        Some(message) => Status { message, code: status::StatusCode::Error as i32 },
        None => Status { message: String::new(), code: status::StatusCode::Ok as i32 },
    };
    opentelemetry_proto::tonic::trace::v1::Span {
        trace_id: s.this.trace_id.to_vec(),
        span_id: s.this.parent_id.to_vec(),
        parent_span_id: s.parent.map(|p| p.to_vec()).unwrap_or_default(),
        flags: u32::from(s.this.flags),
        name: s.name,
        kind: kind as i32,
        start_time_unix_nano: nanos(s.start),
        end_time_unix_nano: nanos(s.end),
        attributes: s.attributes.into_iter().map(|(k, v)| kv(k, v)).collect(),
        status: Some(status),
        ..Default::default()
    }
}

/// The sending loop: a batch per second or per [`BATCH`] spans.
async fn send(
    mut client: TraceServiceClient<tonic::transport::Channel>,
    mut rx: mpsc::Receiver<Span>,
    resource: Resource,
    endpoint: String,
) {
    let mut failing = false;
    loop {
        let mut batch = Vec::new();
        let window = tokio::time::sleep(EVERY);
        tokio::pin!(window);
        while batch.len() < BATCH {
            tokio::select! {
                s = rx.recv() => match s {
                    Some(s) => batch.push(wire(s)),
                    None if batch.is_empty() => return,
                    None => break,
                },
                () = &mut window => break,
            }
        }
        if batch.is_empty() {
            continue;
        }
        let n = batch.len();
        let req = ExportTraceServiceRequest {
            resource_spans: vec![ResourceSpans {
                resource: Some(resource.clone()),
                scope_spans: vec![ScopeSpans {
                    scope: Some(InstrumentationScope {
                        name: "ctxgate".into(),
                        version: env!("CARGO_PKG_VERSION").into(),
                        ..Default::default()
                    }),
                    spans: batch,
                    schema_url: String::new(),
                }],
                schema_url: String::new(),
            }],
        };
        let mut req = tonic::Request::new(req);
        req.set_timeout(EXPORT_TIMEOUT);
        match tokio::time::timeout(EXPORT_TIMEOUT, client.export(req)).await {
            Ok(Ok(_)) => {
                if std::mem::take(&mut failing) {
                    tracing::info!(%endpoint, "OTLP export works again");
                }
            }
            r => {
                if !failing {
                    let why = match r {
                        Ok(Err(s)) => format!("{:?}: {}", s.code(), s.message()),
                        _ => format!("no answer within {EXPORT_TIMEOUT:?}"),
                    };
                    tracing::warn!(%endpoint, spans = n, error = %why, "OTLP export failed; spans dropped until it works");
                }
                failing = true;
            }
        }
    }
}
