//! Validation of contract messages, shared by every side: the SDK checks
//! requests before an engine sees them, the gateway and the conformance kit
//! check what engines answer. A [`Violation`] names the offending field path
//! and maps to INVALID_ARGUMENT or RESOURCE_EXHAUSTED in one place.

use std::collections::HashSet;
use std::fmt;

use crate::Method;
use crate::limits::{
    MAX_ID_BYTES, MAX_MESSAGE_CONTENT_BYTES, MAX_MESSAGES, MAX_METADATA_ENTRIES, MAX_METADATA_KEY_BYTES,
    MAX_METADATA_VALUE_BYTES, MAX_TOOL_ARGUMENTS_BYTES, MAX_TOOL_DESCRIPTION_BYTES, MAX_TOOL_NAME_BYTES,
    MAX_TOOL_SCHEMA_BYTES, MAX_TOOLS,
};
use crate::pb::{self, AgentMessage, Role, content_part::Part};

/// Why a contract message is not acceptable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// Field path, e.g. `messages[3].content[0].tool_result.tool_call_id`.
    pub field: String,
    pub kind: ViolationKind,
    /// What is wrong, in words, without the field path.
    pub problem: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ViolationKind {
    /// Malformed: INVALID_ARGUMENT.
    Invalid,
    /// Over a size limit: RESOURCE_EXHAUSTED.
    TooLarge,
}

impl Violation {
    pub fn invalid(field: impl Into<String>, problem: impl Into<String>) -> Self {
        Self { field: field.into(), kind: ViolationKind::Invalid, problem: problem.into() }
    }

    pub fn too_large(field: impl Into<String>, problem: impl Into<String>) -> Self {
        Self { field: field.into(), kind: ViolationKind::TooLarge, problem: problem.into() }
    }
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.problem)
    }
}

impl std::error::Error for Violation {}

impl From<Violation> for tonic::Status {
    fn from(v: Violation) -> Self {
        match v.kind {
            ViolationKind::Invalid => tonic::Status::invalid_argument(v.to_string()),
            ViolationKind::TooLarge => tonic::Status::resource_exhausted(v.to_string()),
        }
    }
}

pub type Result<T = ()> = std::result::Result<T, Violation>;

/// A required id: non-blank and at most [`MAX_ID_BYTES`].
pub fn id(value: &str, field: &str) -> Result {
    if value.trim().is_empty() {
        return Err(Violation::invalid(field, "is required"));
    }
    if value.len() > MAX_ID_BYTES {
        return Err(Violation::too_large(field, format!("is {} bytes, the limit is {MAX_ID_BYTES}", value.len())));
    }
    Ok(())
}

/// The summed size of a message's content parts, in bytes.
pub fn content_bytes(message: &AgentMessage) -> usize {
    message
        .content
        .iter()
        .filter_map(|p| p.part.as_ref())
        .map(|part| match part {
            Part::Text(t) => t.len(),
            Part::Thinking(t) => t.text.len() + t.signature.len(),
            Part::Image(i) => i.uri.len() + i.mime_type.len(),
            Part::ToolCall(c) => c.id.len() + c.name.len() + c.arguments_json.len(),
            Part::ToolResult(r) => r.tool_call_id.len() + r.tool_name.len() + r.text.len(),
        })
        .sum()
}

impl Violation {
    /// The same violation at `field` (replacing the path).
    fn at(mut self, field: String) -> Self {
        self.field = field;
        self
    }

    /// The same violation under `parent` (`parent.field`).
    fn under(self, parent: &str) -> Self {
        let field = format!("{parent}.{}", self.field);
        self.at(field)
    }
}

