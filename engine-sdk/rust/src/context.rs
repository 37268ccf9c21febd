//! The per-call context an engine method receives.

use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::{EngineError, HostClient};

/// What the server knows about one call: its deadline (from `grpc-timeout`),
/// a token that fires when the caller cancels or the deadline passes, and
/// the host callback client built from the call's grant, if it has one.
#[derive(Clone, Debug)]
pub struct CallContext {
    pub(crate) deadline: Option<Instant>,
    pub(crate) cancel: CancellationToken,
    pub(crate) host: Option<HostClient>,
    /// The caller's W3C trace context (`traceparent`), when it sent one.
    pub(crate) trace: Option<ctxgate_proto::trace::TraceParent>,
    /// This method's own span in that trace (what it sends on).
    pub(crate) span: Option<ctxgate_proto::trace::TraceParent>,
}

impl CallContext {
    /// A context with no deadline, no host and a fresh token (tests).
    pub fn detached() -> Self {
        Self { deadline: None, cancel: CancellationToken::new(), host: None, trace: None, span: None }
    }

    /// When the caller stops waiting, if it said.
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// Time left before the deadline (`None`: no deadline).
    pub fn remaining(&self) -> Option<Duration> {
        self.deadline.map(|d| d.saturating_duration_since(Instant::now()))
    }

    /// Fires when the caller cancels or the deadline passes. Hand it to any
    /// work you spawn so it stops with the call.
    pub fn cancellation(&self) -> &CancellationToken {
        &self.cancel
    }

    /// `Err(Cancelled)` once the call is cancelled: a cheap check for loops.
    pub fn check(&self) -> Result<(), EngineError> {
        if self.cancel.is_cancelled() {
            return Err(match self.remaining() {
                Some(d) if d.is_zero() => EngineError::DeadlineExceeded,
                _ => EngineError::Cancelled,
            });
        }
        Ok(())
    }

    /// The trace this call belongs to (the gateway's turn), as the caller
    /// sent it: its `parent_id` is the gateway's span for this call.
    pub fn trace(&self) -> Option<&ctxgate_proto::trace::TraceParent> {
        self.trace.as_ref()
    }

    /// This method's own span in that trace (the one `--otlp-endpoint`
    /// exports): the parent to send on in calls it makes. Host callbacks
    /// send it.
    pub fn span(&self) -> Option<&ctxgate_proto::trace::TraceParent> {
        self.span.as_ref()
    }

    /// The host callback client, when the call carried a grant.
    pub fn host(&self) -> Option<&HostClient> {
        self.host.as_ref()
    }
}
