//! The engine-side error and its one mapping to a gRPC status.

use ctxgate_proto::Method;
use ctxgate_proto::validate::Violation;
use tonic::{Code, Status};

/// What an engine method can fail with. Each variant maps to the status code
/// docs/contract.md prescribes; internal detail is logged, never sent.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A request field is malformed or over a limit.
    #[error(transparent)]
    Invalid(#[from] Violation),
    /// The request is well-formed but the engine's state does not allow it.
    #[error("{0}")]
    FailedPrecondition(String),
    /// Something the request names does not exist.
    #[error("{0}")]
    NotFound(String),
    /// The optional method is not implemented.
    #[error("{0} is not implemented by this engine")]
    Unimplemented(Method),
    /// The host does not offer a callback (e.g. no model for summaries):
    /// the engine does the work itself, or answers as an unimplemented
    /// method would.
    #[error("the host does not offer {0}")]
    HostUnimplemented(&'static str),
    /// The call was cancelled by the caller.
    #[error("the call was cancelled")]
    Cancelled,
    /// The call's deadline passed.
    #[error("the call's deadline passed")]
    DeadlineExceeded,
    /// A DELTA engine does not hold the request's cursor: FAILED_PRECONDITION
    /// with the typed HistoryGap detail (the gateway resyncs, never
    /// quarantines). `held` says what the engine does hold, if it knows.
    #[error("history gap")]
    HistoryGap { held: Option<ctxgate_proto::pb::HistoryCursor> },
    /// A host callback (ReadTranscript, LlmComplete) failed.
    #[error("host callback {operation} failed: {status}")]
    Host { operation: &'static str, status: Status },
    /// Something a peer sent went over a limit (RESOURCE_EXHAUSTED).
    #[error("{0}")]
    OverLimit(String),
    /// The grant does not allow a host callback.
    #[error("the grant does not allow {0}")]
    NotGranted(&'static str),
    /// A bug or an I/O failure inside the engine.
    #[error("internal error: {0}")]
    Internal(String),
}

impl EngineError {
    /// Wraps any error as an internal failure.
    pub fn internal(err: impl std::fmt::Display) -> Self {
        Self::Internal(err.to_string())
    }
}

impl From<EngineError> for Status {
    fn from(err: EngineError) -> Self {
        match err {
            EngineError::Invalid(v) => v.into(),
            EngineError::FailedPrecondition(m) => Status::failed_precondition(m),
            EngineError::HistoryGap { held } => ctxgate_proto::history::gap_status(held),
            EngineError::NotFound(m) => Status::not_found(m),
            EngineError::Unimplemented(m) => Status::unimplemented(format!("{m} is not implemented")),
            EngineError::HostUnimplemented(op) => Status::unimplemented(format!("{op} is not implemented")),
            EngineError::Cancelled => Status::cancelled("the call was cancelled"),
            EngineError::DeadlineExceeded => Status::deadline_exceeded("the call's deadline passed"),
            EngineError::OverLimit(m) => Status::resource_exhausted(m),
            EngineError::NotGranted(op) => Status::failed_precondition(format!("the grant does not allow {op}")),
            EngineError::Host { operation, status } => {
                let code = match status.code() {
                    Code::DeadlineExceeded => Code::DeadlineExceeded,
                    Code::Cancelled if status.message() == "Timeout expired" => Code::DeadlineExceeded,
                    Code::Cancelled => Code::Cancelled,
                    _ => Code::Unavailable,
                };
                Status::new(code, format!("host callback {operation} failed ({})", status.code()))
            }
            EngineError::Internal(detail) => {
                tracing::error!(%detail, "engine internal error");
                Status::internal("internal engine error")
            }
        }
    }
}
