//! The core-owned legacy engine: ingest is a no-op, assemble passes the
//! visible history through (sanitised, validated, limited), compaction is
//! the gateway's built-in one, after-turn is a no-op. Its results are also
//! what a quarantined engine's calls get (OpenClaw's fallback results).

use std::sync::Arc;

use async_trait::async_trait;
use ctxgate_proto::pb;
use ctxgate_proto::{Method, estimate, validate};

use super::{Call, CompactReply, Engine, EngineCallError, ProgressFn};
use crate::transcript::Messages;

/// The core-owned fallback engine: ingest is a no-op, assemble passes the
/// visible history through (sanitised, validated, limited), compaction is
/// the gateway's built-in one, after-turn is a no-op.
pub struct Legacy {
    info: Arc<pb::EngineInfo>,
}

pub const LEGACY_ID: &str = ctxgate_proto::LEGACY_ENGINE_ID;

impl Default for Legacy {
    fn default() -> Self {
        Self {
            info: Arc::new(pb::EngineInfo {
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
            }),
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

/// Legacy's assembly: the history sanitised, its last `MAX_MESSAGES`,
/// validated. A history that needs no sanitising is not copied: a turn on
/// legacy hands the store's shared tail to the model request.
pub fn assemble(messages: Messages) -> Result<Messages, EngineCallError> {
    let clean = match &messages {
        Messages::Shared(shared) => shared.is_clean(),
        Messages::Owned(list) => {
            list.iter().all(|m| !m.content.is_empty()) && validate::first_orphan_result(list).is_none()
        }
    };
    let mut messages = if clean { messages } else { Messages::Owned(sanitise(messages.into_vec())) };
    messages.skip_first(messages.len().saturating_sub(ctxgate_proto::limits::MAX_MESSAGES));
    let checked = match &messages {
        // The store's own history was validated message by message as it
        // was stored, and its ids are entry ids, unique on a branch (a
        // rewrite's copies replace their originals): checking it again on
        // every turn was a third of a long session's turn. Only the
        // summary, which the gateway renders, is checked; debug builds (the
        // tests) still check the whole invariant.
        Messages::Shared(shared) => shared
            .summary()
            .map_or(Ok(()), |s| validate::message(s, "messages[0]"))
            .inspect(|_| debug_assert_eq!(validate::message_list(messages.len(), messages.iter(), "messages"), Ok(()))),
        Messages::Owned(list) => validate::messages(list, "messages"),
    };
    checked.map_err(|v| EngineCallError::ContractViolation { method: Method::Assemble, detail: v.to_string() })?;
    Ok(messages)
}

const DOWNGRADED: &str = "context engine downgraded to legacy";

#[async_trait]
impl Engine for Legacy {
    fn info(&self) -> Arc<pb::EngineInfo> {
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
        let messages = assemble(req.messages.into())?.into_vec();
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
        Ok(pb::AfterTurnResult::default())
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use ctxgate_proto::pb::{self, content_part::Part, transcript_entry::Entry};

    use super::assemble;
    use crate::transcript::{Messages, SharedHistory};

    fn entry(id: &str, part: Part) -> pb::TranscriptEntry {
        let content = vec![pb::ContentPart { part: Some(part) }];
        let m = pb::AgentMessage { id: id.into(), role: pb::Role::User as i32, content, ..Default::default() };
        pb::TranscriptEntry { id: id.into(), entry: Some(Entry::Message(m)), ..Default::default() }
    }

    /// A clean history is passed through shared (no copy); one that needs
    /// sanitising (a result whose call is not before it) is copied and
    /// sanitised, as the owned path always was.
    #[test]
    fn a_clean_history_stays_shared_and_a_broken_one_is_sanitised() {
        let hello = entry("a", Part::Text("hello".into()));
        let shared = |b: Vec<pb::TranscriptEntry>| Messages::Shared(SharedHistory::new(Arc::new(b.into())));
        let clean = assemble(shared(vec![hello.clone()])).unwrap();
        assert!(matches!(clean, Messages::Shared(_)) && clean.len() == 1);
        let orphan = pb::ToolResult { tool_call_id: "call-1".into(), text: "42".into(), ..Default::default() };
        let broken = assemble(shared(vec![entry("r", Part::ToolResult(orphan)), hello])).unwrap();
        assert!(matches!(broken, Messages::Owned(_)));
        assert_eq!(broken.iter().map(|m| m.id.as_str()).collect::<Vec<_>>(), ["a"], "the orphan's message is dropped");
    }

    /// A history handed in (not the store's) is still checked whole.
    #[test]
    fn a_history_handed_in_is_validated_whole() {
        let message = |e: pb::TranscriptEntry| match e.entry {
            Some(Entry::Message(m)) => m,
            _ => unreachable!(),
        };
        let hello = message(entry("a", Part::Text("hello".into())));
        let twice = assemble(Messages::Owned(vec![hello.clone(), hello])).unwrap_err();
        assert!(twice.to_string().contains("messages[1].id"), "{twice}");
    }
}
