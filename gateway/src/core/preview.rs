//! What a session's engine would assemble now (`ctxgate sessions context`):
//! the engine a managed turn would lease, asked to Assemble the session's
//! history within a managed turn's budget — without changing anything: no
//! turn is admitted, no lock is taken, nothing is stored, and a DELTA
//! engine's cursor is used but never resynced or moved.

use ctxgate_proto::estimate;
use ctxgate_proto::pb::{self, AgentMessage};

use crate::core::engine_lease::Unmet;
use crate::core::types::{HostProfile, Operation};
use crate::core::{Core, CoreError, session_ref};
use crate::engines::{Call, delta};
use crate::store::Delta;

/// An assembled context as the model would see it.
#[derive(Debug, Clone)]
pub struct Preview {
    pub engine_id: String,
    pub messages: Vec<PreviewMessage>,
    pub system_prompt_addition: Option<String>,
    pub estimated_tokens: u64,
    pub token_budget: u64,
    pub engine_tools: Vec<pb::ToolDefinition>,
}

#[derive(Debug, Clone)]
pub struct PreviewMessage {
    pub message: AgentMessage,
    /// A compaction summary (the gateway's, or an engine's marked with
    /// metadata `ctxgate.kind = "summary"`), not a raw message.
    pub summary: bool,
    pub tokens: u64,
}

/// Whether an assembled message is a summary rather than a raw message.
pub fn is_summary(m: &AgentMessage) -> bool {
    matches!(m.metadata.get("ctxgate.kind").map(String::as_str), Some("summary" | "compaction-summary"))
}

impl Core {
    pub async fn preview_context(&self, agent: &str, key: &str) -> Result<Preview, CoreError> {
        let (agent, key) = session_ref(agent, key)?;
        let session = self.store.session(&agent, &key, false).await?.ok_or(CoreError::NoSession(key))?;
        let lease =
            self.engines.lease(Operation::AgentRun, &HostProfile::embedded(), self.provider_model(), Unmet::Degrade)?;
        let m = &lease.model;
        let budget = m.context_window.saturating_sub(m.reserve_tokens);
        // A DELTA engine holding its cursor is asked as a turn would ask it;
        // otherwise (or without a cursor) it gets the whole visible history.
        let mut cursor = None;
        let mut messages = None;
        if lease.remote
            && delta(&lease.info)
            && let Some((c, after)) = self.store.delta(&session.session_id, &lease.key).await?.and_then(Delta::messages)
        {
            messages = Some(after);
            cursor = Some(c);
        }
        let messages = match messages {
            Some(m) => m,
            None => self.visible_messages(&session).await?,
        };
        let tokens = cursor.as_ref().map_or(0, |c| c.tokens) + estimate::messages_tokens(&messages);
        let grant = self.engines.grant(&lease, &session, None, None);
        let request = pb::AssembleRequest {
            session_id: session.session_id.clone(),
            session_key: Some(session.session_key.clone()),
            messages,
            token_budget: Some(budget),
            model: Some(lease.model.id.clone()),
            runtime_settings: Some(lease.runtime_settings(budget, None)),
            runtime_context: Some(lease.runtime_context(&session, budget, tokens)),
            host: grant.as_ref().map(|g| g.access.clone()),
            cursor,
            ..Default::default()
        };
        let assembled = lease.engine.assemble(request, &Call::new(self.call_token())).await.map_err(|e| {
            let id = &lease.key;
            CoreError::EngineFailed(format!("The context engine \"{id}\" could not assemble the preview: {e}."))
        })?;
        let addition = assembled.system_prompt_addition.filter(|a| !a.trim().is_empty());
        let messages: Vec<PreviewMessage> = assembled
            .messages
            .into_iter()
            .map(|m| PreviewMessage { summary: is_summary(&m), tokens: estimate::message_tokens(&m), message: m })
            .collect();
        let estimated_tokens = messages
            .iter()
            .map(|m| m.tokens)
            .fold(addition.as_deref().map_or(0, estimate::text_tokens), u64::saturating_add);
        let subagent = self.store.is_subagent(&session.agent_id, &session.session_key).await?;
        Ok(Preview {
            engine_id: lease.key.clone(),
            messages,
            system_prompt_addition: addition,
            estimated_tokens,
            token_budget: budget,
            engine_tools: crate::core::turn::offered_tools(&lease, subagent),
        })
    }
}
