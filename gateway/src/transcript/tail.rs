//! A session's visible tail as the store hands it out, with what every
//! turn would otherwise work out from all of it again: each message's
//! token estimate (kept as running sums) and where tool results find their
//! calls. A long session's turn spent a third of its CPU redoing both over
//! the whole history (docs/benchmarks-history.md, fourth session); the tail only grows at its end,
//! so each is worked out once per entry, as it is added.

use std::ops::Deref;

use ctxgate_proto::estimate;
use ctxgate_proto::pb::{self, content_part::Part, transcript_entry::Entry};

#[derive(Debug, Clone, PartialEq)]
pub struct Tail {
    entries: Vec<pb::TranscriptEntry>,
    /// `tokens[i]`: the estimated tokens of the messages in `entries[..i]`.
    tokens: Vec<u64>,
    /// What a prompt starting at some entry could break on, in entry
    /// order: `(at, call)` for a tool result at `at` whose call is at
    /// `call` (the nearest before it), `None` for one whose call is not in
    /// the tail and for an empty message. A window starting at `s` holds
    /// it whole if `s > at` or `s <= call`.
    hazards: Vec<(u32, Option<u32>)>,
    /// Where the entries that are not messages (compactions) sit, in
    /// order: few, so a history shown from the tail is a pair of ranges
    /// whose messages are counted and skipped without reading them.
    others: Vec<u32>,
}

impl Default for Tail {
    fn default() -> Self {
        Self { entries: Vec::new(), tokens: vec![0], hazards: Vec::new(), others: Vec::new() }
    }
}

impl From<Vec<pb::TranscriptEntry>> for Tail {
    fn from(entries: Vec<pb::TranscriptEntry>) -> Self {
        let mut tail = Self::default();
        tail.extend(entries);
        tail
    }
}

impl Deref for Tail {
    type Target = [pb::TranscriptEntry];

    fn deref(&self) -> &Self::Target {
        &self.entries
    }
}

impl Tail {
    /// Adds newer entries at the end.
    pub fn extend(&mut self, newer: impl IntoIterator<Item = pb::TranscriptEntry>) {
        for e in newer {
            let at = self.entries.len();
            let tokens = match &e.entry {
                Some(Entry::Message(m)) => {
                    if m.content.is_empty() {
                        self.hazards.push((at as u32, None));
                    }
                    for (j, p) in m.content.iter().enumerate() {
                        if let Some(Part::ToolResult(r)) = &p.part {
                            let call = self.call_before(at, j, m, &r.tool_call_id);
                            self.hazards.push((at as u32, call.map(|c| c as u32)));
                        }
                    }
                    estimate::message_tokens(m)
                }
                _ => {
                    self.others.push(at as u32);
                    0
                }
            };
            let before = self.tokens[at];
            self.tokens.push(before.saturating_add(tokens));
            self.entries.push(e);
        }
    }

    /// Where the nearest call `id` before part `j` of `m` (at `at`) is:
    /// usually the message just before.
    fn call_before(&self, at: usize, j: usize, m: &pb::AgentMessage, id: &str) -> Option<usize> {
        let is_call = |p: &pb::ContentPart| matches!(&p.part, Some(Part::ToolCall(c)) if c.id == id);
        if m.content[..j].iter().any(is_call) {
            return Some(at);
        }
        self.entries.iter().rposition(|e| matches!(&e.entry, Some(Entry::Message(m)) if m.content.iter().any(is_call)))
    }

    /// The estimated tokens of the messages from entry `from` on.
    pub fn tokens_from(&self, from: usize) -> u64 {
        let end = self.tokens[self.entries.len()];
        end.saturating_sub(self.tokens[from.min(self.entries.len())])
    }

    /// Whether the messages from entry `from` on are fit to show as they
    /// are: none empty, and every tool result's call among them, before it
    /// (`validate::first_orphan_result` finds none).
    pub fn clean_from(&self, from: usize) -> bool {
        let in_window = self.hazards.iter().rev().take_while(|(at, _)| *at as usize >= from);
        in_window.into_iter().all(|(_, call)| call.is_some_and(|c| c as usize >= from))
    }

