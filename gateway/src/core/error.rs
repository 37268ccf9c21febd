//! The core's one error type, which the API adapters map to statuses.

use crate::core::admission;
use crate::core::session_locks::BusyError;
use crate::store::StoreError;

/// Errors the API maps to statuses (before a turn is admitted, for a
/// harness step, and for every non-turn call).
#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    #[error("{field}: {problem}")]
    Invalid { field: String, problem: String },
    #[error("{field}: {problem}")]
    TooLarge { field: String, problem: String },
    #[error("no session with key {0:?}")]
    NoSession(String),
    #[error("compaction timed out: {0}")]
    CompactionTimeout(String),
    #[error("compaction failed: {0}")]
    CompactionFailed(String),
    #[error("aborted")]
    Aborted,
    #[error("no engine {0:?} is configured")]
    NoEngine(String),
    #[error("{0}")]
    Precondition(String),
    #[error("{0}")]
    EngineFailed(String),
    #[error(transparent)]
    Busy(#[from] BusyError),
    /// Over the admission limit (`core::admission`): shed at once.
    #[error("{0}")]
    Overloaded(admission::Shed),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// A fresh error id (16 hex digits): a client gets it with an error whose
/// detail stays in the log, and the log line carries it.
pub fn new_error_id() -> String {
    // From the OS's generator (a system call each, ~2 % of a flooded
    // gateway's samples): ids must not be guessed (docs/security.md).
    let mut id = uuid::Uuid::new_v4().simple().to_string();
    id.truncate(16);
    id
}

impl CoreError {
    /// The error as a client may read it inside a turn's events: a store's
    /// internals are logged under an error id, and the client gets a
    /// sentence with that id.
    pub fn for_client(&self) -> String {
        let hidden = match self {
            Self::Store(StoreError::Backend(d) | StoreError::Unavailable(d) | StoreError::Full(d)) => d,
            other => return other.to_string(),
        };
        let id = new_error_id();
        tracing::error!(error_id = %id, detail = %crate::peer_text::capped(hidden, 2_000), "store failure");
        format!("the gateway's store failed (error id {id}; the gateway log has the detail)")
    }

    pub fn invalid(field: impl Into<String>, problem: impl Into<String>) -> Self {
        Self::Invalid { field: field.into(), problem: problem.into() }
    }

    pub fn too_large(field: impl Into<String>, problem: impl Into<String>) -> Self {
        Self::TooLarge { field: field.into(), problem: problem.into() }
    }

    /// The same error with its field under `parent` (`parent.field`).
    pub fn under(self, parent: &str) -> Self {
        match self {
            Self::Invalid { field, problem } => Self::Invalid { field: format!("{parent}.{field}"), problem },
            Self::TooLarge { field, problem } => Self::TooLarge { field: format!("{parent}.{field}"), problem },
            other => other,
        }
    }
}

impl From<ctxgate_proto::validate::Violation> for CoreError {
    fn from(v: ctxgate_proto::validate::Violation) -> Self {
        match v.kind {
            ctxgate_proto::validate::ViolationKind::Invalid => Self::Invalid { field: v.field, problem: v.problem },
            ctxgate_proto::validate::ViolationKind::TooLarge => Self::TooLarge { field: v.field, problem: v.problem },
        }
    }
}
