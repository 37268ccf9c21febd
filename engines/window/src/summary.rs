//! Summaries: from the host's model when the grant allows it, else from a
//! deterministic extractive summariser (same input, same summary).

use ctxgate_engine_sdk::pb::{self, AgentMessage};
use ctxgate_engine_sdk::proto::extractive;
use ctxgate_engine_sdk::{CallContext, EngineError, LLM_COMPLETE};

/// Longest summary kept; older lines go first when over it.
pub const MAX_SUMMARY_CHARS: usize = 12_000;

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
            // The host has no model for summaries (offline): summarise here.
            Err(EngineError::HostUnimplemented(_)) => {}
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
        p.push_str(&format!("{}: {}\n", extractive::role_name(m.role), extractive::message_text(m)));
    }
    p.push_str("</new-messages>\n");
    p
}

/// The deterministic summary, shared with the gateway's built-in
/// compaction: the five safeguard headings filled from the text, the
/// previous summary folded in, identifiers kept.
pub fn extractive(previous: &str, chunk: &[AgentMessage]) -> String {
    let previous = Some(previous).filter(|p| !p.trim().is_empty());
    cap(extractive::extractive(previous, chunk))
}

fn cap(s: String) -> String {
    if s.chars().count() <= MAX_SUMMARY_CHARS {
        return s;
    }
    s.chars().take(MAX_SUMMARY_CHARS).collect()
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
        for h in ctxgate_engine_sdk::proto::extractive::HEADINGS {
            assert!(s2.contains(h), "{h} missing: {s2}");
        }
    }

    #[test]
    fn extractive_stays_under_the_cap() {
        let many: Vec<_> = (0..500).map(|i| msg::user(&format!("u{i}"), &"word ".repeat(100))).collect();
        let s = extractive("", &many);
        assert!(s.chars().count() <= MAX_SUMMARY_CHARS);
        assert!(s.starts_with(ctxgate_engine_sdk::proto::extractive::HEADINGS[0]), "{s}");
    }
}
