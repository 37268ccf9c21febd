//! What both backends compute the same way, written once: ids and the
//! clock, entry kinds, the column lists their row readers take, decoding a
//! stored body, where appended entries go, a closed turn's commit range,
//! what a rewind carries over, and a rewrite's plan and copies. Pure
//! functions: the backends read what they need, call these, and write
//! what comes back.

use std::ops::ControlFlow;
use std::time::{SystemTime, UNIX_EPOCH};

use ctxgate_proto::pb::{self, AgentMessage, transcript_entry::Entry};
use prost::Message as _;

use super::{CommitDraft, NewEntry, PageOutcome, PageRequest, RewriteOutcome, StoreError};

pub(super) const KIND_MESSAGE: i64 = 1;
pub(super) const KIND_COMPACTION: i64 = 2;

/// A session row's columns, in the order the backends' `read_session`
/// takes them.
pub(super) const SESSION_COLS: &str = "session_id, agent_id, session_key, state, created_at_ms";

/// A subagent row's columns, in the order the backends' `read_subagent`
/// takes them.
pub(super) const SUBAGENT_COLS: &str = "agent_id, child_key, parent_key, rollback_token, expires_at_ms";

/// A listed commit's columns and where they come from (`o`, the outbox, and
/// `s`, its session), in the order the backends' outbox row readers take
/// them; a query adds its filter and order.
pub(super) const OUTBOX_COLS: &str =
    "s.agent_id, s.session_key, o.session_id, o.advancement_key, o.engine_id, o.attempts,
    o.last_error, o.next_attempt_ms, o.created_at_ms FROM outbox o JOIN sessions s USING (session_id)";

pub(super) fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

/// A new entry's (or session's) id: a version 7 UUID, so ids written one
/// after the other sort together (their index grows at its end instead
/// of at a random page per insert, and a session's recent entries share
/// pages).
pub(super) fn new_id() -> String {
    uuid::Uuid::now_v7().simple().to_string()
}

pub(super) fn kind_of(e: &pb::TranscriptEntry) -> i64 {
    if matches!(e.entry, Some(Entry::Compaction(_))) { KIND_COMPACTION } else { KIND_MESSAGE }
}

/// A stored entry's body.
pub(super) fn decode_entry(body: &[u8]) -> Result<pb::TranscriptEntry, StoreError> {
    pb::TranscriptEntry::decode(body).map_err(|e| StoreError::Backend(format!("a stored entry does not decode: {e}")))
}

/// A queued commit's payload.
pub(super) fn decode_commit(body: &[u8]) -> Result<pb::CommitTurnRequest, StoreError> {
    pb::CommitTurnRequest::decode(body)
        .map_err(|e| StoreError::Backend(format!("a queued commit does not decode: {e}")))
}

/// Appended entries as they are stored, and the session's head after them.
pub(super) struct Placed {
    pub(super) entries: Vec<pb::TranscriptEntry>,
    /// The new leaf (the old one when nothing was appended).
    pub(super) leaf: Option<String>,
    pub(super) next_seq: i64,
}

/// Where appended entries go: each gets a fresh id, the previous one (at
/// first the session's `leaf`) as its parent, and the next seq from `seq`.
pub(super) fn place(entries: Vec<NewEntry>, leaf: Option<String>, seq: i64) -> Placed {
    let (mut parent, mut seq) = (leaf, seq);
    let mut out = Vec::with_capacity(entries.len());
    for e in entries {
        let id = new_id();
        let entry = match e.entry {
            Entry::Message(mut m) => {
                // A stored message's id is its entry id: engines key
                // idempotency and rewrites by it.
                m.id = id.clone();
                Entry::Message(m)
            }
            c @ Entry::Compaction(_) => c,
        };
        out.push(pb::TranscriptEntry {
            id: id.clone(),
            parent_id: parent.clone(),
            seq: seq as u64,
            turn_id: e.turn_id,
            entry: Some(entry),
        });
        parent = Some(id);
        seq += 1;
    }
    Placed { entries: out, leaf: parent, next_seq: seq }
}

/// Whether a cursor names this entry: a message by its id (stable across
/// rewrites, whose copies get new seqs), or a summary by its entry id.
pub(super) fn is_cursor_entry(e: &pb::TranscriptEntry, cursor: &pb::HistoryCursor) -> bool {
    e.id == cursor.message_id || matches!(&e.entry, Some(Entry::Message(m)) if m.id == cursor.message_id)
}

