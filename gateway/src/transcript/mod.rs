//! Reading a transcript branch: the visible history (latest compaction
//! summary + the entries it kept + everything after it) and how it is shown
//! to an engine.

use std::ops::Range;
use std::sync::Arc;

use ctxgate_proto::pb::{self, AgentMessage, CompactionEntry, transcript_entry::Entry};

mod tail;
pub use tail::Tail;

/// What the model may see of a session.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Visible {
    /// The latest compaction entry's id and content, if any.
    pub summary: Option<(String, CompactionEntry)>,
    /// Messages after the summary, oldest first.
    pub messages: Vec<AgentMessage>,
}

/// The visible history of a branch (oldest first).
pub fn visible(branch: &[pb::TranscriptEntry]) -> Visible {
    let (summary, parts) = split(branch);
    Visible {
        summary: summary.map(|(id, c)| (id.to_owned(), c.clone())),
        messages: messages_in(parts).cloned().collect(),
    }
}

/// The visible history read in place: its messages stay the branch's (an
/// `Arc` of the store's cached tail), found by index. A turn reads its
/// whole history every turn, and copying it into the turn was half of a
/// legacy turn's CPU (docs/benchmarks-history.md, third session). While a turn holds one (through
/// its model call), another reader extending that session's cached tail
/// copies it first (`Arc::make_mut`); the session's lock makes that rare.
#[derive(Debug, Clone)]
pub struct SharedHistory {
    branch: Arc<Tail>,
    summary: Option<Box<AgentMessage>>,
    /// The runs of `branch` whose messages are shown after the summary:
    /// the kept ones before it and all after it. Ranges, not a list of
    /// messages, so a turn's view costs nothing per message until read.
    shown: [Range<usize>; 2],
}

impl SharedHistory {
    pub fn new(branch: Arc<Tail>) -> Self {
        let Some(ci) = branch.latest_compaction() else {
            let end = branch.len();
            return Self { shown: [0..end, end..end], branch, summary: None };
        };
        let Some(Entry::Compaction(c)) = &branch[ci].entry else { unreachable!("the tail's latest compaction") };
        // The kept entries end just before the compaction: look back from it.
        let kept = &c.first_kept_entry_id;
        let kept_from = if kept.is_empty() { None } else { branch[..ci].iter().rposition(|e| &e.id == kept) };
        let summary = Some(Box::new(summary_message(&branch[ci].id, c)));
        Self { shown: [kept_from.unwrap_or(ci)..ci, ci + 1..branch.len()], branch, summary }
    }

    fn len(&self) -> usize {
        let [kept, after] = &self.shown;
        usize::from(self.summary.is_some())
            + self.branch.messages_in(kept.clone())
            + self.branch.messages_in(after.clone())
    }

    /// The compaction summary shown first, if any (rendered here, not stored).
    pub fn summary(&self) -> Option<&AgentMessage> {
        self.summary.as_deref()
    }

    /// Where what is shown after the summary starts: entries from there on
    /// that are not shown are not messages (the compaction between the
    /// runs, and any before it), so the tail's kept figures from there
    /// are the shown messages' own. A kept run left with no message (its
    /// messages skipped, a compaction at its end) is passed over: the
    /// messages skipped before that compaction are not shown.
    fn first_shown(&self) -> usize {
        let [kept, after] = &self.shown;
        if self.branch.messages_in(kept.clone()) == 0 { after.start } else { kept.start }
    }

    /// The estimated tokens of what is shown (kept by the tail, not
    /// worked out again).
    pub fn tokens(&self) -> u64 {
        let summary = self.summary.as_deref().map_or(0, ctxgate_proto::estimate::message_tokens);
        summary.saturating_add(self.branch.tokens_from(self.first_shown()))
    }

    /// No message shown is empty and every tool result shown follows its
    /// call (the summary is text).
    pub fn is_clean(&self) -> bool {
        self.branch.clean_from(self.first_shown())
    }

    fn iter(&self) -> impl DoubleEndedIterator<Item = &AgentMessage> {
        let entries = self.shown.iter().flat_map(|r| self.branch[r.clone()].iter());
        let shown = entries.filter_map(|e| match &e.entry {
            Some(Entry::Message(m)) => Some(m),
            _ => None,
        });
        self.summary.as_deref().into_iter().chain(shown)
    }