/// The checks of one message with paths relative to it. Nothing is
/// allocated unless something is wrong: this runs on every message of every
/// request and reply.
/// A message's usage: counts a model could report, a cost that is a number.
fn usage(u: &crate::pb::Usage) -> Result {
    let counts = [
        ("input_tokens", u.input_tokens),
        ("output_tokens", u.output_tokens),
        ("cache_read_tokens", u.cache_read_tokens),
        ("cache_write_tokens", u.cache_write_tokens),
        ("total_tokens", u.total_tokens),
    ];
    for (name, n) in counts {
        if let Some(n) = n.filter(|n| *n > crate::limits::MAX_USAGE_TOKENS) {
            return Err(Violation::invalid(
                format!("usage.{name}"),
                format!("{n} is over {} tokens", crate::limits::MAX_USAGE_TOKENS),
            ));
        }
    }
    if u.cost_usd.is_some_and(|c| !c.is_finite() || c < 0.0) {
        return Err(Violation::invalid("usage.cost_usd", "must be a finite, non-negative number"));
    }
    Ok(())
}

fn check_message(m: &AgentMessage) -> Result {
    id(&m.id, "id")?;
    match Role::try_from(m.role) {
        Ok(Role::Unspecified) => return Err(Violation::invalid("role", "is required")),
        Err(_) => return Err(Violation::invalid("role", format!("unknown role {}", m.role))),
        Ok(_) => {}
    }
    for (i, p) in m.content.iter().enumerate() {
        let at = |rest: &str| format!("content[{i}]{rest}");
        match &p.part {
            None => return Err(Violation::invalid(at(""), "has no part set")),
            Some(Part::ToolCall(c)) => {
                id(&c.id, "").map_err(|v| v.at(at(".tool_call.id")))?;
                if c.name.trim().is_empty() {
                    return Err(Violation::invalid(at(".tool_call.name"), "is required"));
                }
            }
            Some(Part::ToolResult(r)) => id(&r.tool_call_id, "").map_err(|v| v.at(at(".tool_result.tool_call_id")))?,
            Some(_) => {}
        }
    }
    if m.metadata.len() > MAX_METADATA_ENTRIES {
        return Err(Violation::too_large(
            "metadata",
            format!("has {} entries, the limit is {MAX_METADATA_ENTRIES}", m.metadata.len()),
        ));
    }
    if let Some((k, v)) =
        m.metadata.iter().find(|(k, v)| k.len() > MAX_METADATA_KEY_BYTES || v.len() > MAX_METADATA_VALUE_BYTES)
    {
        let what = if k.len() > MAX_METADATA_KEY_BYTES {
            format!("has a {}-byte key, the limit is {MAX_METADATA_KEY_BYTES}", k.len())
        } else {
            format!("[{k:.64}] is {} bytes, the limit is {MAX_METADATA_VALUE_BYTES}", v.len())
        };
        return Err(Violation::too_large("metadata", what));
    }
    if let Some(u) = &m.usage {
        usage(u)?;
    }
    let size = content_bytes(m);
    if size > MAX_MESSAGE_CONTENT_BYTES {
        return Err(Violation::too_large(
            "content",
            format!("is {size} bytes, the limit is {MAX_MESSAGE_CONTENT_BYTES}"),
        ));
    }
    Ok(())
}

/// One well-formed message: id, known role, parts set, tool ids present,
/// content within [`MAX_MESSAGE_CONTENT_BYTES`].
pub fn message(m: &AgentMessage, field: &str) -> Result {
    check_message(m).map_err(|v| v.under(field))
}

/// A list of well-formed messages with unique ids, at most [`MAX_MESSAGES`].
pub fn messages(list: &[AgentMessage], field: &str) -> Result {
    message_list(list.len(), list, field)
}

/// [`messages`] over `len` messages read in place (not a slice).
pub fn message_list<'a>(len: usize, list: impl IntoIterator<Item = &'a AgentMessage>, field: &str) -> Result {
    if len > MAX_MESSAGES {
        return Err(Violation::too_large(field, format!("has {len} messages, the limit is {MAX_MESSAGES}")));
    }
    let mut seen = HashSet::with_capacity(len);
    for (i, m) in list.into_iter().enumerate() {
        check_message(m).map_err(|v| v.under(&format!("{field}[{i}]")))?;
        if !seen.insert(m.id.as_str()) {
            return Err(Violation::invalid(format!("{field}[{i}].id"), format!("duplicates message id {:?}", m.id)));
        }
    }
    Ok(())
}

