//! Turn arithmetic: where turns start, and cuts that never split a tool
//! call from its result.

use std::collections::HashSet;

use ctxgate_engine_sdk::estimate;
use ctxgate_engine_sdk::pb::{AgentMessage, Role, content_part::Part};

/// Indices where a turn starts: every user message (and index 0).
pub fn turn_starts(messages: &[AgentMessage]) -> Vec<usize> {
    let mut starts: Vec<usize> =
        messages.iter().enumerate().filter(|(_, m)| m.role == Role::User as i32).map(|(i, _)| i).collect();
    if starts.first() != Some(&0) && !messages.is_empty() {
        starts.insert(0, 0);
    }
    starts
}

/// The index from which the last `keep` turns start (0 if there are fewer),
/// moved later if needed so that no kept tool result is cut off from its
/// call.
pub fn keep_last_turns(messages: &[AgentMessage], keep: usize) -> usize {
    let starts = turn_starts(messages);
    let cut = if keep == 0 { messages.len() } else { starts.len().checked_sub(keep).map_or(0, |i| starts[i]) };
    safe_cut(messages, cut)
}

/// The first index `>= cut` at which starting the kept tail splits no pair.
pub fn safe_cut(messages: &[AgentMessage], mut cut: usize) -> usize {
    while cut < messages.len() && ctxgate_engine_sdk::validate::first_orphan_result(&messages[cut..]).is_some() {
        cut += 1;
    }
    cut
}

/// The newest whole turns of `messages` that fit `budget` tokens (the
/// newest turn always stays), never splitting a tool call from its result.
/// Linear: token counts are summed once from the end.
pub fn fit_turns(mut messages: Vec<AgentMessage>, budget: u64) -> Vec<AgentMessage> {
    let tokens: Vec<u64> = messages.iter().map(estimate::message_tokens).collect();
    let mut suffix = vec![0u64; messages.len() + 1];
    for i in (0..messages.len()).rev() {
        suffix[i] = suffix[i + 1].saturating_add(tokens[i]);
    }
    let starts = turn_starts(&messages);
    // The first turn start (oldest first) whose suffix fits; else the newest.
    let cut =
        starts.iter().copied().find(|&s| suffix[s] <= budget).unwrap_or_else(|| starts.last().copied().unwrap_or(0));
    let cut = safe_cut(&messages, cut).min(messages.len());
    if cut >= messages.len() && !messages.is_empty() {
        // Never empty: keep the newest turn even when it alone is over.
        let last = starts.last().copied().unwrap_or(0);
        messages.drain(..last);
        return messages;
    }
    messages.drain(..cut);
    messages
}

/// Drops messages made only of tool results whose call is not before them
/// (sanitising a history that arrived already split).
pub fn drop_orphan_results(messages: Vec<AgentMessage>) -> Vec<AgentMessage> {
    let mut calls = HashSet::new();
    let mut out = Vec::with_capacity(messages.len());
    for m in messages {
        let mut orphan_only = !m.content.is_empty();
        for p in &m.content {
            match &p.part {
                Some(Part::ToolCall(c)) => {
                    calls.insert(c.id.clone());
                    orphan_only = false;
                }
                Some(Part::ToolResult(r)) if calls.contains(&r.tool_call_id) => orphan_only = false,
                Some(Part::ToolResult(_)) => {}
                _ => orphan_only = false,
            }
        }
        if !orphan_only {
            out.push(m);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use ctxgate_engine_sdk::testkit::msg;

    #[test]
    fn fit_turns_keeps_the_newest_whole_turns_within_the_budget() {
        let ids = |v: Vec<AgentMessage>| v.into_iter().map(|m| m.id).collect::<Vec<_>>();
        let all: u64 = convo().iter().map(estimate::message_tokens).sum();
        assert_eq!(ids(fit_turns(convo(), all)).len(), 7, "everything fits");
        let last_two: u64 = convo()[4..].iter().map(estimate::message_tokens).sum();
        assert_eq!(ids(fit_turns(convo(), last_two)), ["u2", "a2", "u3"]);
        assert_eq!(ids(fit_turns(convo(), 0)), ["u3"], "the newest turn always stays");
    }

    fn convo() -> Vec<AgentMessage> {
        vec![
            msg::user("u1", "a"),
            msg::tool_call("c1", "k1", "read"),
            msg::tool_result("r1", "k1", "x"),
            msg::assistant("a1", "b"),
            msg::user("u2", "c"),
            msg::assistant("a2", "d"),
            msg::user("u3", "e"),
        ]
    }

    #[test]
    fn keeps_whole_turns() {
        let m = convo();
        assert_eq!(keep_last_turns(&m, 1), 6);
        assert_eq!(keep_last_turns(&m, 2), 4);
        assert_eq!(keep_last_turns(&m, 9), 0);
        assert_eq!(keep_last_turns(&m, 0), m.len());
    }

    #[test]
    fn a_cut_between_call_and_result_moves_past_the_result() {
        let m = convo();
        assert_eq!(safe_cut(&m, 2), 3);
        assert_eq!(safe_cut(&m, 1), 1);
    }

    #[test]
    fn orphan_results_are_dropped() {
        let m = convo()[2..].to_vec();
        let ids: Vec<_> = drop_orphan_results(m).into_iter().map(|m| m.id).collect();
        assert_eq!(ids, ["a1", "u2", "a2", "u3"]);
    }
}
