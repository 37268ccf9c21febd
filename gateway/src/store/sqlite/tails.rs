//! The last visible tail read per session, so the next turn's read walks
//! only the entries appended since (a turn reads its session's visible
//! history once; walking and decoding all of it from SQLite was half of a
//! long session's turn).
//!
//! Entries never change once written (a rewrite writes new ones), so a
//! cached tail is valid for as long as its leaf is an ancestor of the
//! session's leaf; the walk splices it in when it meets that leaf, and
//! otherwise (a rewind, a rewrite, a compaction in the new part) simply
//! reads on as it would without a cache. Bounded by encoded bytes; the
//! least recently stored tails go first. A deleted session's tail is
//! dropped with it.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use ctxgate_proto::pb;
use prost::Message as _;

/// Encoded bytes of cached entries, all sessions together.
const MAX_BYTES: usize = 16 * 1024 * 1024;

/// A session's tail as the cache hands it out and takes it back.
pub(super) struct Cached {
    pub entries: Arc<Vec<pb::TranscriptEntry>>,
    /// Their encoded size: a reader that extends a tail adds the new
    /// entries' sizes (measuring the whole tail on every put cost a long
    /// session's turn more than the walk it saves).
    pub bytes: usize,
}

impl Cached {
    /// Entries read fresh, measured.
    pub(super) fn measure(entries: Vec<pb::TranscriptEntry>) -> Self {
        Self { bytes: encoded_size(&entries), entries: Arc::new(entries) }
    }

    /// Extends the tail in place (copied only while another reader still
    /// holds it).
    pub(super) fn extend(&mut self, newer: Vec<pb::TranscriptEntry>) {
        self.bytes += encoded_size(&newer);
        Arc::make_mut(&mut self.entries).extend(newer);
    }
}

fn encoded_size(entries: &[pb::TranscriptEntry]) -> usize {
    entries.iter().map(|e| e.encoded_len()).sum()
}

struct Tail {
    entries: Arc<Vec<pb::TranscriptEntry>>,
    bytes: usize,
    /// When it was stored: `order` entries with another number are stale.
    stored: u64,
}

#[derive(Default)]
pub(super) struct Tails {
    by_session: HashMap<String, Tail>,
    /// (session, when stored), oldest first; stale pairs are skipped.
    order: VecDeque<(String, u64)>,
    bytes: usize,
    clock: u64,
}

impl Tails {
    /// Takes the session's cached tail (oldest entry first), if any: the
    /// reader extends it in place and puts it back.
    pub(super) fn take(&mut self, session_id: &str) -> Option<Cached> {
        let tail = self.by_session.remove(session_id)?;
        self.bytes -= tail.bytes;
        Some(Cached { entries: tail.entries, bytes: tail.bytes })
    }

    pub(super) fn put(&mut self, session_id: &str, tail: Cached) {
        let Cached { entries, bytes } = tail;
        self.take(session_id);
        if bytes > MAX_BYTES / 4 {
            return;
        }
        while self.bytes + bytes > MAX_BYTES {
            let Some((oldest, stored)) = self.order.pop_front() else { break };
            if self.by_session.get(&oldest).is_some_and(|t| t.stored == stored) {
                self.take(&oldest);
            }
        }
        self.clock += 1;
        self.bytes += bytes;
        self.by_session.insert(session_id.to_owned(), Tail { entries, bytes, stored: self.clock });
        self.order.push_back((session_id.to_owned(), self.clock));
        // Stale pairs are bounded by the live ones.
        if self.order.len() > 2 * self.by_session.len() + 64 {
            let live = &self.by_session;
            self.order.retain(|(s, stored)| live.get(s).is_some_and(|t| t.stored == *stored));
        }
    }

    /// Drops the sessions' tails (they were deleted).
    pub(super) fn forget(&mut self, session_ids: &[String]) {
        for s in session_ids {
            self.take(s);
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.by_session.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tail(bytes: usize) -> Cached {
        Cached::measure(vec![pb::TranscriptEntry { id: "x".repeat(bytes), ..Default::default() }])
    }

    #[test]
    fn the_least_recently_stored_tails_go_first_and_a_fresh_one_stays() {
        let mut t = Tails::default();
        let quarter = MAX_BYTES / 4 - 16;
        for round in 0..5 {
            // "hot" is stored again every round; the others once each.
            t.put("hot", tail(quarter));
            t.put(&format!("cold-{round}"), tail(quarter));
        }
        assert!(t.take("hot").is_some(), "the most recently stored tail was evicted");
        assert!(t.take("cold-0").is_none() && t.take("cold-4").is_some());
        assert!(t.bytes <= MAX_BYTES);
        t.put("gone", tail(10));
        t.forget(&["gone".to_owned()]);
        assert!(t.take("gone").is_none());
        assert!(t.len() <= 4 && t.order.len() <= 2 * t.len() + 64);
    }

    #[test]
    fn an_extended_tail_counts_what_it_holds_and_leaves_a_shared_one_alone() {
        let mut t = tail(10);
        let reader = t.entries.clone();
        t.extend(tail(20).entries.to_vec());
        assert_eq!((t.bytes, t.entries.len(), reader.len()), (encoded_size(&t.entries), 2, 1));
    }
}