/// The first tool result in `list` (message index, part index) whose tool
/// call does not precede it in `list`.
pub fn first_orphan_result<'a>(list: impl IntoIterator<Item = &'a AgentMessage>) -> Option<(usize, usize)> {
    let mut calls = HashSet::new();
    for (i, m) in list.into_iter().enumerate() {
        for (j, p) in m.content.iter().enumerate() {
            match &p.part {
                Some(Part::ToolCall(c)) => {
                    calls.insert(c.id.as_str());
                }
                Some(Part::ToolResult(r)) if !calls.contains(r.tool_call_id.as_str()) => return Some((i, j)),
                _ => {}
            }
        }
    }
    None
}

/// Every tool result is preceded, in `list`, by the tool call it answers:
/// nothing split a call from its result.
pub fn tool_pairs(list: &[AgentMessage], field: &str) -> Result {
    match first_orphan_result(list) {
        None => Ok(()),
        Some((i, j)) => {
            let Some(Part::ToolResult(r)) = &list[i].content[j].part else {
                unreachable!("an orphan is a tool result")
            };
            Err(Violation::invalid(
                format!("{field}[{i}].content[{j}].tool_result"),
                format!("answers tool call {:?}, which does not precede it", r.tool_call_id),
            ))
        }
    }
}

/// A tool name: 1 to 64 of `[a-zA-Z0-9_-]`, the rule model APIs share.
pub fn tool_name(name: &str, field: &str) -> Result {
    let ok = (1..=MAX_TOOL_NAME_BYTES).contains(&name.len())
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if !ok {
        return Err(Violation::invalid(field, format!("{name:?} is not 1 to 64 of [a-zA-Z0-9_-]")));
    }
    Ok(())
}

/// An engine's tool declarations: at most [`MAX_TOOLS`], names valid and
/// unique, descriptions and schemas within their limits, each schema a
/// JSON object.
pub fn tools(list: &[pb::ToolDefinition], field: &str) -> Result {
    if list.len() > MAX_TOOLS {
        return Err(Violation::too_large(field, format!("declares {} tools, the limit is {MAX_TOOLS}", list.len())));
    }
    let mut names = HashSet::new();
    for (i, t) in list.iter().enumerate() {
        let at = format!("{field}[{i}]");
        tool_name(&t.name, &format!("{at}.name"))?;
        if !names.insert(t.name.as_str()) {
            return Err(Violation::invalid(format!("{at}.name"), format!("{:?} is declared twice", t.name)));
        }
        if t.description.len() > MAX_TOOL_DESCRIPTION_BYTES {
            return Err(Violation::too_large(
                format!("{at}.description"),
                format!("is {} bytes, the limit is {MAX_TOOL_DESCRIPTION_BYTES}", t.description.len()),
            ));
        }
        let schema = &t.parameters_json_schema;
        if schema.len() > MAX_TOOL_SCHEMA_BYTES {
            return Err(Violation::too_large(
                format!("{at}.parameters_json_schema"),
                format!("is {} bytes, the limit is {MAX_TOOL_SCHEMA_BYTES}", schema.len()),
            ));
        }
        if !schema.trim().is_empty()
            && !matches!(serde_json::from_str::<serde_json::Value>(schema), Ok(serde_json::Value::Object(_)))
        {
            return Err(Violation::invalid(format!("{at}.parameters_json_schema"), "is not a JSON object"));
        }
        if pb::ToolAudience::try_from(t.audience).is_err() {
            return Err(Violation::invalid(format!("{at}.audience"), format!("{} is not a ToolAudience", t.audience)));
        }
    }
    Ok(())
}

/// Request checks an engine server applies before its code runs.
pub mod request {
    use super::*;

    pub fn bootstrap(r: &pb::BootstrapRequest) -> Result {
        id(&r.session_id, "session_id")
    }

