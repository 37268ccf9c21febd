//! The gateway's side of the engine boundary: one trait that the in-process
//! legacy engine implements today and the remote (gRPC) engine client will
//! implement next, speaking the contract's own types.

use async_trait::async_trait;
use ctxgate_proto::pb;
use ctxgate_proto::{estimate, validate};

/// Why an engine call failed, as the turn core needs to know it.
#[derive(Debug, thiserror::Error)]
pub enum EngineCallError {
    /// The caller aborted: never the engine's fault.
    #[error("the engine call was cancelled")]
    Cancelled,
    #[error("the engine did not answer in time")]
    DeadlineExceeded,
    /// The engine answered something the contract forbids.
    #[error("the engine broke the contract: {0}")]
    ContractViolation(String),
    #[error("the engine failed: {0}")]
    Failed(String),
}

/// How an engine answered Compact. Built once per compaction: not worth a box.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum CompactReply {
    Done(pb::CompactResult),
    /// Run the gateway's built-in compaction (OpenClaw `delegateCompactionToRuntime`).
    DelegateToHost(pb::DelegateToHost),
}

#[async_trait]
pub trait Engine: Send + Sync + 'static {
    fn info(&self) -> &pb::EngineInfo;
    async fn ingest(&self, req: pb::IngestRequest) -> Result<pb::IngestResult, EngineCallError>;
    async fn assemble(&self, req: pb::AssembleRequest) -> Result<pb::AssembleResult, EngineCallError>;
    async fn compact(&self, req: pb::CompactRequest) -> Result<CompactReply, EngineCallError>;
    async fn after_turn(&self, req: pb::AfterTurnRequest) -> Result<(), EngineCallError>;
}

/// The core-owned fallback engine: ingest is a no-op, assemble passes the
/// visible history through (sanitised, validated, limited), compaction is
/// the gateway's built-in one, after-turn is a no-op.
pub struct Legacy {
    info: pb::EngineInfo,
}

pub const LEGACY_ID: &str = "legacy";

impl Default for Legacy {
    fn default() -> Self {
        Self {
            info: pb::EngineInfo {
                id: LEGACY_ID.into(),
                name: "Legacy Context Engine".into(),
                version: "1.0.0".into(),
                contract_version: ctxgate_proto::CONTRACT_VERSION.into(),
                implemented_methods: ["GetInfo", "Ingest", "Assemble", "Compact", "AfterTurn"]
                    .map(String::from)
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

#[async_trait]
impl Engine for Legacy {
    fn info(&self) -> &pb::EngineInfo {
        &self.info
    }

    async fn ingest(&self, _req: pb::IngestRequest) -> Result<pb::IngestResult, EngineCallError> {
        Ok(pb::IngestResult { ingested: false })
    }

    async fn assemble(&self, req: pb::AssembleRequest) -> Result<pb::AssembleResult, EngineCallError> {
        let mut messages = sanitise(req.messages);
        let over = messages.len().saturating_sub(ctxgate_proto::limits::MAX_MESSAGES);
        messages.drain(..over);
        validate::messages(&messages, "messages").map_err(|v| EngineCallError::ContractViolation(v.to_string()))?;
        Ok(pb::AssembleResult {
            estimated_tokens: estimate::messages_tokens(&messages),
            messages,
            prompt_authority: pb::PromptAuthority::Assembled as i32,
            ..Default::default()
        })
    }

    async fn compact(&self, _req: pb::CompactRequest) -> Result<CompactReply, EngineCallError> {
        Ok(CompactReply::DelegateToHost(pb::DelegateToHost {
            reason: Some("legacy engine".into()),
            custom_instructions: None,
        }))
    }

    async fn after_turn(&self, _req: pb::AfterTurnRequest) -> Result<(), EngineCallError> {
        Ok(())
    }
}
