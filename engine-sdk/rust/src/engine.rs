//! The trait an engine implements.

use std::future::Future;

use tokio::sync::mpsc;
use tonic::Status;

use crate::pb;
use crate::{CallContext, EngineError};
use ctxgate_proto::Method;

type Out<T> = Result<T, EngineError>;

/// How a Compact call ends.
// Returned once per Compact call: boxing the result would cost every engine
// author a `Box::new` to save a few hundred bytes once.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum CompactOutcome {
    /// The engine compacted (or decided not to); sent as `CompactEvent.result`.
    Done(pb::CompactResult),
    /// The gateway should run its built-in compaction
    /// (OpenClaw `delegateCompactionToRuntime`).
    DelegateToHost(pb::DelegateToHost),
}

/// Sends `CompactProgress` events to the caller while Compact runs.
#[derive(Clone, Debug)]
pub struct Progress {
    tx: mpsc::Sender<Result<pb::CompactEvent, Status>>,
}

impl Progress {
    pub(crate) fn new(tx: mpsc::Sender<Result<pb::CompactEvent, Status>>) -> Self {
        Self { tx }
    }

    /// Reports progress. Waits while the caller is slow to read (the stream
    /// is bounded); `Err(Cancelled)` once the caller has gone away.
    pub async fn report(&self, stage: &str, done: u64, total: u64, message: impl Into<String>) -> Out<()> {
        let event = pb::CompactEvent {
            event: Some(pb::compact_event::Event::Progress(pb::CompactProgress {
                stage: stage.to_owned(),
                done,
                total,
                message: message.into(),
            })),
        };
        self.tx.send(Ok(event)).await.map_err(|_| EngineError::Cancelled)
    }
}

/// A context engine. `get_info`, `ingest`, `assemble` and `compact` are
/// required; every other method defaults to UNIMPLEMENTED, which the gateway
/// reads as "not implemented". List the methods you implement in
/// `EngineInfo.implemented_methods`.
///
/// Requests reach these methods already validated against the contract
/// (ids present, roles known, sizes within limits). Methods run in their own
/// task; when the caller cancels or the deadline passes the future is
/// dropped and `ctx.cancellation()` fires.
pub trait ContextEngine: Send + Sync + 'static {
    fn get_info(&self, ctx: &CallContext) -> impl Future<Output = Out<pb::EngineInfo>> + Send;

    fn ingest(&self, ctx: &CallContext, req: pb::IngestRequest) -> impl Future<Output = Out<pb::IngestResult>> + Send;

    fn assemble(
        &self,
        ctx: &CallContext,
        req: pb::AssembleRequest,
    ) -> impl Future<Output = Out<pb::AssembleResult>> + Send;

    fn compact(
        &self,
        ctx: &CallContext,
        req: pb::CompactRequest,
        progress: Progress,
    ) -> impl Future<Output = Out<CompactOutcome>> + Send;

    fn bootstrap(
        &self,
        _ctx: &CallContext,
        _req: pb::BootstrapRequest,
    ) -> impl Future<Output = Out<pb::BootstrapResult>> + Send {
        async { Err(EngineError::Unimplemented(Method::Bootstrap)) }
    }

    fn ingest_batch(
        &self,
        _ctx: &CallContext,
        _req: pb::IngestBatchRequest,
    ) -> impl Future<Output = Out<pb::IngestBatchResult>> + Send {
        async { Err(EngineError::Unimplemented(Method::IngestBatch)) }
    }

    fn after_turn(
        &self,
        _ctx: &CallContext,
        _req: pb::AfterTurnRequest,
    ) -> impl Future<Output = Out<pb::AfterTurnResult>> + Send {
        async { Err(EngineError::Unimplemented(Method::AfterTurn)) }
    }

    fn commit_turn(
        &self,
        _ctx: &CallContext,
        _req: pb::CommitTurnRequest,
    ) -> impl Future<Output = Out<pb::CommitTurnResult>> + Send {
        async { Err(EngineError::Unimplemented(Method::CommitTurn)) }
    }

    fn maintain(
        &self,
        _ctx: &CallContext,
        _req: pb::MaintainRequest,
    ) -> impl Future<Output = Out<pb::MaintainResult>> + Send {
        async { Err(EngineError::Unimplemented(Method::Maintain)) }
    }

    fn prepare_subagent_spawn(
        &self,
        _ctx: &CallContext,
        _req: pb::PrepareSubagentSpawnRequest,
    ) -> impl Future<Output = Out<pb::PrepareSubagentSpawnResult>> + Send {
        async { Err(EngineError::Unimplemented(Method::PrepareSubagentSpawn)) }
    }

    fn rollback_subagent_spawn(
        &self,
        _ctx: &CallContext,
        _req: pb::RollbackSubagentSpawnRequest,
    ) -> impl Future<Output = Out<pb::RollbackSubagentSpawnResult>> + Send {
        async { Err(EngineError::Unimplemented(Method::RollbackSubagentSpawn)) }
    }

    fn on_subagent_ended(
        &self,
        _ctx: &CallContext,
        _req: pb::OnSubagentEndedRequest,
    ) -> impl Future<Output = Out<pb::OnSubagentEndedResult>> + Send {
        async { Err(EngineError::Unimplemented(Method::OnSubagentEnded)) }
    }

    fn dispose(&self, _ctx: &CallContext) -> impl Future<Output = Out<pb::DisposeResult>> + Send {
        async { Err(EngineError::Unimplemented(Method::Dispose)) }
    }

    /// The session was deleted: drop everything held for it before
    /// answering. Idempotent (an unknown session is OK).
    fn forget_session(
        &self,
        _ctx: &CallContext,
        _req: pb::ForgetSessionRequest,
    ) -> impl Future<Output = Out<pb::ForgetSessionResult>> + Send {
        async { Err(EngineError::Unimplemented(Method::ForgetSession)) }
    }

    /// The tools the engine offers the model. The server adds them to
    /// GetInfo's `tools` (and `CallTool` to its implemented methods) when
    /// `get_info` declares none itself.
    fn tools(&self) -> Vec<pb::ToolDefinition> {
        Vec::new()
    }

    /// Runs one of [`ContextEngine::tools`] for a model's tool call. A tool
    /// that cannot help — unknown, bad arguments, nothing found — answers
    /// an error *result* ([`tool_error`]), which the model reads; an `Err`
    /// reaches the model as an error result too, worded by the gateway.
    fn call_tool(
        &self,
        _ctx: &CallContext,
        _req: pb::CallToolRequest,
    ) -> impl Future<Output = Out<pb::CallToolResult>> + Send {
        async { Err(EngineError::Unimplemented(Method::CallTool)) }
    }
}

/// A tool's result: `text` for the model.
pub fn tool_text(text: impl Into<String>) -> pb::CallToolResult {
    pb::CallToolResult { content: vec![text_part(text.into())], is_error: false }
}

/// A tool's failure, for the model: why it could not help.
pub fn tool_error(text: impl Into<String>) -> pb::CallToolResult {
    pb::CallToolResult { content: vec![text_part(text.into())], is_error: true }
}

fn text_part(text: String) -> pb::ContentPart {
    pb::ContentPart { part: Some(pb::content_part::Part::Text(text)) }
}

/// A tool declaration: its name, what it does, its arguments' JSON Schema.
pub fn tool(name: &str, description: &str, parameters_json_schema: &str) -> pb::ToolDefinition {
    pb::ToolDefinition {
        name: name.into(),
        description: description.into(),
        parameters_json_schema: parameters_json_schema.into(),
        audience: pb::ToolAudience::Main as i32,
    }
}