    pub fn ingest(r: &pb::IngestRequest) -> Result {
        id(&r.session_id, "session_id")?;
        let m = r.message.as_ref().ok_or_else(|| Violation::invalid("message", "is required"))?;
        message(m, "message")
    }

    pub fn ingest_batch(r: &pb::IngestBatchRequest) -> Result {
        id(&r.session_id, "session_id")?;
        messages(&r.messages, "messages")
    }

    pub fn assemble(r: &pb::AssembleRequest) -> Result {
        id(&r.session_id, "session_id")?;
        messages(&r.messages, "messages")
    }

    pub fn compact(r: &pb::CompactRequest) -> Result {
        id(&r.session_id, "session_id")?;
        id(&r.session_key, "session_key")
    }

    pub fn after_turn(r: &pb::AfterTurnRequest) -> Result {
        id(&r.session_id, "session_id")?;
        messages(&r.messages, "messages")?;
        if r.pre_prompt_message_count as usize > r.messages.len() {
            return Err(Violation::invalid(
                "pre_prompt_message_count",
                format!("is {} but there are only {} messages", r.pre_prompt_message_count, r.messages.len()),
            ));
        }
        Ok(())
    }

    pub fn commit_turn(r: &pb::CommitTurnRequest) -> Result {
        id(&r.session_id, "session_id")?;
        id(&r.advancement_key, "advancement_key")?;
        let admission = r.admission.as_ref().ok_or_else(|| Violation::invalid("admission", "is required"))?;
        if admission.logical_turn_id != r.advancement_key {
            return Err(Violation::invalid("admission.logical_turn_id", "must equal advancement_key"));
        }
        let Some(terminal) = &r.terminal else { return Err(Violation::invalid("terminal", "is required")) };
        generation(admission.anchor.as_ref(), "admission.anchor.generation")?;
        generation(Some(terminal), "terminal.generation")?;
        messages(&r.messages, "messages")
    }

    /// An anchor's generation: opaque, possibly empty, at most an id's size.
    fn generation(anchor: Option<&pb::TranscriptEntryAnchor>, field: &str) -> Result {
        let n = anchor.map_or(0, |a| a.generation.len());
        if n > MAX_ID_BYTES {
            return Err(Violation::too_large(field, format!("is {n} bytes, the limit is {MAX_ID_BYTES}")));
        }
        Ok(())
    }

    pub fn maintain(r: &pb::MaintainRequest) -> Result {
        id(&r.session_id, "session_id")
    }

    pub fn prepare_subagent_spawn(r: &pb::PrepareSubagentSpawnRequest) -> Result {
        id(&r.parent_session_key, "parent_session_key")?;
        id(&r.child_session_key, "child_session_key")?;
        if r.parent_session_key == r.child_session_key {
            return Err(Violation::invalid("child_session_key", "must differ from parent_session_key"));
        }
        Ok(())
    }

    pub fn rollback_subagent_spawn(r: &pb::RollbackSubagentSpawnRequest) -> Result {
        id(&r.rollback_token, "rollback_token")
    }

    pub fn on_subagent_ended(r: &pb::OnSubagentEndedRequest) -> Result {
        id(&r.child_session_key, "child_session_key")
    }

    pub fn forget_session(r: &pb::ForgetSessionRequest) -> Result {
        id(&r.session_id, "session_id")
    }

    pub fn call_tool(r: &pb::CallToolRequest) -> Result {
        id(&r.session_id, "session_id")?;
        id(&r.tool_call_id, "tool_call_id")?;
        tool_name(&r.name, "name")?;
        if r.arguments_json.len() > MAX_TOOL_ARGUMENTS_BYTES {
            return Err(Violation::too_large(
                "arguments_json",
                format!("is {} bytes, the limit is {MAX_TOOL_ARGUMENTS_BYTES}", r.arguments_json.len()),
            ));
        }
        Ok(())
    }
}

/// Result checks a caller applies to what an engine answered.
pub mod result {
    use super::*;

