//! Context engines as the gateway sees them: one [`Engine`] trait, speaking
//! the contract's own types, implemented by the in-process [`Legacy`]
//! engine, the raw gRPC [`remote::Remote`] client, and the
//! [`guarded::Guarded`] wrapper that adds quarantine and legacy fallback,
//! and [`replicas::Replicas`], one configured engine as a set of guarded
//! replicas.

pub mod guarded;
pub mod health;
pub(crate) mod legacy;
pub mod registry;
pub mod remote;
pub mod replicas;

use std::sync::Arc;

use async_trait::async_trait;
use ctxgate_proto::{Method, pb};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

pub use legacy::{LEGACY_ID, Legacy, sanitise};

/// What every engine call carries from its caller.
#[derive(Debug, Clone, Default)]
pub struct Call {
    /// Fires when the caller aborts: the call is dropped (RST_STREAM).
    pub cancel: CancellationToken,
    /// The caller's own deadline; the method's timeout is cut to it.
    pub deadline: Option<Instant>,
    /// The trace the call continues (sent as `traceparent`).
    pub trace: Option<ctxgate_proto::trace::TraceParent>,
    /// The caller has somewhere else to ask (another replica): a failure
    /// is returned, not answered by legacy.
    pub surface_failures: bool,
}

impl Call {
    pub fn new(cancel: CancellationToken) -> Self {
        Self { cancel, deadline: None, trace: None, surface_failures: false }
    }

    /// This call, with failures returned rather than answered by legacy.
    pub fn surfacing_failures(&self) -> Self {
        Self { surface_failures: true, ..self.clone() }
    }

    pub fn traced(mut self, trace: Option<ctxgate_proto::trace::TraceParent>) -> Self {
        self.trace = trace;
        self
    }

    pub fn with_deadline(mut self, deadline: Instant) -> Self {
        self.deadline = Some(deadline);
        self
    }
}

/// Why an engine call failed, as the turn core needs to know it.
#[derive(Debug, Clone, thiserror::Error)]
pub enum EngineCallError {
    /// The caller aborted: never the engine's fault, never quarantines.
    #[error("the engine call was cancelled")]
    Cancelled,
    /// The engine does not implement this optional method: not a failure.
    #[error("the engine does not implement {0}")]
    Unimplemented(Method),
    #[error("the engine did not answer {method} within {after:?}")]
    DeadlineExceeded { method: Method, after: std::time::Duration },
    /// The engine answered something the contract forbids.
    #[error("the engine broke the contract in {method}: {detail}")]
    ContractViolation { method: Method, detail: String },
    /// The engine (or the way to it) failed.
    #[error("{method} failed: {code:?}: {detail}")]
    Failed { method: Method, code: tonic::Code, detail: String },
    /// The engine is quarantined and the method has no legacy fallback.
    #[error("the engine is quarantined")]
    Quarantined,
    /// The engine answered a queued call (CommitTurn, ForgetSession) with
    /// an error status that is about that call, not a broken engine (any
    /// code but UNAVAILABLE, UNKNOWN, CANCELLED and DEADLINE_EXCEEDED): the
    /// row waits with backoff and blocks only its session. Never quarantines.
    /// A DELTA engine does not hold its cursor (state lost, another
    /// replica): the caller resyncs it and repeats. Never quarantines.
    #[error("the engine reported a history gap in {method}")]
    HistoryGap { method: Method, held: Option<pb::HistoryCursor> },
    #[error("the engine refused {method}: {code:?}: {detail}")]
    Refused { method: Method, code: tonic::Code, detail: String },
    /// Overload, not breakage: over the gateway's cap on the engine's calls
    /// in flight, or the engine answered RESOURCE_EXHAUSTED (or UNAVAILABLE
    /// with a retry pushback). Legacy answers; never quarantines.
    #[error("{method} shed: {detail}")]
    Overloaded { method: Method, detail: String },
}