    /// Drops the first `n` messages (the summary first).
    fn skip_first(&mut self, mut n: usize) {
        if n > 0 && self.summary.take().is_some() {
            n -= 1;
        }
        for run in &mut self.shown {
            let here = self.branch.messages_in(run.clone()).min(n);
            run.start = self.branch.skip_messages(run.clone(), here);
            n -= here;
        }
    }
}

/// A history a model is shown: shared with the store's cached tail, or the
/// turn's own (an engine's answer, or a shared one this prompt changes).
#[derive(Debug, Clone)]
pub enum Messages {
    Shared(SharedHistory),
    Owned(Vec<AgentMessage>),
}

impl Default for Messages {
    fn default() -> Self {
        Self::Owned(Vec::new())
    }
}

impl From<Vec<AgentMessage>> for Messages {
    fn from(v: Vec<AgentMessage>) -> Self {
        Self::Owned(v)
    }
}

impl Messages {
    pub fn len(&self) -> usize {
        match self {
            Self::Shared(s) => s.len(),
            Self::Owned(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn iter(&self) -> impl DoubleEndedIterator<Item = &AgentMessage> {
        let (shared, owned) = match self {
            Self::Shared(s) => (Some(s.iter()), None),
            Self::Owned(v) => (None, Some(v.iter())),
        };
        shared.into_iter().flatten().chain(owned.into_iter().flatten())
    }

    pub fn last(&self) -> Option<&AgentMessage> {
        self.iter().next_back()
    }

    /// The estimated tokens of these messages.
    pub fn tokens(&self) -> u64 {
        match self {
            Self::Shared(s) => s.tokens(),
            Self::Owned(v) => ctxgate_proto::estimate::messages_tokens(v),
        }
    }

    /// The messages to change: a shared history is copied first.
    pub fn to_mut(&mut self) -> &mut Vec<AgentMessage> {
        if let Self::Shared(_) = self {
            *self = Self::Owned(std::mem::take(self).into_vec());
        }
        match self {
            Self::Owned(v) => v,
            Self::Shared(_) => unreachable!("made owned above"),
        }
    }

    /// The messages as a list of their own (a copy, if shared).
    pub fn into_vec(self) -> Vec<AgentMessage> {
        match self {
            Self::Shared(s) => s.iter().cloned().collect(),
            Self::Owned(v) => v,
        }
    }

    /// Drops the first `n` messages.
    pub fn skip_first(&mut self, n: usize) {
        match self {
            Self::Shared(s) => s.skip_first(n),
            Self::Owned(v) => {
                v.drain(..n.min(v.len()));
            }
        }
    }
}

/// The index in the visible history (as rendered: a summary first) of the
/// first of the messages at its end that `pick` chooses, else the
/// history's length. Read from the end: a turn's own messages are the last
/// on the branch (the session is the turn's while it runs), so finding
/// where they start costs what the turn added, not the session's age.
pub fn index_of_last_run(tail: &Arc<Tail>, pick: impl Fn(&AgentMessage) -> bool) -> usize {
    let shown = Messages::Shared(SharedHistory::new(tail.clone()));
    shown.len() - shown.iter().rev().take_while(|m| pick(m)).count()
}

/// The latest compaction (its entry id and content), and the two runs of
/// entries visible with it: the kept ones before it and all after it.
type Split<'a> = (Option<(&'a str, &'a CompactionEntry)>, [&'a [pb::TranscriptEntry]; 2]);

fn split(branch: &[pb::TranscriptEntry]) -> Split<'_> {
    let (summary, [kept, after]) = split_at(branch);
    (summary.map(|(ci, c)| (branch[ci].id.as_str(), c)), [&branch[kept], &branch[after]])
}

/// [`split`] as positions: the latest compaction (its index and content),
/// and the ranges of the kept entries before it and of all after it.
type SplitAt<'a> = (Option<(usize, &'a CompactionEntry)>, [std::ops::Range<usize>; 2]);