    pub fn info(i: &pb::EngineInfo) -> Result {
        if i.id.trim().is_empty() {
            return Err(Violation::invalid("info.id", "is blank"));
        }
        if i.name.trim().is_empty() {
            return Err(Violation::invalid("info.name", "is blank"));
        }
        // They become log fields, metric labels and an audit caller.
        for (field, v) in [("info.id", &i.id), ("info.name", &i.name), ("info.version", &i.version)] {
            if v.len() > MAX_ID_BYTES {
                return Err(Violation::too_large(field, format!("is {} bytes, the limit is {MAX_ID_BYTES}", v.len())));
            }
            if v.chars().any(char::is_control) {
                return Err(Violation::invalid(field, "contains a control character"));
            }
        }
        let major = i.contract_version.split('.').next().unwrap_or_default();
        if major != "1" {
            return Err(Violation::invalid(
                "info.contract_version",
                format!("is {:?}, this side speaks 1.x", i.contract_version),
            ));
        }
        for m in Method::ALL.into_iter().filter(|m| m.required()) {
            if !m.listed_in(&i.implemented_methods) {
                return Err(Violation::invalid("info.implemented_methods", format!("lacks required method {m}")));
            }
        }
        let mut seen = HashSet::new();
        for m in &i.implemented_methods {
            let Some(method) = Method::from_name(m) else {
                return Err(Violation::invalid("info.implemented_methods", format!("names unknown method {m:?}")));
            };
            if !seen.insert(method) {
                return Err(Violation::invalid("info.implemented_methods", format!("lists {m} twice")));
            }
        }
        let sem = i.transcript_semantics.unwrap_or_default();
        if sem.turn_advancement_idempotency != 0 && !seen.contains(&Method::CommitTurn) {
            return Err(Violation::invalid(
                "info.transcript_semantics.turn_advancement_idempotency",
                "is declared but CommitTurn is not implemented",
            ));
        }
        if !i.tools.is_empty() && !seen.contains(&Method::CallTool) {
            return Err(Violation::invalid("info.tools", "are declared but CallTool is not implemented"));
        }
        tools(&i.tools, "info.tools")?;
        // A DELTA engine is resynced through IngestBatch after a gap.
        if i.history_delivery == pb::HistoryDelivery::Delta as i32 && !seen.contains(&Method::IngestBatch) {
            return Err(Violation::invalid(
                "info.history_delivery",
                "is DELTA but IngestBatch (the resync after a history gap) is not implemented",
            ));
        }
        Ok(())
    }

    /// An assemble result for a request of `request_messages` messages:
    /// messages present when there was history, well-formed, and no tool
    /// result split from its call.
    pub fn assemble(r: &pb::AssembleResult, request_messages: usize) -> Result {
        if r.messages.is_empty() && request_messages > 0 {
            return Err(Violation::invalid("messages", "is empty although the request had history"));
        }
        messages(&r.messages, "messages")?;
        tool_pairs(&r.messages, "messages")?;
        if let Some(p) = &r.projection
            && p.mode == pb::ProjectionMode::ThreadBootstrap as i32
            && p.epoch.as_deref().is_none_or(|e| e.trim().is_empty())
        {
            return Err(Violation::invalid("projection.epoch", "is required for thread_bootstrap"));
        }
        Ok(())
    }

    pub fn commit_turn(r: &pb::CommitTurnResult) -> Result {
        match pb::CommitStatus::try_from(r.status) {
            Ok(pb::CommitStatus::Committed | pb::CommitStatus::Duplicate) => Ok(()),
            _ => Err(Violation::invalid("status", format!("invalid commitTurn result status: {}", r.status))),
        }
    }

    /// A tool's result: text parts only (what the model is shown). Its
    /// size is not refused here: the gateway keeps the first
    /// `MAX_TOOL_RESULT_BYTES` and says it cut.
    pub fn call_tool(r: &pb::CallToolResult) -> Result {
        for (i, p) in r.content.iter().enumerate() {
            if !matches!(p.part, Some(Part::Text(_))) {
                return Err(Violation::invalid(format!("content[{i}]"), "a tool's result carries text parts only"));
            }
        }
        Ok(())
    }