impl EngineCallError {
    /// The gRPC code the failure counts as (metrics, status).
    pub fn code(&self) -> tonic::Code {
        match self {
            Self::Cancelled => tonic::Code::Cancelled,
            Self::Unimplemented(_) => tonic::Code::Unimplemented,
            Self::DeadlineExceeded { .. } => tonic::Code::DeadlineExceeded,
            Self::ContractViolation { .. } => tonic::Code::Internal,
            Self::Failed { code, .. } | Self::Refused { code, .. } => *code,
            Self::Quarantined => tonic::Code::Unavailable,
            Self::HistoryGap { .. } => tonic::Code::FailedPrecondition,
            Self::Overloaded { .. } => tonic::Code::ResourceExhausted,
        }
    }
}

/// How an engine answered Compact. Built once per compaction: not worth a box.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum CompactReply {
    Done(pb::CompactResult),
    /// Run the gateway's built-in compaction (OpenClaw `delegateCompactionToRuntime`).
    DelegateToHost(pb::DelegateToHost),
}

/// Receives an engine's compaction progress as it streams.
pub type ProgressFn<'a> = dyn Fn(pb::CompactProgress) + Send + Sync + 'a;

type R<T> = Result<T, EngineCallError>;

#[async_trait]
pub trait Engine: Send + Sync + 'static {
    /// The engine's info (legacy's while a remote engine is quarantined).
    fn info(&self) -> Arc<pb::EngineInfo>;
    async fn bootstrap(&self, req: pb::BootstrapRequest, call: &Call) -> R<pb::BootstrapResult>;
    async fn ingest(&self, req: pb::IngestRequest, call: &Call) -> R<pb::IngestResult>;
    /// A DELTA engine's resync. Never answered by a fallback: the caller
    /// must know whether the engine holds the history.
    async fn ingest_batch(&self, req: pb::IngestBatchRequest, call: &Call) -> R<pb::IngestBatchResult>;
    async fn assemble(&self, req: pb::AssembleRequest, call: &Call) -> R<pb::AssembleResult>;
    async fn compact(&self, req: pb::CompactRequest, call: &Call, progress: &ProgressFn<'_>) -> R<CompactReply>;
    async fn after_turn(&self, req: pb::AfterTurnRequest, call: &Call) -> R<pb::AfterTurnResult>;
    /// A durable turn's commit. Never answered by a fallback: a commit the
    /// engine did not accept stays queued.
    async fn commit_turn(&self, req: pb::CommitTurnRequest, call: &Call) -> R<pb::CommitTurnResult>;
    async fn maintain(&self, req: pb::MaintainRequest, call: &Call) -> R<pb::MaintainResult>;
    async fn prepare_subagent_spawn(
        &self,
        req: pb::PrepareSubagentSpawnRequest,
        call: &Call,
    ) -> R<pb::PrepareSubagentSpawnResult>;
    async fn rollback_subagent_spawn(
        &self,
        req: pb::RollbackSubagentSpawnRequest,
        call: &Call,
    ) -> R<pb::RollbackSubagentSpawnResult>;
    async fn on_subagent_ended(&self, req: pb::OnSubagentEndedRequest, call: &Call) -> R<pb::OnSubagentEndedResult>;
    /// The session was deleted. Queued like a commit: never answered by a
    /// fallback, retried until the engine takes it.
    async fn forget_session(&self, req: pb::ForgetSessionRequest, call: &Call) -> R<pb::ForgetSessionResult>;
    /// One of the engine's tools. Never answered by a fallback and never a
    /// quarantine: whatever goes wrong becomes an error result the model
    /// reads (the caller words it).
    async fn call_tool(&self, req: pb::CallToolRequest, call: &Call) -> R<pb::CallToolResult>;
}

/// Whether turns on this engine go through the durable outbox: it declares
/// both transcript semantics and implements CommitTurn (OpenClaw's
/// `supportsContextEngineDurableTurnAdvancement` plus the fence).
pub fn durable(info: &pb::EngineInfo) -> bool {
    let sem = info.transcript_semantics.unwrap_or_default();
    sem.current_turn_fence == pb::CurrentTurnFence::BeforeCurrentTurnEntryV1 as i32
        && sem.turn_advancement_idempotency == pb::TurnAdvancementIdempotency::AtomicIdempotentV1 as i32
        && Method::CommitTurn.listed_in(&info.implemented_methods)
}

/// Whether Assemble carries only what follows the engine's cursor.
pub fn delta(info: &pb::EngineInfo) -> bool {
    info.history_delivery == pb::HistoryDelivery::Delta as i32
}
