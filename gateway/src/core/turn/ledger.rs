//! What a turn has added so far: its own entries (admitted and appended),
//! their encoded size, and its tool calls with the results that answered
//! them. It checks what a caller adds against the turn's rules before
//! anything is stored, and records it once stored.

use std::collections::{HashMap, HashSet};

use ctxgate_proto::limits;
use ctxgate_proto::pb::{self, AgentMessage, Role, content_part::Part};

use crate::core::CoreError;

/// A turn's messages in all: its CommitTurn (16 MiB at most, with anchors
/// and host params) must fit.
const MAX_TURN_BYTES: usize = 12 << 20;

/// Bounds on a client message's free-form metadata.
const MAX_METADATA_ENTRIES: usize = 64;
const MAX_METADATA_BYTES: usize = 16 * 1024;

#[derive(Debug, Default)]
pub(super) struct Ledger {
    /// Entry ids of the turn's own messages (admitted and appended).
    own: HashSet<String>,
    /// Their encoded size: a turn must fit one CommitTurn.
    bytes: usize,
    /// Tool calls appended in this turn (by id), and those a result answered.
    tool_calls: HashMap<String, ToolCallMade>,
    answered: HashSet<String>,
}

/// A tool call the model made in this turn: what it called, with what.
#[derive(Debug, Clone)]
pub(super) struct ToolCallMade {
    pub name: String,
    pub arguments_json: String,
}

/// What a checked list of messages adds once it is stored.
#[derive(Debug, Default)]
pub(super) struct Additions {
    calls: HashMap<String, ToolCallMade>,
    answers: HashSet<String>,
    bytes: usize,
}

impl Ledger {
    /// The ledger of a turn whose user messages were admitted as `entries`.
    pub(super) fn admitted(entries: &[pb::TranscriptEntry]) -> Self {
        Self {
            own: entries.iter().map(|e| e.id.clone()).collect(),
            bytes: entries.iter().map(prost::Message::encoded_len).sum(),
            ..Self::default()
        }
    }

    /// A rewrite copied one of the turn's entries: both ids name it (a copy
    /// keeps the old entry id as its message id).
    pub(super) fn copied(&mut self, new_id: String) {
        self.own.insert(new_id);
    }

    /// Checks messages to append: the turn's size limits, then the rules of
    /// [`Ledger::check`].
    pub(super) fn check_append(&self, messages: &[AgentMessage], field: &str) -> Result<Additions, CoreError> {
        if messages.is_empty() {
            return Err(CoreError::invalid(field, "is required"));
        }
        if self.own.len() + messages.len() > limits::MAX_MESSAGES {
            return Err(CoreError::too_large(field, format!("a turn holds at most {} messages", limits::MAX_MESSAGES)));
        }
        let bytes: usize = messages.iter().map(prost::Message::encoded_len).sum();
        if self.bytes + bytes > MAX_TURN_BYTES {
            return Err(CoreError::too_large(
                field,
                format!(
                    "a turn's messages are limited to {} MiB in all (its CommitTurn must fit one gRPC message)",
                    MAX_TURN_BYTES >> 20
                ),
            ));
        }
        Ok(Additions { bytes, ..self.check(messages, field)? })
    }

