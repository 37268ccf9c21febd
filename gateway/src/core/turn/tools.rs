//! The engine's tools in a turn: which ones are offered (the engine's
//! declared tools for this session's audience; none while it is
//! quarantined, since legacy serves then), and running one for a tool call
//! the model made in this turn. Whatever goes wrong with the tool — bad
//! arguments, an error status, its deadline — becomes an error result the
//! model reads: never a failed turn, never a quarantine.

use std::time::Instant;

use ctxgate_proto::limits::MAX_TOOL_RESULT_BYTES;
use ctxgate_proto::pb::{self, AgentMessage, Role, content_part::Part};

use super::{StepError, Turn};
use crate::core::engine_lease::EngineLease;
use crate::core::types::{Failure, ToolAnswer};
use crate::core::{CoreError, now_unix_ms};
use crate::engines::EngineCallError;

/// The tools `lease`'s engine offers in a main or a subagent session.
pub(crate) fn offered(lease: &EngineLease, subagent: bool) -> Vec<pb::ToolDefinition> {
    if !lease.remote {
        return Vec::new();
    }
    let for_here = |t: &&pb::ToolDefinition| match pb::ToolAudience::try_from(t.audience) {
        Ok(pb::ToolAudience::All) => true,
        Ok(pb::ToolAudience::Subagent) => subagent,
        Ok(pb::ToolAudience::Main) | Err(_) => !subagent,
    };
    lease.info.tools.iter().filter(for_here).cloned().collect()
}

/// How a tool call ended, for the model and the metrics.
enum Answered {
    Result {
        text: String,
        is_error: bool,
    },
    /// No result: the failure, worded for the model.
    Failed {
        text: String,
        outcome: &'static str,
    },
}

impl Turn {
    /// The engine's tools offered in this turn.
    pub fn engine_tools(&self) -> &[pb::ToolDefinition] {
        &self.engine_tools
    }

    /// Whether `name` is one of the engine's tools offered in this turn.
    pub fn is_engine_tool(&self, name: &str) -> bool {
        self.engine_tools.iter().any(|t| t.name == name)
    }

    /// Runs the engine tool that tool call `tool_call_id` of this turn
    /// calls (the model's assistant message with the call is appended
    /// already), appends its result as that call's answer — durable when
    /// this returns — and gives it back. Refused, storing nothing: an id
    /// that is not a tool call of this turn, one already answered, or a
    /// call of a tool that is not the engine's.
    pub async fn call_tool(&mut self, tool_call_id: &str, field: &str) -> Result<ToolAnswer, StepError> {
        let Some((made, answered)) = self.ledger.tool_call(tool_call_id) else {
            return Err(CoreError::invalid(field, format!("{tool_call_id:?} is not a tool call of this turn")).into());
        };
        if answered {
            return Err(CoreError::Precondition(format!("tool call {tool_call_id:?} already has a result")).into());
        }
        let (name, arguments) = (made.name.clone(), made.arguments_json.clone());
        if !self.is_engine_tool(&name) {
            return Err(CoreError::Precondition(format!(
                "tool call {tool_call_id:?} calls {name:?}, which is not a tool of context engine {:?}: the harness runs its own tools",
                self.lease.key
            ))
            .into());
        }
        let started = Instant::now();
        let answered = self.run_tool(tool_call_id, &name, arguments).await;
        let (text, is_error, outcome) = match answered {
            Answered::Result { text, is_error } => (text, is_error, if is_error { "error" } else { "ok" }),
            Answered::Failed { outcome: "cancelled", .. } => {
                self.services.metrics.tool_called(&self.lease.key, &name, "cancelled", started.elapsed());
                return Err(StepError::Failed(Failure::aborted()));
            }
            Answered::Failed { text, outcome } => (text, true, outcome),
        };
        self.services.metrics.tool_called(&self.lease.key, &name, outcome, started.elapsed());
        self.answer(tool_call_id, &name, text, is_error, field).await
    }