fn split_at(branch: &[pb::TranscriptEntry]) -> SplitAt<'_> {
    let latest = branch.iter().rposition(|e| matches!(e.entry, Some(Entry::Compaction(_))));
    let Some(ci) = latest else { return (None, [0..branch.len(), 0..0]) };
    let Some(Entry::Compaction(c)) = &branch[ci].entry else { unreachable!("rposition matched a compaction") };
    // Kept entries sit before the compaction entry, from first_kept onwards.
    let kept_from = branch[..ci].iter().position(|e| e.id == c.first_kept_entry_id).unwrap_or(ci);
    (Some((ci, c)), [kept_from..ci, ci + 1..branch.len()])
}

fn messages_in(parts: [&[pb::TranscriptEntry]; 2]) -> impl Iterator<Item = &AgentMessage> {
    parts.into_iter().flatten().filter_map(|e| match &e.entry {
        Some(Entry::Message(m)) => Some(m),
        _ => None,
    })
}

/// A summary as the user message a model is shown (its id is the
/// compaction entry's).
fn summary_message(id: &str, c: &CompactionEntry) -> AgentMessage {
    AgentMessage {
        id: id.to_owned(),
        role: pb::Role::User as i32,
        content: vec![pb::ContentPart {
            part: Some(pb::content_part::Part::Text(format!("{SUMMARY_PREFIX}{}", c.summary))),
        }],
        metadata: [("ctxgate.kind".to_owned(), "compaction-summary".to_owned())].into(),
        ..Default::default()
    }
}

/// The prefix the gateway puts before a summary when it shows it to a model.
pub const SUMMARY_PREFIX: &str = "[Summary of the earlier conversation]\n";

impl Visible {
    /// The history as messages: the summary (a user message whose id is the
    /// compaction entry's) followed by the kept and later messages.
    pub fn render(&self) -> Vec<AgentMessage> {
        let mut out = Vec::with_capacity(self.messages.len() + 1);
        if let Some((id, c)) = &self.summary {
            out.push(summary_message(id, c));
        }
        out.extend(self.messages.iter().cloned());
        out
    }

    pub fn tokens(&self) -> u64 {
        ctxgate_proto::estimate::messages_tokens(&self.render())
    }
}

/// The entries behind the visible history, in the order the model sees
/// them: the latest compaction entry, then the kept and later messages.
pub fn visible_entries(branch: &[pb::TranscriptEntry]) -> Vec<pb::TranscriptEntry> {
    let v = visible(branch);
    let kept: std::collections::HashSet<&str> = v.messages.iter().map(|m| m.id.as_str()).collect();
    let summary = v.summary.as_ref().and_then(|(id, _)| branch.iter().find(|e| &e.id == id));
    // By message id: a rewrite's copies have new entry ids but keep it.
    let shown = |e: &&pb::TranscriptEntry| matches!(&e.entry, Some(Entry::Message(m)) if kept.contains(m.id.as_str()));
    summary.into_iter().chain(branch.iter().filter(shown)).cloned().collect()
}

