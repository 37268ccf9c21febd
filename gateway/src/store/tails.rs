//! The last visible tail read per session, so the next turn's read walks
//! only the entries appended since (a turn reads its session's visible
//! history once; walking and decoding all of it from SQLite was half of a
//! long session's turn).
//!
//! Entries never change once written (a rewrite writes new ones), so a
//! cached tail is valid for as long as its leaf is an ancestor of the
//! session's leaf; the walk splices it in when it meets that leaf, and
//! otherwise (a rewind, a rewrite, a compaction in the new part) simply
//! reads on as it would without a cache. Bounded by bytes; the oldest
//! entries go first.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use ctxgate_proto::pb;
use prost::Message as _;

/// Encoded bytes of cached entries, all sessions together.
const MAX_BYTES: usize = 16 * 1024 * 1024;

#[derive(Default)]
pub(super) struct Tails {
    by_session: HashMap<String, (Arc<Vec<pb::TranscriptEntry>>, usize)>,
    /// Sessions in the order their tails were stored (a session may be
    /// listed more than once; only its latest store counts).
    order: VecDeque<String>,
    bytes: usize,
}

impl Tails {
    /// Takes the session's cached tail (oldest first), if any: the reader
    /// extends it in place and puts it back.
    pub(super) fn take(&mut self, session_id: &str) -> Option<Arc<Vec<pb::TranscriptEntry>>> {
        let (tail, size) = self.by_session.remove(session_id)?;
        self.bytes -= size;
        Some(tail)
    }

    pub(super) fn put(&mut self, session_id: &str, tail: Vec<pb::TranscriptEntry>) {
        let size: usize = tail.iter().map(|e| e.encoded_len()).sum();
        self.forget(session_id);
        if size > MAX_BYTES / 4 {
            return;
        }
        while self.bytes + size > MAX_BYTES {
            let Some(oldest) = self.order.pop_front() else { break };
            self.forget(&oldest);
        }
        self.bytes += size;
        self.by_session.insert(session_id.to_owned(), (Arc::new(tail), size));
        self.order.push_back(session_id.to_owned());
        // Stale duplicates in `order` are bounded by the live ones.
        if self.order.len() > 2 * self.by_session.len() + 64 {
            let live = &self.by_session;
            let mut seen = std::collections::HashSet::new();
            let mut kept: VecDeque<String> =
                self.order.drain(..).rev().filter(|s| live.contains_key(s) && seen.insert(s.clone())).collect();
            kept.make_contiguous().reverse();
            self.order = kept;
        }
    }

    fn forget(&mut self, session_id: &str) {
        self.take(session_id);
    }
}
