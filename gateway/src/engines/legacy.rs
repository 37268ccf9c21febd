//! The core-owned legacy engine: ingest is a no-op, assemble passes the
//! visible history through (sanitised, validated, limited), compaction is
//! the gateway's built-in one, after-turn is a no-op. Its results are also
//! what a quarantined engine's calls get (OpenClaw's fallback results).

use async_trait::async_trait;
use ctxgate_proto::pb;
use ctxgate_proto::{Method, estimate, validate};

use super::{Call, CompactReply, Engine, EngineCallError, ProgressFn};

/// The core-owned fallback engine: ingest is a no-op, assemble passes the
/// visible history through (sanitised, validated, limited), compaction is
/// the gateway's built-in one, after-turn is a no-op.
pub struct Legacy {
    info: pb::EngineInfo,
}

pub const LEGACY_ID: &str = ctxgate_proto::LEGACY_ENGINE_ID;

impl Default for Legacy {
    fn default() -> Self {
        Self {
            info: pb::EngineInfo {
                id: LEGACY_ID.into(),
                name: "Legacy Context Engine".into(),
                version: "1.0.0".into(),
                contract_version: ctxgate_proto::CONTRACT_VERSION.into(),
                implemented_methods: [
                    Method::GetInfo,
                    Method::Ingest,
                    Method::Assemble,
                    Method::Compact,
                    Method::AfterTurn,
                ]
                .map(|m| m.name().to_owned())
                .to_vec(),
                ..Default::default()
            },
        }
    }
}

/// Drops tool results whose call is not before them: a provider rejects a
/// history that starts mid-pair.
pub fn sanitise(messages: Vec<pb::AgentMessage>) -> Vec<pb::AgentMessage> {
    use pb::content_part::Part;
    let mut calls = std::collections::HashSet::new();
    let mut out = Vec::with_capacity(messages.len());
    for mut m in messages {
        m.content.retain(|p| match &p.part {
            Some(Part::ToolCall(c)) => {
                calls.insert(c.id.clone());
                true
            }
            Some(Part::ToolResult(r)) => calls.contains(&r.tool_call_id),
            _ => true,
        });
        if !m.content.is_empty() {
            out.push(m);
        }
    }
    out
}

const DOWNGRADED: &str = "context engine downgraded to legacy";

#[async_trait]
impl Engine for Legacy {
    fn info(&self) -> pb::EngineInfo {
        self.info.clone()
    }

    async fn bootstrap(
        &self,
        _req: pb::BootstrapRequest,
        _call: &Call,
    ) -> Result<pb::BootstrapResult, EngineCallError> {
        Ok(pb::BootstrapResult { bootstrapped: false, imported_messages: None, reason: Some(DOWNGRADED.into()) })
    }

    async fn ingest(&self, _req: pb::IngestRequest, _call: &Call) -> Result<pb::IngestResult, EngineCallError> {
        Ok(pb::IngestResult { ingested: false })
    }

    async fn ingest_batch(
        &self,
        _req: pb::IngestBatchRequest,
        _call: &Call,
    ) -> Result<pb::IngestBatchResult, EngineCallError> {
        Ok(pb::IngestBatchResult { ingested_count: 0 })
    }

    async fn assemble(&self, req: pb::AssembleRequest, _call: &Call) -> Result<pb::AssembleResult, EngineCallError> {
        let mut messages = sanitise(req.messages);
        let over = messages.len().saturating_sub(ctxgate_proto::limits::MAX_MESSAGES);
        messages.drain(..over);
        validate::messages(&messages, "messages")
            .map_err(|v| EngineCallError::ContractViolation { method: Method::Assemble, detail: v.to_string() })?;
        Ok(pb::AssembleResult {
            estimated_tokens: estimate::messages_tokens(&messages),
            messages,
            prompt_authority: pb::PromptAuthority::Assembled as i32,
            ..Default::default()
        })
    }

    async fn compact(
        &self,
        _req: pb::CompactRequest,
        _call: &Call,
        _progress: &ProgressFn<'_>,
    ) -> Result<CompactReply, EngineCallError> {
        Ok(CompactReply::DelegateToHost(pb::DelegateToHost {
            reason: Some("legacy engine".into()),
            custom_instructions: None,
        }))
    }

    async fn after_turn(
        &self,
        _req: pb::AfterTurnRequest,
        _call: &Call,
    ) -> Result<pb::AfterTurnResult, EngineCallError> {
        Ok(pb::AfterTurnResult {})
    }

    async fn commit_turn(
        &self,
        _req: pb::CommitTurnRequest,
        _call: &Call,
    ) -> Result<pb::CommitTurnResult, EngineCallError> {
        Err(EngineCallError::Unimplemented(Method::CommitTurn))
    }

    async fn maintain(&self, _req: pb::MaintainRequest, _call: &Call) -> Result<pb::MaintainResult, EngineCallError> {
        Ok(pb::MaintainResult { reason: Some(DOWNGRADED.into()), ..Default::default() })
    }

    async fn prepare_subagent_spawn(
        &self,
        _req: pb::PrepareSubagentSpawnRequest,
        _call: &Call,
    ) -> Result<pb::PrepareSubagentSpawnResult, EngineCallError> {
        Ok(pb::PrepareSubagentSpawnResult { prepared: false, rollback_token: None })
    }

    async fn rollback_subagent_spawn(
        &self,
        _req: pb::RollbackSubagentSpawnRequest,
        _call: &Call,
    ) -> Result<pb::RollbackSubagentSpawnResult, EngineCallError> {
        Ok(pb::RollbackSubagentSpawnResult {})
    }

    async fn on_subagent_ended(
        &self,
        _req: pb::OnSubagentEndedRequest,
        _call: &Call,
    ) -> Result<pb::OnSubagentEndedResult, EngineCallError> {
        Ok(pb::OnSubagentEndedResult {})
    }

    async fn forget_session(
        &self,
        _req: pb::ForgetSessionRequest,
        _call: &Call,
    ) -> Result<pb::ForgetSessionResult, EngineCallError> {
        Ok(pb::ForgetSessionResult {})
    }

    /// Legacy offers no tools.
    async fn call_tool(&self, _req: pb::CallToolRequest, _call: &Call) -> Result<pb::CallToolResult, EngineCallError> {
        Err(EngineCallError::Unimplemented(Method::CallTool))
    }
}
