//! Summaries: from the host's model when the grant allows it, else from a
//! deterministic extractive summariser (same input, same summary).

use std::collections::BTreeSet;

use ctxgate_engine_sdk::pb::{self, AgentMessage, Role, content_part::Part};
use ctxgate_engine_sdk::{CallContext, EngineError, LLM_COMPLETE};

/// Longest summary kept; older lines go first when over it.
pub const MAX_SUMMARY_CHARS: usize = 12_000;
const SNIPPET_CHARS: usize = 240;
/// Tool output is bulky and mostly re-readable: keep less of it.
const TOOL_SNIPPET_CHARS: usize = 120;
const HEADER: &str = "Summary of the earlier conversation (window engine)";

/// Where a summary came from (reported in CompactResult.details_json).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Llm,
    Extractive,
}

impl Source {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Llm => "llm",
            Self::Extractive => "extractive",
        }
    }
}

/// Folds `chunk` into `previous`: through the host's model when the call's
/// grant allows `llm_complete`, else extractively. A failed model call falls
/// back to the extractive summary; cancellation does not.
pub async fn fold(
    ctx: &CallContext,
    previous: &str,
    chunk: &[AgentMessage],
    instructions: Option<&str>,
) -> Result<(String, Source), EngineError> {
    if let Some(host) = ctx.host().filter(|h| h.allows(LLM_COMPLETE)) {
        let req = pb::LlmCompleteRequest {
            messages: vec![pb::LlmMessage { role: "user".into(), content: prompt(previous, chunk, instructions) }],
            system_prompt: Some("You compress conversation history for an AI agent. Keep decisions, open tasks, constraints, pending user requests and exact identifiers (paths, ids, numbers).".into()),
            max_tokens: Some(1024),
            purpose: "context-engine.compaction".into(),
            ..Default::default()
        };
        match host.llm_complete(ctx, req).await {
            Ok(r) if !r.text.trim().is_empty() => return Ok((cap(r.text.trim().to_owned()), Source::Llm)),
            Ok(_) => tracing::warn!("host model returned an empty summary; using the extractive one"),
            Err(e @ (EngineError::Cancelled | EngineError::DeadlineExceeded)) => return Err(e),
            Err(e) => tracing::warn!(error = %e, "host model failed; using the extractive summary"),
        }
    }
    Ok((extractive(previous, chunk), Source::Extractive))
}

fn prompt(previous: &str, chunk: &[AgentMessage], instructions: Option<&str>) -> String {
    let mut p = String::from("Update the running summary with the new messages. Answer with the summary only.\n");
    if let Some(i) = instructions {
        p.push_str(&format!("Additional instructions: {i}\n"));
    }
    p.push_str("\n<previous-summary>\n");
    p.push_str(previous);
    p.push_str("\n</previous-summary>\n<new-messages>\n");
    for m in chunk {
        p.push_str(&format!("{}: {}\n", role_name(m.role), text(m)));
    }
    p.push_str("</new-messages>\n");
    p
}

/// The deterministic summary: the previous summary's lines, one line per
/// new message (role and the start of its text), and every identifier seen.
pub fn extractive(previous: &str, chunk: &[AgentMessage]) -> String {
    let (mut lines, mut idents) = parse_previous(previous);
    for m in chunk {
        let t = text(m);
        idents.extend(identifiers(&t));
        let limit = if m.role == Role::Tool as i32 { TOOL_SNIPPET_CHARS } else { SNIPPET_CHARS };
        let snippet: String = t.split_whitespace().collect::<Vec<_>>().join(" ").chars().take(limit).collect();
        if !snippet.is_empty() {
            lines.push(format!("- {}: {snippet}", role_name(m.role)));
        }
    }
    let render = |lines: &[String]| {
        let mut s = format!("{HEADER}\n\nConversation:\n{}\n", lines.join("\n"));
        if !idents.is_empty() {
            s.push_str(&format!("\nExact identifiers: {}\n", idents.iter().cloned().collect::<Vec<_>>().join(", ")));
        }
        s
    };
    let mut out = render(&lines);
    // Over the cap: drop the oldest conversation lines, keep identifiers.
    let mut skip = 0;
    while out.chars().count() > MAX_SUMMARY_CHARS && skip < lines.len() {
        skip += 1;
        out = render(&lines[skip..]);
    }
    cap(out)
}

