//! A turn's place in its trace: the `tracing` span every engine call and
//! model request of the turn nests in, and the span exported over OTLP
//! when the turn ends (`gateway.otlp`), a child of the client's.

use std::time::{Instant, SystemTime};

use ctxgate_proto::trace::TraceParent;
use ctxgate_runtime::otlp;

use crate::core::types::{Driver, Outcome};
use crate::metrics::Metrics;

pub(super) struct TurnTrace {
    /// The turn's own span in the client's trace (a new trace when the
    /// client sent none): every engine call continues it.
    pub(super) this: TraceParent,
    /// The client's span, parent of the turn's in its exported span.
    client_span: Option<[u8; 8]>,
    started_at: SystemTime,
    pub(super) started: Instant,
    pub(super) span: tracing::Span,
}

/// What the exported span says of the turn.
pub(super) struct Attributes<'a> {
    pub driver: Driver,
    pub session_id: &'a str,
    pub agent_id: &'a str,
    pub session_key: &'a str,
    pub turn_id: &'a str,
    pub engine: &'a str,
}

impl TurnTrace {
    /// Starts the turn's span under the client's `traceparent`, if it sent one.
    pub(super) fn start(client: Option<TraceParent>) -> Self {
        let this = client.map_or_else(TraceParent::root, |t| t.child());
        Self {
            this,
            client_span: client.map(|t| t.parent_id),
            started_at: SystemTime::now(),
            started: Instant::now(),
            span: tracing::Span::none(),
        }
    }

    /// Opens the `tracing` span once the turn is admitted (its duration
    /// counts from here).
    pub(super) fn open(&mut self, a: &Attributes<'_>) {
        self.started = Instant::now();
        self.span = tracing::info_span!("turn", driver = a.driver.as_str(), agent = %a.agent_id,
            session = %a.session_id, key = %a.session_key, trace_id = %self.this.trace_id_hex());
    }

    /// Exports the turn's span, when spans are exported; `label` is the
    /// outcome's metric label ("error" when the turn could not be accepted).
    pub(super) fn export(&self, metrics: &Metrics, a: &Attributes<'_>, label: &str, outcome: &Outcome) {
        let Some(spans) = &metrics.spans else { return };
        let error = match outcome {
            Outcome::Failed(f) => Some(f.message.clone()),
            _ if label == "error" => Some("the turn could not be accepted".into()),
            _ => None,
        };
        spans.record(otlp::Span {
            name: format!("ctxgate.turn/{}", a.driver.as_str()),
            kind: otlp::Kind::Server,
            this: self.this,
            parent: self.client_span,
            start: self.started_at,
            end: SystemTime::now(),
            attributes: vec![
                ("ctxgate.session_id", a.session_id.to_owned()),
                ("ctxgate.agent_id", a.agent_id.to_owned()),
                ("ctxgate.turn_id", a.turn_id.to_owned()),
                ("ctxgate.engine", a.engine.to_owned()),
                ("ctxgate.outcome", label.to_owned()),
            ],
            error,
        });
    }
}