/// `entries` (from [`visible_entries`]) as the model sees them: a
/// compaction entry as its summary message.
pub fn render_entries(entries: &[pb::TranscriptEntry]) -> Vec<AgentMessage> {
    entries
        .iter()
        .filter_map(|e| match &e.entry {
            Some(Entry::Message(m)) => Some(m.clone()),
            Some(Entry::Compaction(c)) => Some(summary_message(&e.id, c)),
            None => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A message whose text is its id said a few times (so each has tokens).
    fn msg(id: &str) -> pb::TranscriptEntry {
        let text = pb::ContentPart { part: Some(pb::content_part::Part::Text(format!("{id} ").repeat(8))) };
        pb::TranscriptEntry {
            id: id.into(),
            entry: Some(Entry::Message(AgentMessage {
                id: id.into(),
                role: 2,
                content: vec![text],
                ..Default::default()
            })),
            ..Default::default()
        }
    }

    fn compaction(id: &str, first_kept: &str) -> pb::TranscriptEntry {
        pb::TranscriptEntry {
            id: id.into(),
            entry: Some(Entry::Compaction(CompactionEntry {
                summary: id.into(),
                first_kept_entry_id: first_kept.into(),
                ..Default::default()
            })),
            ..Default::default()
        }
    }

    /// The visible ids, checking that both renderings agree (the shared
    /// one reads the same messages in place).
    fn ids(branch: &[pb::TranscriptEntry]) -> Vec<String> {
        let rendered = visible(branch).render();
        let shared = Messages::Shared(SharedHistory::new(Arc::new(Tail::from(branch.to_vec()))));
        assert_eq!(shared.len(), rendered.len());
        assert_eq!(shared.clone().into_vec(), rendered);
        assert_eq!(shared.last(), rendered.last());
        assert_eq!(shared.tokens(), ctxgate_proto::estimate::messages_tokens(&rendered));
        // Dropping any number of first messages reads what is left in place.
        for n in 0..=rendered.len() + 1 {
            let mut rest = shared.clone();
            rest.skip_first(n);
            let left = &rendered[n.min(rendered.len())..];
            assert!(matches!(rest, Messages::Shared(_)));
            assert_eq!((rest.len(), rest.clone().into_vec()), (left.len(), left.to_vec()), "after skipping {n}");
            assert_eq!(rest.tokens(), ctxgate_proto::estimate::messages_tokens(left), "after skipping {n}");
        }
        rendered.into_iter().map(|m| m.id).collect()
    }

    /// A shared history drops its first messages (the summary first) and
    /// is copied only when changed — the branch it reads stays as it was.
    #[test]
    fn a_shared_history_skips_and_copies_on_change_only() {
        let branch = Arc::new(Tail::from(vec![msg("a"), msg("b"), compaction("s", "b"), msg("c"), msg("d")]));
        let ids = |m: &Messages| m.iter().map(|m| m.id.clone()).collect::<Vec<_>>();
        let mut m = Messages::Shared(SharedHistory::new(branch.clone()));
        assert_eq!(ids(&m), ["s", "b", "c", "d"]);
        m.skip_first(2);
        assert_eq!(ids(&m), ["c", "d"]);
        assert!(matches!(m, Messages::Shared(_)), "skipping copies nothing");
        m.to_mut().push(AgentMessage { id: "e".into(), ..Default::default() });
        assert_eq!(ids(&m), ["c", "d", "e"]);
        assert_eq!(branch.len(), 5, "the branch is not changed");
        let mut owned = Messages::from(vec![AgentMessage { id: "x".into(), ..Default::default() }]);
        owned.skip_first(5);
        assert!(owned.is_empty());
    }

    #[test]
    fn visible_is_latest_summary_plus_kept_plus_later() {
        let b =
            [msg("a"), msg("b"), msg("c"), compaction("s1", "b"), msg("d"), msg("e"), compaction("s2", "e"), msg("f")];
        assert_eq!(ids(&b), ["s2", "e", "f"]);
        assert_eq!(ids(&b[..6]), ["s1", "b", "c", "d", "e"]);
        assert_eq!(ids(&b[..3]), ["a", "b", "c"]);
        // Indices as rendered: the summary counts.
        let last_run = |b: &[pb::TranscriptEntry], ids: &[&str]| {
            index_of_last_run(&Arc::new(Tail::from(b.to_vec())), |m| ids.contains(&m.id.as_str()))
        };
        assert_eq!(last_run(&b, &["f"]), 2);
        assert_eq!(last_run(&b[..6], &["d", "e"]), 3);
        assert_eq!(last_run(&b[..6], &["b", "c", "d", "e"]), 1, "kept messages before the summary count");
        assert_eq!(last_run(&b, &["a"]), 3, "not visible: the length");
        // Everything summarised: only what came after.
        let all = [msg("a"), compaction("s", ""), msg("z")];
        assert_eq!(ids(&all), ["s", "z"]);
        // An older compaction among the kept entries is not shown.
        let nested = [msg("a"), compaction("s1", "a"), msg("b"), compaction("s2", "a"), msg("c"), msg("d")];
        assert_eq!(ids(&nested), ["s2", "a", "b", "c", "d"]);
        assert_eq!(ids(&nested[..4]), ["s2", "a", "b"]);
        // Two compactions in a row: the kept run ends in one that is not
        // shown, so skipping its messages leaves none of them counted.
        let twice = [msg("a"), compaction("s1", "a"), compaction("s2", "a"), msg("c"), msg("d")];
        assert_eq!(ids(&twice), ["s2", "a", "c", "d"]);
    }
}