fn cap(s: String) -> String {
    if s.chars().count() <= MAX_SUMMARY_CHARS {
        return s;
    }
    s.chars().take(MAX_SUMMARY_CHARS).collect()
}

fn parse_previous(previous: &str) -> (Vec<String>, BTreeSet<String>) {
    let mut lines = Vec::new();
    let mut idents = BTreeSet::new();
    for line in previous.lines() {
        if let Some(list) = line.strip_prefix("Exact identifiers: ") {
            idents.extend(list.split(", ").map(str::to_owned));
        } else if line.starts_with("- ") {
            lines.push(line.to_owned());
        } else if !line.is_empty() && line != HEADER && line != "Conversation:" {
            // A model-written summary folded into an extractive one.
            lines.push(format!("- earlier: {line}"));
        }
    }
    (lines, idents)
}

/// Words that look like identifiers: paths, file names, snake_case, ids
/// with digits. Exact strings an agent must not lose.
fn identifiers(text: &str) -> impl Iterator<Item = String> + '_ {
    text.split(|c: char| {
        c.is_whitespace() || matches!(c, ',' | ';' | '(' | ')' | '"' | '\'' | '`' | '[' | ']' | '{' | '}')
    })
    .map(|w| w.trim_end_matches(['.', ':', '!', '?']))
    .filter(|w| {
        w.len() >= 3
            && w.len() <= 120
            && (w.contains('/')
                || w.contains('_')
                || (w.contains('.') && w.chars().any(char::is_alphabetic))
                || (w.chars().any(|c| c.is_ascii_digit()) && w.chars().any(|c| c.is_ascii_alphabetic())))
    })
    .map(str::to_owned)
}

pub fn role_name(role: i32) -> &'static str {
    match Role::try_from(role) {
        Ok(Role::System) => "system",
        Ok(Role::User) => "user",
        Ok(Role::Assistant) => "assistant",
        Ok(Role::Tool) => "tool",
        _ => "unknown",
    }
}

/// The readable text of a message: text parts, tool calls by name, tool
/// results.
pub fn text(m: &AgentMessage) -> String {
    m.content
        .iter()
        .filter_map(|p| match &p.part {
            Some(Part::Text(t)) => Some(t.clone()),
            Some(Part::ToolCall(c)) => Some(format!("called {}({})", c.name, c.arguments_json)),
            Some(Part::ToolResult(r)) => Some(format!("result: {}", r.text)),
            Some(Part::Image(i)) => Some(format!("[image {}]", i.uri)),
            _ => None,
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use ctxgate_engine_sdk::testkit::msg;

    #[test]
    fn extractive_is_deterministic_and_keeps_identifiers_across_folds() {
        let first = [msg::user("u", "Please edit src/main.rs and ticket ABC-123"), msg::assistant("a", "Done.")];
        let s1 = extractive("", &first);
        assert_eq!(s1, extractive("", &first));
        assert!(s1.contains("src/main.rs") && s1.contains("ABC-123"), "{s1}");
        let s2 = extractive(&s1, &[msg::user("u2", "now run cargo_test")]);
        assert!(s2.contains("src/main.rs") && s2.contains("cargo_test"), "{s2}");
        assert!(s2.contains("- user: Please edit"), "{s2}");
    }

    #[test]
    fn extractive_stays_under_the_cap() {
        let many: Vec<_> = (0..500).map(|i| msg::user(&format!("u{i}"), &"word ".repeat(100))).collect();
        let s = extractive("", &many);
        assert!(s.chars().count() <= MAX_SUMMARY_CHARS);
        assert!(s.starts_with(HEADER));
    }
}