    pub fn maintain(r: &pb::MaintainResult) -> Result {
        for (i, rep) in r.replacements.iter().enumerate() {
            let at = format!("replacements[{i}]");
            let m = rep.message.as_ref().ok_or_else(|| Violation::invalid(format!("{at}.message"), "is required"))?;
            message(m, &format!("{at}.message"))?;
            if m.id != rep.entry_id {
                return Err(Violation::invalid(format!("{at}.message.id"), "must equal entry_id"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::{ContentPart, ToolCall, ToolResult};

    fn m(id: &str, role: Role, parts: Vec<Part>) -> AgentMessage {
        AgentMessage {
            id: id.into(),
            role: role as i32,
            content: parts.into_iter().map(|p| ContentPart { part: Some(p) }).collect(),
            ..Default::default()
        }
    }

    fn call(id: &str) -> Part {
        Part::ToolCall(ToolCall { id: id.into(), name: "read".into(), arguments_json: "{}".into() })
    }

    fn result(id: &str) -> Part {
        Part::ToolResult(ToolResult { tool_call_id: id.into(), text: "ok".into(), ..Default::default() })
    }

    #[test]
    fn metadata_is_bounded_in_entries_keys_and_values() {
        let ok = m("a", Role::User, vec![Part::Text("hi".into())]);
        let with =
            |entries: Vec<(String, String)>| AgentMessage { metadata: entries.into_iter().collect(), ..ok.clone() };
        assert!(message(&with(vec![("model".into(), "gpt".into())]), "m").is_ok());
        let many = with((0..=MAX_METADATA_ENTRIES).map(|i| (format!("k{i}"), String::new())).collect());
        let long_key = with(vec![("k".repeat(MAX_METADATA_KEY_BYTES + 1), String::new())]);
        let long_value = with(vec![("k".into(), "v".repeat(MAX_METADATA_VALUE_BYTES + 1))]);
        for bad in [many, long_key, long_value] {
            let v = message(&bad, "m").unwrap_err();
            assert_eq!((v.field.as_str(), v.kind), ("m.metadata", ViolationKind::TooLarge), "{v}");
        }
    }

    #[test]
    fn unknown_and_missing_roles_name_the_field() {
        let mut x = m("a", Role::User, vec![Part::Text("hi".into())]);
        x.role = 42;
        let v = messages(&[x], "messages").unwrap_err();
        assert_eq!((v.field.as_str(), v.kind), ("messages[0].role", ViolationKind::Invalid));
        x = m("a", Role::Unspecified, vec![]);
        assert_eq!(message(&x, "m").unwrap_err().field, "m.role");
    }

    #[test]
    fn tool_result_needs_a_call_id_and_oversize_is_resource_exhausted() {
        let x = m("a", Role::Tool, vec![result("")]);
        assert_eq!(message(&x, "m").unwrap_err().field, "m.content[0].tool_result.tool_call_id");
        let big = m("b", Role::User, vec![Part::Text("x".repeat(MAX_MESSAGE_CONTENT_BYTES + 1))]);
        let v = message(&big, "m").unwrap_err();
        assert_eq!(v.kind, ViolationKind::TooLarge);
        assert_eq!(tonic::Status::from(v).code(), tonic::Code::ResourceExhausted);
    }

    #[test]
    fn tool_pairs_detects_a_result_without_its_call() {
        let pair = [m("1", Role::Assistant, vec![call("c1")]), m("2", Role::Tool, vec![result("c1")])];
        assert!(tool_pairs(&pair, "m").is_ok());
        assert_eq!(tool_pairs(&pair[1..], "m").unwrap_err().field, "m[0].content[0].tool_result");
    }

    #[test]
    fn duplicate_ids_are_rejected() {
        let list = [m("1", Role::User, vec![]), m("1", Role::User, vec![])];
        assert_eq!(messages(&list, "messages").unwrap_err().field, "messages[1].id");
    }
}