    /// Checks messages a caller adds to this turn (or shows after its
    /// history, unstored): assistant or tool roles, well formed and within
    /// the size limits, tool call ids new to the turn, every tool result
    /// answering a call of this turn (earlier, or before it in `list`) that
    /// no result answered yet.
    pub(super) fn check(&self, list: &[AgentMessage], field: &str) -> Result<Additions, CoreError> {
        if list.len() > limits::MAX_MESSAGES {
            return Err(CoreError::too_large(
                field,
                format!("has {} messages, the limit is {}", list.len(), limits::MAX_MESSAGES),
            ));
        }
        let mut add = Additions::default();
        for (i, m) in list.iter().enumerate() {
            let at = format!("{field}[{i}]");
            let role = Role::try_from(m.role).unwrap_or(Role::Unspecified);
            if !matches!(role, Role::Assistant | Role::Tool) {
                return Err(CoreError::invalid(format!("{at}.role"), "must be ROLE_ASSISTANT or ROLE_TOOL"));
            }
            if m.content.is_empty() {
                return Err(CoreError::invalid(format!("{at}.content"), "is empty"));
            }
            check_client_message(m, &at)?;
            for (j, p) in m.content.iter().enumerate() {
                let part = format!("{at}.content[{j}]");
                match &p.part {
                    Some(Part::ToolCall(c)) => {
                        if role != Role::Assistant {
                            return Err(CoreError::invalid(
                                format!("{part}.tool_call"),
                                "only assistant messages call tools",
                            ));
                        }
                        let made = ToolCallMade { name: c.name.clone(), arguments_json: c.arguments_json.clone() };
                        if self.tool_calls.contains_key(&c.id) || add.calls.insert(c.id.clone(), made).is_some() {
                            return Err(CoreError::invalid(
                                format!("{part}.tool_call.id"),
                                format!("{:?} is already a tool call of this turn", c.id),
                            ));
                        }
                    }
                    Some(Part::ToolResult(r)) => {
                        let id = &r.tool_call_id;
                        if !self.tool_calls.contains_key(id) && !add.calls.contains_key(id) {
                            return Err(CoreError::invalid(
                                format!("{part}.tool_result.tool_call_id"),
                                format!("{id:?} is not a tool call of this turn"),
                            ));
                        }
                        if self.answered.contains(id) || !add.answers.insert(id.clone()) {
                            return Err(CoreError::invalid(
                                format!("{part}.tool_result.tool_call_id"),
                                format!("tool call {id:?} already has a result"),
                            ));
                        }
                    }
                    Some(_) if role == Role::Tool => {
                        return Err(CoreError::invalid(part, "a tool message carries tool results only"));
                    }
                    _ => {}
                }
            }
        }
        Ok(add)
    }

    /// Records what was checked and then stored as `stored`.
    pub(super) fn record(&mut self, add: Additions, stored: &[pb::TranscriptEntry]) {
        self.tool_calls.extend(add.calls);
        self.answered.extend(add.answers);
        self.own.extend(stored.iter().map(|e| e.id.clone()));
        self.bytes += add.bytes;
    }

    /// A tool call of this turn that no result answered yet.
    pub(super) fn unanswered(&self) -> Option<&str> {
        self.tool_calls.keys().find(|c| !self.answered.contains(*c)).map(String::as_str)
    }

    /// Tool call `id` of this turn, and whether a result answered it.
    pub(super) fn tool_call(&self, id: &str) -> Option<(&ToolCallMade, bool)> {
        self.tool_calls.get(id).map(|c| (c, self.answered.contains(id)))
    }

    /// Where the turn's own messages start in `history`: its first message
    /// still visible (a compaction mid-turn may have summarised the first
    /// ones), else the end.
    pub(super) fn position_in(&self, history: &[AgentMessage]) -> usize {
        history.iter().position(|m| self.is_own(m)).unwrap_or(history.len())
    }

    pub(super) fn is_own(&self, m: &AgentMessage) -> bool {
        self.own.contains(&m.id)
    }
}

/// A message a client adds (user or turn message): well formed, within the
/// content limit, metadata bounded. Ids are the gateway's (entry ids), so
/// the rest is checked with a stand-in id.
pub fn check_client_message(m: &AgentMessage, at: &str) -> Result<(), CoreError> {
    let probe = AgentMessage { id: "m".into(), ..m.clone() };
    ctxgate_proto::validate::message(&probe, at)?;
    let meta: usize = m.metadata.iter().map(|(k, v)| k.len() + v.len()).sum();
    if m.metadata.len() > MAX_METADATA_ENTRIES || meta > MAX_METADATA_BYTES {
        return Err(CoreError::too_large(
            format!("{at}.metadata"),
            format!("is limited to {MAX_METADATA_ENTRIES} entries and {MAX_METADATA_BYTES} bytes"),
        ));
    }
    Ok(())
}
