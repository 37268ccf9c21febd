//! Built-in compaction (OpenClaw's safeguard mode): keep the recent
//! history verbatim, never cut between a tool call and its result,
//! summarise the rest in chunks with the previous summary folded in, audit
//! the summary and regenerate once, and keep the history untouched when it
//! still fails. Each model request gets its own safety-timeout window.

use std::collections::HashSet;
use std::time::Duration;

use ctxgate_proto::estimate;
use ctxgate_proto::pb::{AgentMessage, Role};
use tokio_util::sync::CancellationToken;

use crate::provider::{ModelError, message_text};
use crate::summarize::{self, HEADINGS, Summarizer, SummaryRequest};

/// Tunables (from `agents.defaults.compaction`).
#[derive(Debug, Clone)]
pub struct Settings {
    pub keep_recent_tokens: u64,
    /// Whole turns always kept verbatim.
    pub recent_turns_preserve: u32,
    /// Largest slice of history summarised in one model request.
    pub chunk_tokens: u64,
    /// The safety timeout of one model request.
    pub request_timeout: Duration,
    pub quality_guard: bool,
    pub max_retries: u32,
    pub strict_identifiers: bool,
}

/// What to compact: the visible history.
#[derive(Debug, Clone)]
pub struct Input {
    pub previous_summary: Option<String>,
    pub messages: Vec<AgentMessage>,
    /// For target=budget: keep at most half of this verbatim.
    pub token_budget: Option<u64>,
    pub instructions: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Compacted {
        summary: String,
        first_kept_entry_id: String,
        tokens_before: u64,
        tokens_after: u64,
    },
    /// Nothing changed; the reason says why.
    Kept {
        reason: String,
        tokens_before: u64,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum CompactionError {
    #[error("a summary request took longer than the {0:?} safety timeout")]
    Timeout(Duration),
    #[error("compaction was cancelled")]
    Cancelled,
    #[error("the summary model failed: {0}")]
    Model(ModelError),
}

/// A progress report: (done, total, message).
pub type ProgressFn<'a> = dyn FnMut(u64, u64, String) + Send + 'a;

fn tokens_of(previous: Option<&str>, messages: &[AgentMessage]) -> u64 {
    previous.map_or(0, estimate::text_tokens) + estimate::messages_tokens(messages)
}

/// Whether the tail starting at `cut` holds a tool result whose call is
/// before `cut`.
fn splits_a_pair(messages: &[AgentMessage], cut: usize) -> bool {
    ctxgate_proto::validate::first_orphan_result(&messages[cut..]).is_some()
}

/// The index of the first message kept verbatim: the newest messages that
/// fit `keep_tokens` (and at least `preserve_turns` whole turns), moved
/// earlier so no tool result loses its call.
pub fn cut_point(messages: &[AgentMessage], keep_tokens: u64, preserve_turns: u32) -> usize {
    let mut cut = messages.len();
    let mut kept = 0;
    while cut > 0 {
        let t = estimate::message_tokens(&messages[cut - 1]);
        if kept + t > keep_tokens {
            break;
        }
        kept += t;
        cut -= 1;
    }
    if preserve_turns > 0 {
        let user_starts: Vec<usize> =
            messages.iter().enumerate().filter(|(_, m)| m.role == Role::User as i32).map(|(i, _)| i).collect();
        if let Some(&start) = user_starts.len().checked_sub(preserve_turns as usize).and_then(|i| user_starts.get(i)) {
            cut = cut.min(start);
        } else if !user_starts.is_empty() {
            cut = 0;
        }
    }
    while cut > 0 && splits_a_pair(messages, cut) {
        cut -= 1;
    }
    cut
}

/// Runs built-in compaction.
pub async fn compact(
    input: Input,
    summarizer: &dyn Summarizer,
    settings: &Settings,
    cancel: &CancellationToken,
    progress: &mut ProgressFn<'_>,
) -> Result<Outcome, CompactionError> {
    let messages = &input.messages;
    let previous = input.previous_summary.as_deref();
    let tokens_before = tokens_of(previous, messages);
    let keep = match input.token_budget {
        Some(b) => settings.keep_recent_tokens.min(b / 2),
        None => settings.keep_recent_tokens,
    };
    let cut = cut_point(messages, keep, settings.recent_turns_preserve);
    if cut == 0 {
        return Ok(Outcome::Kept {
            reason: "nothing older than the recent history to summarise".into(),
            tokens_before,
        });
    }
    if cut == messages.len() {
        // Keep at least the newest message verbatim: the model must see it.
        return Ok(Outcome::Kept { reason: "the newest message alone exceeds the kept budget".into(), tokens_before });
    }

    // A cut inside a turn: the turn's beginning is summarised on its own so
    // the kept part still makes sense (OpenClaw's split-turn prefix).
    let turn_start = messages[..cut].iter().rposition(|m| m.role == Role::User as i32).unwrap_or(0);
    let split_turn = messages[cut].role != Role::User as i32 && turn_start < cut;
    let (older, prefix) =
        if split_turn { messages[..cut].split_at(turn_start) } else { (&messages[..cut], &messages[cut..cut]) };

    let chunks = chunk(older, settings.chunk_tokens.max(1));
    let total = chunks.len() as u64 + u64::from(split_turn);
    let mut expected: Vec<String> = previous.map(summarize::identifiers).unwrap_or_default();
    let mut summary = input.previous_summary.clone();
    for (i, c) in chunks.iter().enumerate() {
        progress(i as u64, total, format!("summarising {} messages", c.len()));
        for m in *c {
            expected.extend(summarize::identifiers(&message_text(m)));
        }
        let req = SummaryRequest {
            previous: summary.take(),
            messages: c.to_vec(),
            instructions: input.instructions.clone(),
            feedback: None,
        };
        match audited(summarizer, req, &expected, settings, cancel).await? {
            Ok(s) => summary = Some(s),
            Err(reason) => return Ok(Outcome::Kept { reason, tokens_before }),
        }
    }
    let mut summary = summary.unwrap_or_default();
    if split_turn {
        progress(total - 1, total, "summarising the start of the current turn".into());
        let req = SummaryRequest {
            previous: None,
            messages: prefix.to_vec(),
            instructions: input.instructions.clone(),
            feedback: None,
        };
        let part = request(summarizer, req, settings, cancel).await?;
        summary = summarize::cap(format!("{summary}\n## Current turn so far\n{part}"));
    }
    progress(total, total, "summary ready".into());
    let kept = &messages[cut..];
    let tokens_after = tokens_of(Some(&summary), kept);
    Ok(Outcome::Compacted { summary, first_kept_entry_id: kept[0].id.clone(), tokens_before, tokens_after })
}

/// Splits `messages` into runs of at most `max_tokens` (a single larger
/// message is a chunk of its own), never between a call and its result.
fn chunk(messages: &[AgentMessage], max_tokens: u64) -> Vec<&[AgentMessage]> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut acc = 0;
    for (i, m) in messages.iter().enumerate() {
        let t = estimate::message_tokens(m);
        if i > start && acc + t > max_tokens && !splits_a_pair(&messages[..messages.len()], i) {
            out.push(&messages[start..i]);
            start = i;
            acc = 0;
        }
        acc += t;
    }
    if start < messages.len() {
        out.push(&messages[start..]);
    }
    out
}

/// One model request under its own safety-timeout window.
async fn request(
    summarizer: &dyn Summarizer,
    req: SummaryRequest,
    s: &Settings,
    cancel: &CancellationToken,
) -> Result<String, CompactionError> {
    match tokio::time::timeout(s.request_timeout, summarizer.summarize(req, cancel)).await {
        Err(_) => Err(CompactionError::Timeout(s.request_timeout)),
        Ok(Err(ModelError::Cancelled)) => Err(CompactionError::Cancelled),
        Ok(Err(e)) => Err(CompactionError::Model(e)),
        Ok(Ok(text)) => Ok(summarize::cap(text)),
    }
}

/// Summarises and audits; regenerates with feedback up to `max_retries`
/// times. `Ok(Err(reason))` means the audit still failed: keep history.
async fn audited(
    summarizer: &dyn Summarizer,
    mut req: SummaryRequest,
    expected: &[String],
    s: &Settings,
    cancel: &CancellationToken,
) -> Result<Result<String, String>, CompactionError> {
    let attempts = if s.quality_guard { s.max_retries + 1 } else { 1 };
    let mut last_problem = String::new();
    for _ in 0..attempts {
        let text = request(summarizer, req.clone(), s, cancel).await?;
        match audit(&text, expected, s.strict_identifiers) {
            Ok(()) => return Ok(Ok(text)),
            Err(problem) if s.quality_guard => {
                tracing::warn!(%problem, "summary failed the quality audit");
                req.feedback = Some(problem.clone());
                last_problem = problem;
            }
            Err(_) => return Ok(Ok(text)),
        }
    }
    Ok(Err(format!("the summary failed the quality audit ({last_problem}); history kept as it was")))
}

/// How many of the newest identifiers a summary must keep verbatim.
const AUDITED_IDENTIFIERS: usize = 50;

/// The summary has every safeguard heading and (strict policy) the newest
/// identifiers of what it replaces.
pub fn audit(summary: &str, expected: &[String], strict: bool) -> Result<(), String> {
    let missing: Vec<&str> = HEADINGS.iter().copied().filter(|h| !summary.contains(h)).collect();
    if !missing.is_empty() {
        return Err(format!("missing headings {}", missing.join(", ")));
    }
    if strict {
        let mut seen = HashSet::new();
        let newest: Vec<&String> =
            expected.iter().rev().filter(|i| seen.insert(i.as_str())).take(AUDITED_IDENTIFIERS).collect();
        let lost: Vec<&str> = newest.iter().filter(|i| !summary.contains(i.as_str())).map(|i| i.as_str()).collect();
        if !lost.is_empty() {
            return Err(format!("lost identifiers {}", lost.iter().take(5).cloned().collect::<Vec<_>>().join(", ")));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::summarize::Extractive;
    use ctxgate_proto::pb::{ContentPart, ToolCall, ToolResult, content_part::Part};
    use proptest::prelude::*;

    fn text(id: usize, role: Role, words: usize) -> AgentMessage {
        let body = format!("note_{id} {}", "lorem ipsum ".repeat(words));
        AgentMessage {
            id: format!("m{id}"),
            role: role as i32,
            content: vec![ContentPart { part: Some(Part::Text(body)) }],
            ..Default::default()
        }
    }

    fn call(id: usize) -> AgentMessage {
        let c = ToolCall {
            id: format!("call{id}"),
            name: "read_file".into(),
            arguments_json: format!("{{\"path\":\"src/f{id}.rs\"}}"),
        };
        AgentMessage {
            id: format!("m{id}"),
            role: Role::Assistant as i32,
            content: vec![ContentPart { part: Some(Part::ToolCall(c)) }],
            ..Default::default()
        }
    }

    fn result(id: usize, of: usize, words: usize) -> AgentMessage {
        let r = ToolResult { tool_call_id: format!("call{of}"), text: "data ".repeat(words), ..Default::default() };
        AgentMessage {
            id: format!("m{id}"),
            role: Role::Tool as i32,
            content: vec![ContentPart { part: Some(Part::ToolResult(r)) }],
            ..Default::default()
        }
    }

    /// A history from a script: 0 = user, 1 = assistant, 2 = tool pair.
    fn history(script: &[(u8, usize)]) -> Vec<AgentMessage> {
        let mut out = Vec::new();
        for (kind, words) in script {
            let id = out.len();
            match kind {
                0 => out.push(text(id, Role::User, *words)),
                1 => out.push(text(id, Role::Assistant, *words)),
                _ => {
                    out.push(call(id));
                    out.push(result(id + 1, id, *words));
                }
            }
        }
        out
    }

    fn settings(keep: u64) -> Settings {
        Settings {
            keep_recent_tokens: keep,
            recent_turns_preserve: 0,
            chunk_tokens: 400,
            request_timeout: Duration::from_secs(5),
            quality_guard: true,
            max_retries: 1,
            strict_identifiers: true,
        }
    }

    fn run(input: Input, keep: u64) -> Outcome {
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
        rt.block_on(compact(input, &Extractive, &settings(keep), &CancellationToken::new(), &mut |_, _, _| {})).unwrap()
    }

    fn script() -> impl Strategy<Value = Vec<(u8, usize)>> {
        prop::collection::vec((0u8..3, 1usize..120), 2..40)
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        #[test]
        fn the_kept_tail_is_the_newest_messages_and_never_splits_a_pair(s in script(), keep in 50u64..1500) {
            let h = history(&s);
            let cut = cut_point(&h, keep, 0);
            prop_assert!(!splits_a_pair(&h, cut));
            if let Outcome::Compacted { first_kept_entry_id, .. } = run(Input { previous_summary: None, messages: h.clone(), token_budget: None, instructions: None }, keep) {
                let at = h.iter().position(|m| m.id == first_kept_entry_id).unwrap();
                prop_assert_eq!(at, cut, "kept = the suffix from the cut");
                ctxgate_proto::validate::tool_pairs(&h[at..], "kept").unwrap();
            }
        }

        #[test]
        fn summaries_have_the_headings_and_stay_under_the_cap(s in script()) {
            let h = history(&s);
            if let Outcome::Compacted { summary, tokens_after, tokens_before, .. } = run(Input { previous_summary: None, messages: h, token_budget: None, instructions: None }, 100) {
                for heading in HEADINGS { prop_assert!(summary.contains(heading)); }
                prop_assert!(summary.chars().count() <= summarize::SUMMARY_CAP);
                prop_assert!(tokens_after > 0 && tokens_before > 0);
            }
        }

        #[test]
        fn compacting_twice_keeps_identifiers_from_the_first_summary(s in script(), t in script()) {
            let h = history(&s);
            let Outcome::Compacted { summary, first_kept_entry_id, .. } = run(Input { previous_summary: None, messages: h.clone(), token_budget: None, instructions: None }, 100) else { return Ok(()) };
            let at = h.iter().position(|m| m.id == first_kept_entry_id).unwrap();
            let mut next: Vec<AgentMessage> = h[at..].to_vec();
            next.extend(history(&t).into_iter().map(|mut m| { m.id = format!("b{}", m.id); m }));
            let first_ids = summarize::identifiers(&summary);
            if let Outcome::Compacted { summary: second, .. } = run(Input { previous_summary: Some(summary), messages: next, token_budget: None, instructions: None }, 100) {
                // The audit holds the newest 50; the extractive summariser keeps 200.
                for id in first_ids.iter().rev().take(50) { prop_assert!(second.contains(id.as_str()), "{id} lost"); }
            }
        }
    }

    #[test]
    fn a_cut_between_a_call_and_its_result_moves_before_the_call() {
        let h = history(&[(0, 10), (2, 400), (1, 5)]);
        // keep fits the result and the reply but not the call+result pair start.
        let cut = cut_point(&h, estimate::messages_tokens(&h[2..]), 0);
        assert_eq!(cut, 1, "the call is kept with its result");
    }

    #[test]
    fn preserved_turns_are_kept_whole() {
        let h = history(&[(0, 50), (1, 50), (0, 50), (1, 50), (0, 50), (1, 50)]);
        assert_eq!(cut_point(&h, 0, 2), 2);
    }

    #[test]
    fn a_summary_without_headings_is_regenerated_then_abandoned() {
        struct Bad(std::sync::atomic::AtomicU32);
        #[async_trait::async_trait]
        impl Summarizer for Bad {
            async fn summarize(&self, _: SummaryRequest, _: &CancellationToken) -> Result<String, ModelError> {
                self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                Ok("just prose".into())
            }
        }
        let bad = Bad(0.into());
        let h = history(&[(0, 200), (1, 200), (0, 200), (1, 5)]);
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
        let input = Input { previous_summary: None, messages: h, token_budget: None, instructions: None };
        let out =
            rt.block_on(compact(input, &bad, &settings(50), &CancellationToken::new(), &mut |_, _, _| {})).unwrap();
        assert!(matches!(out, Outcome::Kept { ref reason, .. } if reason.contains("quality audit")), "{out:?}");
        assert_eq!(bad.0.load(std::sync::atomic::Ordering::SeqCst), 2, "one generation, one regeneration");
    }
}
