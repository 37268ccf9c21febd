//! Retrieval over the engine's own record of every message, summarised or
//! not: `history_search` (full-text, ranked) and `history_read` (messages
//! by sequence number), offered to the model as tools, so compaction stops
//! being loss — what the summary dropped can be found and read again.

use ctxgate_engine_sdk::pb;
use ctxgate_engine_sdk::proto::extractive::message_text;
use ctxgate_engine_sdk::{EngineError, tool, tool_error, tool_text};
use serde_json::Value;

use crate::store::{self, Store};

/// The retrieval policy, in the system prompt: one static paragraph, so a
/// prompt cache keeps its prefix from turn to turn.
pub const POLICY: &str = "Older parts of this conversation may be shown only as a summary, but every message is kept. \
Before saying you do not know or do not remember something from earlier in the conversation (an identifier, a \
decision, a TODO, a file, a number), call history_search with its keywords, then history_read for the messages \
around a hit if you need more than its snippet.";

pub const SEARCH: &str = "history_search";
pub const READ: &str = "history_read";

/// Hits one search returns at most, and by default.
const MAX_HITS: usize = 50;
const DEFAULT_HITS: usize = 10;
/// Messages, and bytes of their text, one read returns at most.
const MAX_READ_MESSAGES: usize = 50;
const MAX_READ_BYTES: usize = 64 * 1024;
/// Terms one query keeps (the rest are dropped, said in the answer).
const MAX_TERMS: usize = 32;

/// The tools, as EngineInfo declares them.
pub fn tools() -> Vec<pb::ToolDefinition> {
    let mut search = tool(
        SEARCH,
        "Full-text search of every message of this conversation, including those compaction summarised away. \
         Returns the best matches first, each with its sequence number, role and a snippet.",
        r#"{"type":"object","properties":{"query":{"type":"string","description":"keywords or an exact identifier"},"limit":{"type":"integer","minimum":1,"maximum":50,"description":"most hits (default 10)"}},"required":["query"]}"#,
    );
    let mut read = tool(
        READ,
        "Reads this conversation's messages by sequence number (as history_search reports them), oldest first, \
         at most 50 messages or 64 KiB of text.",
        r#"{"type":"object","properties":{"from_seq":{"type":"integer","minimum":1},"to_seq":{"type":"integer","minimum":1}},"required":["from_seq","to_seq"]}"#,
    );
    // Subagents search their own history as well.
    search.audience = pb::ToolAudience::All as i32;
    read.audience = pb::ToolAudience::All as i32;
    vec![search, read]
}

/// Runs `req`'s tool: an error result for anything the model can fix.
pub async fn call(store: &Store, req: pb::CallToolRequest) -> Result<pb::CallToolResult, EngineError> {
    let args: Value = match serde_json::from_str(&req.arguments_json) {
        Ok(v @ Value::Object(_)) => v,
        Ok(_) => return Ok(tool_error("The arguments must be a JSON object.")),
        Err(e) => return Ok(tool_error(format!("The arguments are not JSON: {e}."))),
    };
    let session_id = req.session_id;
    match req.name.as_str() {
        SEARCH => {
            let Some(query) = args.get("query").and_then(Value::as_str).map(str::trim).filter(|q| !q.is_empty()) else {
                return Ok(tool_error("history_search needs a non-empty string \"query\"."));
            };
            let limit = match args.get("limit") {
                None | Some(Value::Null) => DEFAULT_HITS,
                Some(v) => match v.as_u64() {
                    Some(n @ 1..) => (n as usize).min(MAX_HITS),
                    _ => return Ok(tool_error("\"limit\" must be a positive integer.")),
                },
            };
            let Some(fts) = fts_query(query) else {
                return Ok(tool_error("The query has no words to search for."));
            };
            let shown = query.to_owned();
            let hits = store.read(move |c| store::search(c, &session_id, &fts, limit)).await?;
            Ok(tool_text(render_hits(&shown, &hits)))
        }
        READ => {
            let seq = |k: &str| args.get(k).and_then(Value::as_i64).filter(|n| *n >= 1);
            let (Some(from), Some(to)) = (seq("from_seq"), seq("to_seq")) else {
                return Ok(tool_error("history_read needs integers \"from_seq\" and \"to_seq\" (1 or more)."));
            };
            if to < from {
                return Ok(tool_error("\"to_seq\" must not be below \"from_seq\"."));
            }
            let found =
                store.read(move |c| store::messages_between(c, &session_id, from, to, MAX_READ_MESSAGES)).await?;
            Ok(tool_text(render_messages(from, to, &found)))
        }
        other => Ok(tool_error(format!("There is no tool {other:?}; this engine offers {SEARCH} and {READ}."))),
    }
}

/// The model's query as FTS5 syntax: each term a quoted phrase (so an
/// identifier such as `ID-4821-XYZ` matches as written, and no operator
/// the model typed is interpreted), any of them matching, ranked by bm25.
fn fts_query(query: &str) -> Option<String> {
    let terms: Vec<String> = query
        .split_whitespace()
        .map(|t| t.trim_matches(|c: char| !c.is_alphanumeric()))
        .filter(|t| !t.is_empty())
        .take(MAX_TERMS)
        .map(|t| format!("\"{}\"", t.replace('"', "\"\"")))
        .collect();
    (!terms.is_empty()).then(|| terms.join(" OR "))
}

fn role(r: i32) -> &'static str {
    match pb::Role::try_from(r) {
        Ok(pb::Role::User) => "user",
        Ok(pb::Role::Assistant) => "assistant",
        Ok(pb::Role::Tool) => "tool",
        Ok(pb::Role::System) => "system",
        _ => "message",
    }
}

fn render_hits(query: &str, hits: &[store::Hit]) -> String {
    if hits.is_empty() {
        return format!("No message matches {query:?}.");
    }
    let mut out = format!("{} message(s) match {query:?}, best first:\n", hits.len());
    for h in hits {
        out.push_str(&format!("#{} {}: {}\n", h.seq, role(h.role), h.snippet.replace('\n', " ")));
    }
    out
}

fn render_messages(from: i64, to: i64, found: &[store::Stored]) -> String {
    if found.is_empty() {
        return format!("No messages between #{from} and #{to}.");
    }
    let mut out = String::new();
    for s in found {
        let line = format!("#{} {}: {}\n", s.seq, role(s.message.role), message_text(&s.message));
        if out.len() + line.len() > MAX_READ_BYTES {
            out.push_str(&format!(
                "[… stopped at #{}: the rest is over {} KiB; read on from there]\n",
                s.seq,
                MAX_READ_BYTES >> 10
            ));
            return out;
        }
        out.push_str(&line);
    }
    if let Some(last) = found.last()
        && last.seq < to
        && found.len() == MAX_READ_MESSAGES
    {
        out.push_str(&format!("[… {MAX_READ_MESSAGES} messages at most per read; read on from #{}]\n", last.seq + 1));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::fts_query;

    #[test]
    fn queries_become_quoted_phrases_and_operators_are_not_obeyed() {
        assert_eq!(fts_query("ID-4821-XYZ").as_deref(), Some("\"ID-4821-XYZ\""));
        assert_eq!(fts_query("cache NOT redis").as_deref(), Some("\"cache\" OR \"NOT\" OR \"redis\""));
        assert_eq!(fts_query("\"quoted\" (paren)").as_deref(), Some("\"quoted\" OR \"paren\""));
        assert_eq!(fts_query("  ?! "), None);
    }
}