    /// The latest compaction entry's index.
    pub fn latest_compaction(&self) -> Option<usize> {
        let others = self.others.iter().rev().map(|&i| i as usize);
        others.into_iter().find(|&i| matches!(self.entries[i].entry, Some(Entry::Compaction(_))))
    }

    /// The entries that are not messages from `from` on, in order.
    fn others_from(&self, from: usize) -> impl Iterator<Item = usize> + '_ {
        let first = self.others.partition_point(|&o| (o as usize) < from);
        self.others[first..].iter().map(|&o| o as usize)
    }

    /// How many messages are in `range`.
    pub fn messages_in(&self, range: std::ops::Range<usize>) -> usize {
        let others = self.others_from(range.start).take_while(|&o| o < range.end).count();
        range.len().saturating_sub(others)
    }

    /// Where `range` starts once its first `n` messages are dropped (its
    /// end, when it holds no more).
    pub fn skip_messages(&self, range: std::ops::Range<usize>, n: usize) -> usize {
        let mut at = range.start.saturating_add(n);
        // Each entry that is not a message before `at` moves it one on.
        for o in self.others_from(range.start) {
            if o >= at {
                break;
            }
            at += 1;
        }
        at.min(range.end)
    }

    /// The heap its bookkeeping (not its entries) costs per entry and hazard.
    pub fn bookkeeping_bytes(&self) -> usize {
        self.tokens.capacity() * size_of::<u64>()
            + self.hazards.capacity() * size_of::<(u32, Option<u32>)>()
            + self.others.capacity() * size_of::<u32>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ctxgate_proto::validate;

    fn message(id: &str, parts: Vec<Part>) -> pb::TranscriptEntry {
        let content = parts.into_iter().map(|p| pb::ContentPart { part: Some(p) }).collect();
        let m = pb::AgentMessage { id: id.into(), role: pb::Role::User as i32, content, ..Default::default() };
        pb::TranscriptEntry { id: id.into(), entry: Some(Entry::Message(m)), ..Default::default() }
    }

    fn call(id: &str) -> Part {
        Part::ToolCall(pb::ToolCall { id: id.into(), name: "t".into(), ..Default::default() })
    }

    fn result(id: &str) -> Part {
        Part::ToolResult(pb::ToolResult { tool_call_id: id.into(), text: "r".into(), ..Default::default() })
    }

    fn messages(entries: &[pb::TranscriptEntry]) -> Vec<&pb::AgentMessage> {
        entries
            .iter()
            .filter_map(|e| match &e.entry {
                Some(Entry::Message(m)) => Some(m),
                _ => None,
            })
            .collect()
    }

    /// From every start, built whole or entry by entry, the kept figures
    /// agree with working them out from the messages again.
    #[test]
    fn the_kept_figures_agree_with_a_fresh_look_from_every_start() {
        let entries = vec![
            message("a", vec![Part::Text("hello there".into())]),
            message("b", vec![call("c1"), Part::Text("calling".into())]),
            message("c", vec![result("c1")]),
            message("d", vec![call("c2"), result("c2"), result("c9")]),
            pb::TranscriptEntry {
                id: "s".into(),
                entry: Some(Entry::Compaction(pb::CompactionEntry::default())),
                ..Default::default()
            },
            message("e", vec![]),
            message("f", vec![call("c3")]),
            message("g", vec![result("c3"), result("c1")]),
            message("h", vec![Part::Text("ünïcode and 漢字".into())]),
        ];
        let whole = Tail::from(entries.clone());
        let mut grown = Tail::default();
        for e in entries.iter().cloned() {
            grown.extend([e]);
        }
        assert_eq!(whole, grown);
        for from in 0..=entries.len() {
            let shown = messages(&entries[from..]);
            assert_eq!(whole.tokens_from(from), estimate::messages_tokens(shown.iter().copied()), "from {from}");
            let clean = shown.iter().all(|m| !m.content.is_empty())
                && validate::first_orphan_result(shown.iter().copied()).is_none();
            assert_eq!(whole.clean_from(from), clean, "from {from}");
        }
        assert!(!whole.clean_from(0), "c9 has no call");
        assert!(!whole.clean_from(6), "g answers c1, whose call is before the window");
        assert!(whole.clean_from(8));
    }
}
