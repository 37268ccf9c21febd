//! Prometheus metrics, served as text on `gateway.metricsListen` `/metrics`.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Outcome {
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DriverOutcome {
    pub driver: String,
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Trigger {
    pub trigger: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EngineMethod {
    pub engine: String,
    pub method: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EngineMethodCode {
    pub engine: String,
    pub method: String,
    pub code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EngineTokens {
    pub engine: String,
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EngineOperation {
    pub engine: String,
    pub operation: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EngineTool {
    pub engine: String,
    pub tool: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EngineToolOutcome {
    pub engine: String,
    pub tool: String,
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EngineReplica {
    pub engine: String,
    pub replica: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TriggerOutcome {
    pub trigger: String,
    pub outcome: String,
}

/// The store's group-commit counters, kept by the store and exported here.
#[derive(Clone, Debug, Default)]
pub struct StoreCounters {
    /// Write transactions committed (each one fsync).
    pub commits: Counter,
    /// Writes in them (more writes than commits: group commit at work).
    pub writes: Counter,
}

/// Every metric the gateway keeps. Cheap to clone (shared handles).
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    pub turns: Family<Outcome, Counter>,
    pub turns_by_driver: Family<DriverOutcome, Counter>,
    pub turn_seconds: Histogram,
    pub turns_in_flight: Gauge,
    pub turns_shed: Counter,
    /// The work limit (it follows latency: `core::admission`).
    pub turn_limit: Gauge,
    /// How long turns waited to start their work (behind their session,
    /// or held by admission).
    pub turn_wait_seconds: Histogram,
    pub compactions: Family<TriggerOutcome, Counter>,
    pub compaction_seconds: Family<Trigger, Histogram>,
    pub compaction_tokens_before: Counter,
    pub compaction_tokens_after: Counter,
    pub engine_calls: Family<EngineMethod, Counter>,
    pub engine_failures: Family<EngineMethodCode, Counter>,
    pub engine_timeouts: Family<EngineMethod, Counter>,
    pub engine_fallbacks: Family<EngineMethod, Counter>,
    pub engine_shed: Family<EngineMethod, Counter>,
    pub engine_history_gaps: Family<EngineMethod, Counter>,
    pub engine_quarantines: Family<EngineOperation, Counter>,
    /// 1 while a replica (an address of an engine) is in service, else 0.
    pub engine_replica_in_service: Family<EngineReplica, Gauge>,
    pub engine_call_seconds: Family<EngineMethod, Histogram>,
    pub engine_bytes_sent: Family<EngineMethod, Counter>,
    pub engine_bytes_received: Family<EngineMethod, Counter>,
    pub host_llm_calls: Family<EngineOperation, Counter>,
    /// Model tokens spent for engines (Host.LlmComplete), by engine and
    /// kind (input, output): what `llmTokensPerEnginePerHour` meters.
    pub host_llm_tokens: Family<EngineTokens, Counter>,
    /// Engine tool calls by outcome (ok, error, timeout, failed,
    /// bad_arguments, cancelled) and their latency. The tool label is a
    /// declared tool's name (64 at most per engine).
    pub engine_tool_calls: Family<EngineToolOutcome, Counter>,
    pub engine_tool_seconds: Family<EngineTool, Histogram>,
    /// Where finished spans go (`gateway.otlp`): telemetry, like the
    /// counters, so it travels with them to every turn and engine call.
    pub spans: Option<ctxgate_runtime::otlp::Exporter>,
}

fn seconds() -> Histogram {
    Histogram::new(exponential_buckets(0.005, 2.0, 16))
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new(StoreCounters::default())
    }
}

impl Metrics {
    /// The gateway's metrics, exporting the store's counters too.
    pub fn new(store: StoreCounters) -> Self {
        let mut r = Registry::with_prefix("ctxgate");
        r.register("store_commits", "Store write transactions committed (one fsync each)", store.commits);
        r.register("store_writes", "Store writes, grouped into those transactions", store.writes);
        let turns = Family::<Outcome, Counter>::default();
        let turns_by_driver = Family::<DriverOutcome, Counter>::default();
        let turn_seconds = seconds();
        let turns_in_flight = Gauge::default();
        let turns_shed = Counter::default();
        let turn_limit = Gauge::default();
        let turn_wait_seconds = Histogram::new(exponential_buckets(0.000_25, 2.0, 16));
        let compactions = Family::<TriggerOutcome, Counter>::default();
        let compaction_seconds = Family::<Trigger, Histogram>::new_with_constructor(seconds as fn() -> Histogram);
        let compaction_tokens_before = Counter::default();
        let compaction_tokens_after = Counter::default();
        r.register("turns", "Turns by outcome", turns.clone());
        r.register("turns_by_driver", "Turns by driver (managed, harness) and outcome", turns_by_driver.clone());
        r.register("turn_duration_seconds", "Managed turn duration", turn_seconds.clone());
        r.register("turns_in_flight", "Turns running now", turns_in_flight.clone());
        r.register("turns_shed", "Turns refused at once over the admission limit", turns_shed.clone());
        r.register("turn_limit", "Turns that may work at once now (adaptive: follows latency)", turn_limit.clone());
        r.register(
            "turn_wait_seconds",
            "How long turns waited to start their work, behind their session or held by admission",
            turn_wait_seconds.clone(),
        );
        r.register("compactions", "Compactions by trigger and outcome", compactions.clone());
        r.register("compaction_duration_seconds", "Compaction duration by trigger", compaction_seconds.clone());
        r.register(
            "compaction_tokens_before",
            "Visible tokens before successful compactions",
            compaction_tokens_before.clone(),
        );
        r.register(
            "compaction_tokens_after",
            "Visible tokens after successful compactions",
            compaction_tokens_after.clone(),
        );
        let engine_calls = Family::<EngineMethod, Counter>::default();
        let engine_failures = Family::<EngineMethodCode, Counter>::default();
        let engine_timeouts = Family::<EngineMethod, Counter>::default();
        let engine_fallbacks = Family::<EngineMethod, Counter>::default();
        let engine_shed = Family::<EngineMethod, Counter>::default();
        let engine_history_gaps = Family::<EngineMethod, Counter>::default();
        let engine_quarantines = Family::<EngineOperation, Counter>::default();
        let engine_call_seconds = Family::<EngineMethod, Histogram>::new_with_constructor(seconds as fn() -> Histogram);
        let engine_replica_in_service = Family::<EngineReplica, Gauge>::default();
        let engine_bytes_sent = Family::<EngineMethod, Counter>::default();
        let engine_bytes_received = Family::<EngineMethod, Counter>::default();
        r.register("engine_calls", "Calls to remote engines", engine_calls.clone());
        r.register("engine_failures", "Failed engine calls by gRPC code", engine_failures.clone());
        r.register("engine_timeouts", "Engine calls past their deadline", engine_timeouts.clone());
        r.register("engine_fallbacks", "Engine calls answered by the legacy engine", engine_fallbacks.clone());
        r.register(
            "engine_shed",
            "Engine calls shed as overload (legacy answered, no quarantine)",
            engine_shed.clone(),
        );
        r.register(
            "engine_history_gaps",
            "DELTA engines that did not hold their cursor (resynced with IngestBatch, no quarantine)",
            engine_history_gaps.clone(),
        );
        r.register("engine_quarantines", "Engines taken out of service, by operation", engine_quarantines.clone());
        r.register(
            "engine_replica_in_service",
            "1 while the replica (one address of the engine) is in service, 0 while it is quarantined",
            engine_replica_in_service.clone(),
        );
        r.register("engine_call_duration_seconds", "Engine call latency", engine_call_seconds.clone());
        r.register("engine_sent_bytes", "Request bytes sent to engines", engine_bytes_sent.clone());
        r.register("engine_received_bytes", "Reply bytes received from engines", engine_bytes_received.clone());
        let host_llm_calls = Family::<EngineOperation, Counter>::default();
        r.register(
            "host_llm_calls",
            "Host model calls made for engines, by purpose (operation label)",
            host_llm_calls.clone(),
        );
        let host_llm_tokens = Family::<EngineTokens, Counter>::default();
        r.register(
            "host_llm_tokens",
            "Model tokens spent for engines through Host.LlmComplete, by kind (input, output)",
            host_llm_tokens.clone(),
        );
        let engine_tool_calls = Family::<EngineToolOutcome, Counter>::default();
        let engine_tool_seconds = Family::<EngineTool, Histogram>::new_with_constructor(seconds as fn() -> Histogram);
        r.register("engine_tool_calls", "Engine tool calls by tool and outcome", engine_tool_calls.clone());
        r.register("engine_tool_duration_seconds", "Engine tool call latency", engine_tool_seconds.clone());
        Self {
            registry: Arc::new(r),
            turns,
            turns_by_driver,
            turn_seconds,
            turns_in_flight,
            turns_shed,
            turn_limit,
            turn_wait_seconds,
            compactions,
            compaction_seconds,
            compaction_tokens_before,
            compaction_tokens_after,
            engine_calls,
            engine_failures,
            engine_timeouts,
            engine_fallbacks,
            engine_shed,
            engine_history_gaps,
            engine_quarantines,
            engine_replica_in_service,
            engine_call_seconds,
            engine_bytes_sent,
            engine_bytes_received,
            host_llm_calls,
            host_llm_tokens,
            engine_tool_calls,
            engine_tool_seconds,
            spans: None,
        }
    }

    /// These metrics, with spans exported to `spans` when given.
    pub fn with_spans(mut self, spans: Option<ctxgate_runtime::otlp::Exporter>) -> Self {
        self.spans = spans;
        self
    }

    pub fn turn_finished(&self, driver: &str, outcome: &str, took: Duration) {
        self.turns.get_or_create(&Outcome { outcome: outcome.into() }).inc();
        self.turns_by_driver.get_or_create(&DriverOutcome { driver: driver.into(), outcome: outcome.into() }).inc();
        self.turn_seconds.observe(took.as_secs_f64());
    }

    /// One engine tool call: its outcome and how long it took.
    pub fn tool_called(&self, engine: &str, tool: &str, outcome: &str, took: Duration) {
        let (engine, tool) = (engine.to_owned(), tool.to_owned());
        let labels = EngineToolOutcome { engine: engine.clone(), tool: tool.clone(), outcome: outcome.into() };
        self.engine_tool_calls.get_or_create(&labels).inc();
        self.engine_tool_seconds.get_or_create(&EngineTool { engine, tool }).observe(took.as_secs_f64());
    }

    pub fn compaction_finished(&self, trigger: &str, outcome: &str, took: Duration, tokens: Option<(u64, u64)>) {
        self.compactions.get_or_create(&TriggerOutcome { trigger: trigger.into(), outcome: outcome.into() }).inc();
        self.compaction_seconds.get_or_create(&Trigger { trigger: trigger.into() }).observe(took.as_secs_f64());
        if let Some((before, after)) = tokens {
            self.compaction_tokens_before.inc_by(before);
            self.compaction_tokens_after.inc_by(after);
        }
    }

    /// One remote engine call: latency, bytes, and its failure code if any.
    pub fn engine_call(
        &self,
        engine: &str,
        method: &str,
        took: Duration,
        sent: usize,
        received: usize,
        failed: Option<tonic::Code>,
    ) {
        let l = EngineMethod { engine: engine.into(), method: method.into() };
        self.engine_calls.get_or_create(&l).inc();
        self.engine_call_seconds.get_or_create(&l).observe(took.as_secs_f64());
        self.engine_bytes_sent.get_or_create(&l).inc_by(sent as u64);
        self.engine_bytes_received.get_or_create(&l).inc_by(received as u64);
        if let Some(code) = failed {
            if code == tonic::Code::DeadlineExceeded {
                self.engine_timeouts.get_or_create(&l).inc();
            }
            let c = EngineMethodCode { engine: engine.into(), method: method.into(), code: format!("{code:?}") };
            self.engine_failures.get_or_create(&c).inc();
        }
    }

    /// Tokens one Host.LlmComplete spent for `engine`.
    pub fn host_llm_tokens(&self, engine: &str, input: u64, output: u64) {
        for (kind, n) in [("input", input), ("output", output)] {
            self.host_llm_tokens.get_or_create(&EngineTokens { engine: engine.into(), kind }).inc_by(n);
        }
    }

    /// Counts a host model call by purpose. The label takes only OpenClaw's
    /// purpose strings (anything else is "other"): an engine chooses the
    /// purpose, and a label must not let it grow the metric without bound.
    pub fn host_llm_call(&self, engine: &str, purpose: &str) {
        let known = matches!(
            purpose,
            "context-engine.compaction"
                | "context-engine.overflow-compaction"
                | "context-engine.timeout-compaction"
                | "context-engine.after-turn"
        ) || purpose
            .strip_prefix("context-engine.")
            .and_then(|p| p.strip_suffix(".maintenance"))
            .is_some_and(|reason| matches!(reason, "bootstrap" | "turn" | "compaction"));
        let operation = if known { purpose } else { "other" };
        self.host_llm_calls
            .get_or_create(&EngineOperation { engine: engine.into(), operation: operation.into() })
            .inc();
    }

    pub fn engine_fallback(&self, engine: &str, method: &str) {
        self.engine_fallbacks.get_or_create(&EngineMethod { engine: engine.into(), method: method.into() }).inc();
    }

    pub fn engine_shed(&self, engine: &str, method: &str) {
        self.engine_shed.get_or_create(&EngineMethod { engine: engine.into(), method: method.into() }).inc();
    }

    pub fn engine_history_gap(&self, engine: &str, method: &str) {
        self.engine_history_gaps.get_or_create(&EngineMethod { engine: engine.into(), method: method.into() }).inc();
    }

    pub fn engine_quarantined(&self, engine: &str, operation: &str) {
        self.engine_quarantines
            .get_or_create(&EngineOperation { engine: engine.into(), operation: operation.into() })
            .inc();
    }

    pub fn replica_in_service(&self, engine: &str, replica: &str, up: bool) {
        let labels = EngineReplica { engine: engine.into(), replica: replica.into() };
        self.engine_replica_in_service.get_or_create(&labels).set(i64::from(up));
    }

    /// A replica left the engine's set: its series goes with it.
    pub fn replica_gone(&self, engine: &str, replica: &str) {
        self.engine_replica_in_service.remove(&EngineReplica { engine: engine.into(), replica: replica.into() });
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// How long one metrics connection may last in all: a scrape is one
/// request and its answer.
const CONNECTION_TIME: Duration = Duration::from_secs(30);

/// Serves `GET /metrics` until `shutdown` resolves, each connection
/// admitted under `limits` (pending until its first byte), its request
/// header read within `limits.handshake_timeout`, one request per
/// connection, [`CONNECTION_TIME`] in all.
pub async fn serve(
    metrics: Metrics,
    listener: tokio::net::TcpListener,
    limits: ctxgate_runtime::accept::Limits,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use tokio_stream::StreamExt;
    let incoming = ctxgate_runtime::accept::plain_any(tonic::transport::server::TcpIncoming::from(listener), limits);
    tokio::pin!(incoming, shutdown);
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let conn = tokio::select! {
            c = incoming.next() => c,
            () = &mut shutdown => break,
        };
        let Some(conn) = conn else { break };
        let conn = conn?;
        let m = metrics.clone();
        let answer = hyper::service::service_fn(move |req| {
            let response = respond(&m, &req);
            async move { Ok::<_, std::convert::Infallible>(response) }
        });
        let http = hyper::server::conn::http1::Builder::new()
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(limits.handshake_timeout)
            .keep_alive(false)
            .serve_connection(hyper_util::rt::TokioIo::new(conn), answer);
        connections.spawn(async move {
            let _ = tokio::time::timeout(CONNECTION_TIME, http).await;
        });
        while connections.try_join_next().is_some() {}
    }
    connections.shutdown().await;
    Ok(())
}

fn respond<B>(metrics: &Metrics, req: &hyper::Request<B>) -> hyper::Response<String> {
    let (status, body) = match (req.method(), req.uri().path()) {
        (&hyper::Method::GET, "/metrics") => (hyper::StatusCode::OK, metrics.render()),
        // hyper sends a HEAD answer's headers only.
        (&hyper::Method::HEAD, "/metrics") => (hyper::StatusCode::OK, String::new()),
        (_, "/metrics") => (hyper::StatusCode::METHOD_NOT_ALLOWED, String::new()),
        _ => (hyper::StatusCode::NOT_FOUND, String::new()),
    };
    let mut response = hyper::Response::new(body);
    *response.status_mut() = status;
    if status == hyper::StatusCode::OK {
        response
            .headers_mut()
            .insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static("text/plain; version=0.0.4"));
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_engines_purpose_labels_only_known_values() {
        let m = Metrics::default();
        m.host_llm_call("window", "context-engine.compaction");
        m.host_llm_call("window", "context-engine.turn.maintenance");
        for i in 0..100 {
            m.host_llm_call("window", &format!("made-up-{i}"));
        }
        let text = m.render();
        assert!(text.contains("operation=\"context-engine.compaction\"} 1"), "{text}");
        assert!(text.contains("operation=\"context-engine.turn.maintenance\"} 1"), "{text}");
        assert!(text.contains("operation=\"other\"} 100"), "{text}");
        assert!(!text.contains("made-up"), "{text}");
    }
}
