//! Reading a transcript branch: the visible history (latest compaction
//! summary + the entries it kept + everything after it) and how it is shown
//! to an engine.

use ctxgate_proto::pb::{self, AgentMessage, CompactionEntry, transcript_entry::Entry};

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

/// The visible history as the model sees it, straight from the branch:
/// `visible(branch).render()` with one copy of each message, not two (a
/// turn renders its whole history this way).
pub fn visible_messages(branch: &[pb::TranscriptEntry]) -> Vec<AgentMessage> {
    let (summary, parts) = split(branch);
    let mut out = Vec::with_capacity(parts[0].len() + parts[1].len() + 1);
    out.extend(summary.map(|(id, c)| summary_message(id, c)));
    out.extend(messages_in(parts).cloned());
    out
}

/// The index in the visible history (as rendered: a summary first) of the
/// first message `pick` chooses, else the history's length.
pub fn visible_index(branch: &[pb::TranscriptEntry], pick: impl Fn(&AgentMessage) -> bool) -> usize {
    let (summary, parts) = split(branch);
    let before = usize::from(summary.is_some());
    let mut shown = messages_in(parts);
    let at = shown.by_ref().position(pick);
    before + at.unwrap_or_else(|| messages_in(parts).count())
}

/// The latest compaction (its entry id and content), and the two runs of
/// entries visible with it: the kept ones before it and all after it.
type Split<'a> = (Option<(&'a str, &'a CompactionEntry)>, [&'a [pb::TranscriptEntry]; 2]);

fn split(branch: &[pb::TranscriptEntry]) -> Split<'_> {
    let latest = branch.iter().rposition(|e| matches!(e.entry, Some(Entry::Compaction(_))));
    let Some(ci) = latest else { return (None, [branch, &[]]) };
    let Some(Entry::Compaction(c)) = &branch[ci].entry else { unreachable!("rposition matched a compaction") };
    // Kept entries sit before the compaction entry, from first_kept onwards.
    let kept_from = branch[..ci].iter().position(|e| e.id == c.first_kept_entry_id).unwrap_or(ci);
    (Some((&branch[ci].id, c)), [&branch[kept_from..ci], &branch[ci + 1..]])
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

    fn msg(id: &str) -> pb::TranscriptEntry {
        pb::TranscriptEntry {
            id: id.into(),
            entry: Some(Entry::Message(AgentMessage { id: id.into(), role: 2, ..Default::default() })),
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

    /// The visible ids, checking that both renderings agree.
    fn ids(branch: &[pb::TranscriptEntry]) -> Vec<String> {
        let rendered = visible_messages(branch);
        assert_eq!(rendered, visible(branch).render());
        rendered.into_iter().map(|m| m.id).collect()
    }

    #[test]
    fn visible_is_latest_summary_plus_kept_plus_later() {
        let b =
            [msg("a"), msg("b"), msg("c"), compaction("s1", "b"), msg("d"), msg("e"), compaction("s2", "e"), msg("f")];
        assert_eq!(ids(&b), ["s2", "e", "f"]);
        assert_eq!(ids(&b[..6]), ["s1", "b", "c", "d", "e"]);
        assert_eq!(ids(&b[..3]), ["a", "b", "c"]);
        // Indices as rendered: the summary counts.
        assert_eq!(visible_index(&b, |m| m.id == "f"), 2);
        assert_eq!(visible_index(&b[..6], |m| m.id == "b"), 1);
        assert_eq!(visible_index(&b, |m| m.id == "a"), 3, "not visible: the length");
        // Everything summarised: only what came after.
        let all = [msg("a"), compaction("s", ""), msg("z")];
        assert_eq!(ids(&all), ["s", "z"]);
    }
}