/// Walking back from the branch's leaf to a cursor, whether this entry
/// ends the walk: `Some(true)` when the entries walked before it are what
/// follows the cursor's message, `Some(false)` when that message is not on
/// the branch. Seqs fall walking towards the root (a rewrite's copies get
/// higher ones than the entry they branch from), so an entry at or below
/// the cursor's seq is one the cursor holds; an empty cursor names no
/// message and holds what its seq says.
pub(super) fn ends_walk_to(cursor: &pb::HistoryCursor, e: &pb::TranscriptEntry) -> Option<bool> {
    let anonymous = cursor.message_id.is_empty();
    if !anonymous && is_cursor_entry(e, cursor) {
        return Some(true);
    }
    (e.seq <= cursor.seq).then_some(anonymous)
}

/// The walk of [`ends_walk_to`] over entries read one at a time, for
/// [`crate::store::Cursors::branch_after`].
pub(super) struct AfterCursor<'a> {
    cursor: &'a pb::HistoryCursor,
    /// Newest first, as walked.
    after: Vec<pb::TranscriptEntry>,
}

impl<'a> AfterCursor<'a> {
    pub(super) fn new(cursor: &'a pb::HistoryCursor) -> Self {
        Self { cursor, after: Vec::new() }
    }

    /// Takes the next entry back from the leaf; breaks with the answer
    /// once it is known: what follows the cursor's message, oldest first,
    /// or `None` when its message is not on the branch.
    pub(super) fn take(&mut self, e: pb::TranscriptEntry) -> ControlFlow<Option<Vec<pb::TranscriptEntry>>> {
        match ends_walk_to(self.cursor, &e) {
            Some(on_branch) => ControlFlow::Break(on_branch.then(|| self.finish())),
            None => {
                self.after.push(e);
                ControlFlow::Continue(())
            }
        }
    }

    /// The answer once the walk reached the branch's root: only an empty
    /// cursor holds nothing of it.
    pub(super) fn at_root(mut self) -> Option<Vec<pb::TranscriptEntry>> {
        self.cursor.message_id.is_empty().then(|| self.finish())
    }

    fn finish(&mut self) -> Vec<pb::TranscriptEntry> {
        let mut after = std::mem::take(&mut self.after);
        after.reverse();
        after
    }
}

/// A closed turn's CommitTurn: `range` is the branch from its leaf back to
/// the turn's first admitted entry (newest first, as walked).
pub(super) fn commit_request(draft: CommitDraft, mut range: Vec<pb::TranscriptEntry>) -> pb::CommitTurnRequest {
    range.reverse();
    let mut req = draft.request;
    req.messages = range
        .iter()
        .filter_map(|e| match &e.entry {
            Some(Entry::Message(m)) => Some(m.clone()),
            _ => None,
        })
        .collect();
    // The terminal anchor is the turn's last message (a compaction entry
    // may follow it on the branch).
    if let Some(last) = range.iter().rev().find(|e| matches!(e.entry, Some(Entry::Message(_)))) {
        let mut terminal = req.admission.as_ref().and_then(|a| a.anchor.clone()).unwrap_or_default();
        terminal.entry_id = last.id.clone();
        terminal.raw_seq = last.seq;
        terminal.effective_parent_id = last.parent_id.clone();
        terminal.active_message_position += req.messages.len().saturating_sub(1) as u64;
        req.terminal = Some(terminal);
    }
    req
}

/// What a rewind puts back on the anchor: `tail` is the branch from the
/// leaf back to the anchor (newest first). `None` when the turn added no
/// message (nothing to rewind); else the compactions made during the turn
/// that keep from no dropped message, oldest first.
pub(super) fn rewind_carries(mut tail: Vec<pb::TranscriptEntry>) -> Option<Vec<NewEntry>> {
    tail.pop();
    tail.reverse();
    let dropped: std::collections::HashSet<&str> =
        tail.iter().filter(|e| matches!(e.entry, Some(Entry::Message(_)))).map(|e| e.id.as_str()).collect();
    if dropped.is_empty() {
        return None;
    }
    let carried = tail
        .iter()
        .filter_map(|e| match &e.entry {
            Some(Entry::Compaction(cmp)) if !dropped.contains(cmp.first_kept_entry_id.as_str()) => {
                Some(NewEntry { turn_id: e.turn_id.clone(), entry: Entry::Compaction(cmp.clone()) })
            }
            _ => None,
        })
        .collect();
    Some(carried)
}

/// A rewrite worked out from the branch it applies to: the copies to
/// append (ids, parents and seqs assigned) and what it did.
pub(super) struct RewritePlan {
    pub(super) entries: Vec<pb::TranscriptEntry>,
    pub(super) outcome: RewriteOutcome,
}

impl RewritePlan {
    /// The new leaf and the session's next seq after the copies.
    pub(super) fn leaf_and_next_seq(&self, seq: i64) -> (Option<String>, i64) {
        (self.entries.last().map(|e| e.id.clone()), seq + self.entries.len() as i64)
    }
}

