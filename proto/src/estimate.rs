//! The token estimate: one function for every place that counts tokens.
//!
//! chars/4, with CJK characters weighted as one token each (they tokenise
//! far denser than Latin text), images at a flat 2000 tokens, and a
//! provider-reported usage count winning where the message has one.

use std::borrow::Cow;
use std::collections::HashSet;

use crate::pb::{AgentMessage, ContentPart, content_part::Part};

/// Tokens charged for one image reference.
pub const IMAGE_TOKENS: u64 = 2000;

/// Estimated tokens of a text.
pub fn text_tokens(text: &str) -> u64 {
    // Most text is ASCII: its length is its character count, and checking
    // that is a vectorised scan rather than a decode per character.
    if text.is_ascii() {
        return (text.len() as u64).div_ceil(4);
    }
    let (mut other, mut cjk) = (0u64, 0u64);
    for c in text.chars() {
        if is_cjk(c) { cjk += 1 } else { other += 1 }
    }
    other.div_ceil(4) + cjk
}

/// Estimated tokens of one message: the provider's output count when it
/// reported one, else the estimate of its parts.
pub fn message_tokens(message: &AgentMessage) -> u64 {
    if let Some(reported) = message.usage.as_ref().and_then(|u| u.output_tokens) {
        // Validation refuses more; clamped again so no path can overflow a sum.
        return reported.min(crate::limits::MAX_USAGE_TOKENS);
    }
    message
        .content
        .iter()
        .filter_map(|p| p.part.as_ref())
        .map(|part| match part {
            Part::Text(t) => text_tokens(t),
            Part::Thinking(t) => text_tokens(&t.text),
            Part::Image(_) => IMAGE_TOKENS,
            Part::ToolCall(c) => text_tokens(&c.name) + text_tokens(&c.arguments_json),
            Part::ToolResult(r) => text_tokens(&r.text),
        })
        .fold(0, u64::saturating_add)
}

/// Estimated tokens of a list of messages.
pub fn messages_tokens<'a>(messages: impl IntoIterator<Item = &'a AgentMessage>) -> u64 {
    messages.into_iter().map(message_tokens).fold(0, u64::saturating_add)
}

/// What of `messages` to assemble under `budget` tokens: the newest
/// messages that fit, and their estimate. A message with tool calls and
/// the tool results that follow it (answering those calls) are kept or
/// dropped together, so the model never sees a result without its call;
/// a tool result whose call precedes it nowhere in `messages` is dropped
/// first (and a message it leaves empty), as the contract refuses it. The
/// walk stops at the first unit that does not fit (the context stays one
/// contiguous run of the newest history). The newest unit is kept even
/// over the budget: the contract refuses an empty answer to a request with
/// history, and the caller sees the overflow in the estimate. No budget
/// keeps everything. The same rule is in every SDK, pinned by
/// `proto/testdata/budget.json`.
pub fn fit_budget(messages: &[AgentMessage], budget: Option<u64>) -> (Cow<'_, [AgentMessage]>, u64) {
    let messages = without_orphan_results(messages);
    let start = match budget {
        None => 0,
        Some(budget) => newest_that_fit(&messages, budget),
    };
    let tokens = messages_tokens(&messages[start..]);
    let kept = match messages {
        Cow::Borrowed(m) => Cow::Borrowed(&m[start..]),
        Cow::Owned(mut m) => {
            m.drain(..start);
            Cow::Owned(m)
        }
    };
    (kept, tokens)
}

/// Where the newest units that fit `budget` start.
fn newest_that_fit(messages: &[AgentMessage], budget: u64) -> usize {
    let (mut start, mut tokens) = (messages.len(), 0u64);
    while start > 0 {
        let unit = unit_start(messages, start - 1);
        let cost = messages_tokens(&messages[unit..start]);
        match tokens.checked_add(cost) {
            Some(total) if total <= budget || start == messages.len() => (start, tokens) = (unit, total),
            _ => break,
        }
    }
    start
}

/// `messages` without the tool results whose call precedes them nowhere
/// (borrowed when there are none): what `validate::first_orphan_result`
/// finds, in the same order.
fn without_orphan_results(messages: &[AgentMessage]) -> Cow<'_, [AgentMessage]> {
    /// Whether `p` is an orphan result, given the calls seen before it
    /// (noting `p` when it is a call).
    fn orphan<'a>(calls: &mut HashSet<&'a str>, p: &'a ContentPart) -> bool {
        match &p.part {
            Some(Part::ToolCall(c)) => {
                calls.insert(c.id.as_str());
                false
            }
            Some(Part::ToolResult(r)) => !calls.contains(r.tool_call_id.as_str()),
            _ => false,
        }
    }
    let mut calls = HashSet::new();
    if !messages.iter().flat_map(|m| &m.content).any(|p| orphan(&mut calls, p)) {
        return Cow::Borrowed(messages);
    }
    calls.clear();
    let mut kept = Vec::with_capacity(messages.len());
    for m in messages {
        let content: Vec<ContentPart> = m.content.iter().filter(|p| !orphan(&mut calls, p)).cloned().collect();
        if !content.is_empty() {
            kept.push(AgentMessage { content, ..m.clone() });
        }
    }
    Cow::Owned(kept)
}

/// Where the unit that ends at `last` starts: a tool result pulls it back
/// to the message holding its call, and so do the results between.
fn unit_start(messages: &[AgentMessage], last: usize) -> usize {
    let (mut start, mut i) = (last, last);
    loop {
        for part in &messages[i].content {
            if let Some(Part::ToolResult(r)) = &part.part
                && let Some(call) = messages[..i].iter().rposition(|m| holds_call(m, &r.tool_call_id))
            {
                start = start.min(call);
            }
        }
        if i <= start {
            return start;
        }
        i -= 1;
    }
}

fn holds_call(m: &AgentMessage, id: &str) -> bool {
    m.content.iter().any(|p| matches!(&p.part, Some(Part::ToolCall(c)) if c.id == id))
}

fn is_cjk(c: char) -> bool {
    matches!(c as u32,
        0x3040..=0x30FF      // Hiragana, Katakana
        | 0x3400..=0x4DBF    // CJK Extension A
        | 0x4E00..=0x9FFF    // CJK Unified Ideographs
        | 0xAC00..=0xD7AF    // Hangul syllables
        | 0xF900..=0xFAFF    // CJK Compatibility Ideographs
        | 0x20000..=0x2FA1F) // Extensions B..F, compatibility supplement
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::{ContentPart, ImageRef, Usage};

    fn msg(parts: Vec<Part>) -> AgentMessage {
        AgentMessage {
            id: "m".into(),
            role: 2,
            content: parts.into_iter().map(|p| ContentPart { part: Some(p) }).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn latin_text_is_chars_over_four_rounded_up() {
        assert_eq!(text_tokens(""), 0);
        assert_eq!(text_tokens("abcd"), 1);
        assert_eq!(text_tokens("abcde"), 2);
        // Characters, not bytes: four two-byte letters are one token.
        assert_eq!(text_tokens("éééé"), 1);
    }

    #[test]
    fn cjk_counts_one_token_per_character() {
        assert_eq!(text_tokens("日本語"), 3);
        assert_eq!(text_tokens("日本語abcd"), 4);
    }

    #[test]
    fn images_are_flat_and_usage_wins() {
        let mut m = msg(vec![Part::Image(ImageRef::default()), Part::Text("abcd".into())]);
        assert_eq!(message_tokens(&m), IMAGE_TOKENS + 1);
        m.usage = Some(Usage { output_tokens: Some(7), ..Default::default() });
        assert_eq!(message_tokens(&m), 7);
    }
}