    /// Appends a tool result for `tool_call_id` (an engine tool's, or the
    /// gateway's own error for a call it could not run) and gives it back.
    pub async fn answer(
        &mut self,
        tool_call_id: &str,
        name: &str,
        text: String,
        is_error: bool,
        field: &str,
    ) -> Result<ToolAnswer, StepError> {
        let text = capped(text);
        let message = AgentMessage {
            role: Role::Tool as i32,
            content: vec![pb::ContentPart {
                part: Some(Part::ToolResult(pb::ToolResult {
                    tool_call_id: tool_call_id.into(),
                    tool_name: name.into(),
                    text: text.clone(),
                    is_error,
                })),
            }],
            created_at_unix_ms: now_unix_ms(),
            ..Default::default()
        };
        let ids = self.append(vec![message.clone()], field).await?;
        let entry_id = ids.into_iter().next().unwrap_or_default();
        let message = AgentMessage { id: entry_id.clone(), ..message };
        Ok(ToolAnswer { tool_call_id: tool_call_id.into(), name: name.into(), is_error, text, message, entry_id })
    }

    /// The engine's answer to one tool call, or why there is none.
    async fn run_tool(&self, tool_call_id: &str, name: &str, arguments_json: String) -> Answered {
        // Arguments a model wrote that are not JSON never reach the engine.
        if let Err(e) = serde_json::from_str::<serde_json::Value>(&arguments_json) {
            return Answered::Failed {
                text: format!("The arguments of {name} are not JSON ({e}); call it again with a JSON object."),
                outcome: "bad_arguments",
            };
        }
        let (services, lease, session) = (&self.services, &self.lease, &self.session);
        let grant = services.engines.grant(lease, session, None, None);
        let budget = self.budget(0);
        let req = pb::CallToolRequest {
            session_id: session.session_id.clone(),
            session_key: Some(session.session_key.clone()),
            agent_id: Some(session.agent_id.clone()),
            tool_call_id: tool_call_id.into(),
            name: name.into(),
            arguments_json,
            subagent: self.subagent,
            runtime_context: Some(lease.runtime_context(session, budget, 0)),
            host: grant.as_ref().map(|g| g.access.clone()),
        };
        let engine = &lease.key;
        match lease.engine.call_tool(req, &self.call).await {
            Ok(r) => {
                let text = r
                    .content
                    .into_iter()
                    .filter_map(|p| match p.part {
                        Some(Part::Text(t)) => Some(t),
                        _ => None,
                    })
                    .collect::<Vec<_>>()
                    .join("\n");
                Answered::Result { text, is_error: r.is_error }
            }
            Err(EngineCallError::Cancelled) => Answered::Failed { text: String::new(), outcome: "cancelled" },
            Err(EngineCallError::DeadlineExceeded { after, .. }) => Answered::Failed {
                text: format!("The tool {name} of context engine {engine:?} did not answer within {after:?}."),
                outcome: "timeout",
            },
            Err(EngineCallError::Quarantined) => Answered::Failed {
                text: format!("Context engine {engine:?} is out of service; its tool {name} cannot run now."),
                outcome: "failed",
            },
            Err(e) => Answered::Failed { text: format!("The tool {name} failed: {e}."), outcome: "failed" },
        }
    }
}

/// At most [`MAX_TOOL_RESULT_BYTES`] of a tool's text, cut at a character
/// boundary, saying so when it cut.
fn capped(mut text: String) -> String {
    if text.len() <= MAX_TOOL_RESULT_BYTES {
        return text;
    }
    let total = text.len();
    let mut cut = MAX_TOOL_RESULT_BYTES - 200;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    text.truncate(cut);
    text.push_str(&format!(
        "\n[… cut by ctxgate: the tool's result was {total} bytes, the limit is {} KiB]",
        MAX_TOOL_RESULT_BYTES >> 10
    ));
    text
}

#[cfg(test)]
mod tests {
    use super::capped;
    use ctxgate_proto::limits::MAX_TOOL_RESULT_BYTES;

    #[test]
    fn a_long_result_is_cut_at_a_character_and_says_so() {
        assert_eq!(capped("short".into()), "short");
        let long = "é".repeat(MAX_TOOL_RESULT_BYTES);
        let cut = capped(long);
        assert!(cut.len() <= MAX_TOOL_RESULT_BYTES, "{}", cut.len());
        assert!(cut.ends_with("the limit is 256 KiB]"), "{}", &cut[cut.len() - 80..]);
    }
}