/// Plans a rewrite of `branch` (read before the write transaction; `leaf`
/// and `seq` are the session's as the transaction sees them). `Err` is
/// the outcome when nothing changes, with its reason.
pub(super) fn plan_rewrite(
    branch: &[pb::TranscriptEntry],
    replacements: Vec<(String, AgentMessage)>,
    leaf: Option<&str>,
    mut seq: i64,
) -> Result<RewritePlan, RewriteOutcome> {
    let kept = |reason: &str| RewriteOutcome { reason: reason.into(), ..Default::default() };
    let wanted: std::collections::HashMap<String, AgentMessage> =
        replacements.into_iter().filter(|(id, _)| !id.trim().is_empty()).collect();
    if wanted.is_empty() {
        return Err(kept("no replacements requested"));
    }
    if branch.is_empty() {
        return Err(kept("empty session"));
    }
    // Matches by message id, only where the content really changes.
    let matched = |e: &pb::TranscriptEntry| match &e.entry {
        Some(Entry::Message(m)) => wanted.get(&m.id).filter(|new| new.content != m.content),
        _ => None,
    };
    let Some(first) = branch.iter().position(|e| matched(e).is_some()) else {
        return Err(kept("no changed matching message entries"));
    };
    // The leaf moved since the branch was read: someone appended; let them win.
    if leaf != branch.last().map(|e| e.id.as_str()) {
        return Err(kept("the branch changed while rewriting"));
    }
    let mut parent = branch[first].parent_id.clone();
    let mut remap = std::collections::HashMap::new();
    let (mut freed, mut rewritten) = (0i64, 0u32);
    let mut entries = Vec::new();
    for old in &branch[first..] {
        let id = new_id();
        remap.insert(old.id.clone(), id.clone());
        let entry = match (&old.entry, matched(old)) {
            (Some(Entry::Message(m)), Some(new)) => {
                freed += ctxgate_proto::validate::content_bytes(m) as i64
                    - ctxgate_proto::validate::content_bytes(new) as i64;
                rewritten += 1;
                // Engines know messages by id: the replacement keeps it.
                Entry::Message(AgentMessage { id: m.id.clone(), ..new.clone() })
            }
            (Some(Entry::Compaction(cmp)), _) => {
                let mut cmp = cmp.clone();
                if let Some(n) = remap.get(&cmp.first_kept_entry_id) {
                    cmp.first_kept_entry_id = n.clone();
                }
                Entry::Compaction(cmp)
            }
            (Some(other), None) => other.clone(),
            (None, _) => continue,
        };
        entries.push(pb::TranscriptEntry {
            id: id.clone(),
            parent_id: parent.clone(),
            seq: seq as u64,
            turn_id: old.turn_id.clone(),
            entry: Some(entry),
        });
        parent = Some(id);
        seq += 1;
    }
    let outcome = RewriteOutcome {
        changed: true,
        bytes_freed: freed,
        rewritten_entries: rewritten,
        reason: String::new(),
        remap,
    };
    Ok(RewritePlan { entries, outcome })
}

/// Which ids of a branch a page reads. `chain` is the branch oldest first,
/// each entry's id with its stored size. `Err` is the outcome to answer
/// when a named entry is not on the branch.
pub(crate) fn plan_page(chain: &[(String, usize)], page: &PageRequest) -> Result<(Vec<String>, bool), PageOutcome> {
    let position = |id: &str| chain.iter().position(|(e, _)| e == id);
    let start = match &page.after {
        Some(a) => position(a).ok_or(PageOutcome::UnknownAfter)? + 1,
        None => 0,
    };
    let end = match &page.until {
        Some(u) => position(u).ok_or(PageOutcome::UnknownUntil)?,
        None => chain.len(),
    };
    let rest = chain.get(start..end.max(start)).unwrap_or_default();
    let (mut bytes, mut ids) = (0usize, Vec::new());
    for (id, size) in rest.iter().take(page.limit.max(1)) {
        bytes = bytes.saturating_add(*size);
        if !ids.is_empty() && bytes > page.max_bytes {
            break;
        }
        ids.push(id.clone());
    }
    let more = ids.len() < rest.len();
    Ok((ids, more))
}

/// The page's entries in `ids`' order, from bodies read in any order.
pub(super) fn order_page(
    ids: &[String],
    mut bodies: std::collections::HashMap<String, Vec<u8>>,
) -> Result<Vec<pb::TranscriptEntry>, StoreError> {
    ids.iter()
        .map(|id| {
            let body = bodies
                .remove(id)
                .ok_or_else(|| StoreError::Backend(format!("entry {id} vanished while its page was read")))?;
            decode_entry(&body)
        })
        .collect()
}
