//! The last visible tail read per session, so the next turn's read walks
//! only the entries appended since (a turn reads its session's visible
//! history once; walking and decoding all of it from SQLite was half of a
//! long session's turn). Both stores keep one: on PostgreSQL another
//! gateway may have appended meanwhile, which the walk from the leaf reads
//! like any other newer entries.
//!
//! Entries never change once written (a rewrite writes new ones), so a
//! cached tail is valid for as long as its leaf is an ancestor of the
//! session's leaf; the walk splices it in when it meets that leaf, and
//! otherwise (a rewind, a rewrite, a compaction in the new part) simply
//! reads on as it would without a cache. Bounded by what the decoded
//! entries cost on the heap (estimated: a short message decoded costs
//! several times its encoded size: under a bound of 16 MiB in encoded bytes
//! a gateway that served 100k sessions peaked at 215 MiB, under this one at
//! 89 MiB); the least recently stored tails go
//! first. A deleted session's tail is dropped with it.

use std::collections::{HashMap, VecDeque};
use std::mem::size_of;
use std::sync::{Arc, Mutex};

use ctxgate_proto::pb::{self, content_part::Part, transcript_entry::Entry};

use crate::transcript::Tail;

/// Estimated heap bytes of cached entries, all sessions together, unless
/// configured (`store.tailCacheMiB`).
const DEFAULT_MAX_BYTES: usize = crate::config::DEFAULT_TAIL_CACHE_MIB as usize * 1024 * 1024;

/// What the allocator adds to each allocation (glibc: a 16-byte header
/// and rounding to 16).
const PER_ALLOCATION: usize = 16;

fn string(capacity: usize) -> usize {
    if capacity == 0 { 0 } else { capacity.next_multiple_of(16) + PER_ALLOCATION }
}

/// An entry's heap cost once decoded: the struct in the tail's buffer and
/// every string, list and map it owns (at their capacity).
pub(super) fn heap_size(e: &pb::TranscriptEntry) -> usize {
    let s = |x: &String| string(x.capacity());
    let own = size_of::<pb::TranscriptEntry>() + s(&e.id) + s(&e.turn_id) + e.parent_id.as_ref().map_or(0, s);
    own + match &e.entry {
        Some(Entry::Message(m)) => {
            let parts = m.content.iter().map(|p| match &p.part {
                Some(Part::Text(t)) => s(t),
                Some(Part::Thinking(t)) => s(&t.text) + s(&t.signature),
                Some(Part::Image(i)) => s(&i.uri) + s(&i.mime_type),
                Some(Part::ToolCall(c)) => s(&c.id) + s(&c.name) + s(&c.arguments_json),
                Some(Part::ToolResult(r)) => s(&r.tool_call_id) + s(&r.tool_name) + s(&r.text),
                None => 0,
            });
            let content = m.content.capacity() * size_of::<pb::ContentPart>() + PER_ALLOCATION;
            // hashbrown: a slot and a control byte per bucket (buckets ≥ capacity).
            let table = m.metadata.capacity().next_power_of_two() * (size_of::<(String, String)>() + 1);
            let metadata = if m.metadata.is_empty() { 0 } else { table + PER_ALLOCATION };
            s(&m.id)
                + content
                + parts.sum::<usize>()
                + metadata
                + m.metadata.iter().map(|(k, v)| s(k) + s(v)).sum::<usize>()
        }
        Some(Entry::Compaction(c)) => s(&c.summary) + s(&c.first_kept_entry_id),
        None => 0,
    }
}

/// A session's tail as the cache hands it out and takes it back.
pub(super) struct Cached {
    pub entries: Arc<Tail>,
    /// Their estimated heap size: a reader that extends a tail adds the new
    /// entries' sizes (measuring the whole tail on every put cost a long
    /// session's turn more than the walk it saves).
    pub bytes: usize,
}

impl Cached {
    /// Entries read fresh, measured.
    pub(super) fn measure(entries: Vec<pb::TranscriptEntry>) -> Self {
        let tail = Tail::from(entries);
        Self { bytes: cost(&tail), entries: Arc::new(tail) }
    }

    /// Extends the tail in place (copied only while another reader still
    /// holds it).
    pub(super) fn extend(&mut self, newer: Vec<pb::TranscriptEntry>) {
        // Nothing new (a second read in one turn): no copy of a tail a
        // reader still holds.
        if newer.is_empty() {
            return;
        }
        // Measured before a copy, which may hold its figures tighter.
        let before = self.entries.bookkeeping_bytes();
        let added = heap_cost(&newer);
        let tail = Arc::make_mut(&mut self.entries);
        tail.extend(newer);
        self.bytes = (self.bytes + added + tail.bookkeeping_bytes()).saturating_sub(before);
    }
}

/// The session's cached tail, taken out for a read to extend.
pub(super) fn take(tails: &Mutex<Tails>, session_id: &str) -> Option<Cached> {
    tails.lock().map(|mut t| t.take(session_id)).unwrap_or(None)
}

/// What a read leaves: `newer` (oldest first) after the cached tail it met
/// (`older`), or alone when it met none; kept for the next read, and handed
/// out. A tail that was met is a session read again: it is protected.
pub(super) fn keep(
    tails: &Mutex<Tails>,
    session_id: &str,
    older: Option<Cached>,
    newer: Vec<pb::TranscriptEntry>,
) -> Arc<Tail> {
    let (tail, segment) = match older {
        Some(mut older) => {
            older.extend(newer);
            (older, Segment::Protected)
        }
        None => (Cached::measure(newer), Segment::Probation),
    };
    let answer = tail.entries.clone();
    if let Ok(mut t) = tails.lock() {
        t.put(session_id, tail, segment);
    }
    answer
}

/// What caching a session's tail costs besides its entries: its map and
/// order slots with their two copies of the id, the shared vector's header.
fn bookkeeping(session_id: &str) -> usize {
    size_of::<(String, Slot)>() + size_of::<(String, u64)>() + 2 * string(session_id.len()) + 64
}

fn heap_cost(entries: &[pb::TranscriptEntry]) -> usize {
    entries.iter().map(heap_size).sum()
}

/// A tail's entries and the figures it keeps about them.
fn cost(tail: &Tail) -> usize {
    heap_cost(tail) + tail.bookkeeping_bytes()
}

/// Which of two least-recently-used lists a tail is on (a segmented LRU).
/// A tail read from the store is on probation; one a read met again (the
/// session read twice while cached) is protected. Room is made on
/// probation first, and protected tails hold at most 4/5 of the bound, the
/// oldest going back on probation past it. Under plain LRU a burst of
/// one-turn sessions evicted every long session's tail, and sessions read
/// in strict turn whose tails outgrew the bound never hit; now the burst
/// evicts among itself, and the protected tails keep hitting.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Segment {
    Probation,
    Protected,
}

/// The share of the bound protected tails may hold: the rest leaves room
/// for new sessions to be read twice and so join them.
const PROTECTED_PER_FIVE: usize = 4;

struct Slot {
    entries: Arc<Tail>,
    bytes: usize,
    segment: Segment,
    /// When it was stored: list entries with another number are stale.
    stored: u64,
}

/// (session, when stored), oldest first; stale pairs are skipped.
type Order = VecDeque<(String, u64)>;

pub(super) struct Tails {
    /// The bound on `bytes`; a single tail over a quarter of it is not kept.
    max_bytes: usize,
    by_session: HashMap<String, Slot>,
    probation: Order,
    protected: Order,
    bytes: usize,
    protected_bytes: usize,
    clock: u64,
}

impl Default for Tails {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_BYTES)
    }
}

impl Tails {
    pub(super) fn new(max_bytes: usize) -> Self {
        Self {
            max_bytes,
            by_session: HashMap::new(),
            probation: VecDeque::new(),
            protected: VecDeque::new(),
            bytes: 0,
            protected_bytes: 0,
            clock: 0,
        }
    }

    /// Bounded to `mib` MiB of estimated heap (`store.tailCacheMiB`).
    pub(super) fn with_mib(mib: u32) -> Self {
        Self::new((mib as usize).saturating_mul(1024 * 1024))
    }

    /// Takes the session's cached tail (oldest entry first), if any: the
    /// reader extends it in place and puts it back.
    pub(super) fn take(&mut self, session_id: &str) -> Option<Cached> {
        let tail = self.by_session.remove(session_id)?;
        self.bytes -= tail.bytes + bookkeeping(session_id);
        if tail.segment == Segment::Protected {
            self.protected_bytes -= tail.bytes + bookkeeping(session_id);
        }
        Some(Cached { entries: tail.entries, bytes: tail.bytes })
    }

    pub(super) fn put(&mut self, session_id: &str, tail: Cached, segment: Segment) {
        let Cached { entries, bytes } = tail;
        self.take(session_id);
        let cost = bytes + bookkeeping(session_id);
        if cost > self.max_bytes / 4 {
            return;
        }
        // Room: probation's oldest first, then protected's.
        while self.bytes + cost > self.max_bytes {
            let Some(oldest) = self.oldest(Segment::Probation).or_else(|| self.oldest(Segment::Protected)) else {
                break;
            };
            self.take(&oldest);
        }
        self.store(session_id.to_owned(), Slot { entries, bytes, segment, stored: 0 });
        // Protected past its share: its oldest go back on probation (newest
        // there), where the next new tails evict them unless read first.
        while self.protected_bytes > self.max_bytes / 5 * PROTECTED_PER_FIVE {
            let Some(oldest) = self.oldest(Segment::Protected) else { break };
            let Some(t) = self.take(&oldest) else { break };
            let slot = Slot { entries: t.entries, bytes: t.bytes, segment: Segment::Probation, stored: 0 };
            self.store(oldest, slot);
        }
        // Stale pairs are bounded by the live ones.
        if self.probation.len() + self.protected.len() > 2 * self.by_session.len() + 64 {
            let live = &self.by_session;
            let is_live = |(s, stored): &(String, u64)| live.get(s).is_some_and(|t| t.stored == *stored);
            self.probation.retain(is_live);
            self.protected.retain(is_live);
        }
    }

    /// Stores `slot` as the newest of its segment.
    fn store(&mut self, session_id: String, mut slot: Slot) {
        let cost = slot.bytes + bookkeeping(&session_id);
        self.clock += 1;
        slot.stored = self.clock;
        self.bytes += cost;
        let order = match slot.segment {
            Segment::Probation => &mut self.probation,
            Segment::Protected => {
                self.protected_bytes += cost;
                &mut self.protected
            }
        };
        order.push_back((session_id.clone(), self.clock));
        self.by_session.insert(session_id, slot);
    }

    /// Pops the segment's least recently stored live tail's session.
    fn oldest(&mut self, segment: Segment) -> Option<String> {
        let order = match segment {
            Segment::Probation => &mut self.probation,
            Segment::Protected => &mut self.protected,
        };
        while let Some((session, stored)) = order.pop_front() {
            if self.by_session.get(&session).is_some_and(|t| t.stored == stored) {
                return Some(session);
            }
        }
        None
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

    /// Reads `session` as a store read does: a cached tail it meets comes
    /// back protected, unless `plain` (every tail on probation: plain LRU).
    fn read(t: &mut Tails, session: &str, bytes: usize, plain: bool) -> bool {
        let hit = t.take(session).is_some();
        let segment = if hit && !plain { Segment::Protected } else { Segment::Probation };
        t.put(session, tail(bytes), segment);
        hit
    }

    #[test]
    fn the_least_recently_stored_tails_go_first_and_a_fresh_one_stays() {
        let mut t = Tails::default();
        let quarter = DEFAULT_MAX_BYTES / 4 - 1024;
        for round in 0..5 {
            // "hot" is read every round; the others once each.
            read(&mut t, "hot", quarter, false);
            read(&mut t, &format!("cold-{round}"), quarter, false);
        }
        assert!(t.take("hot").is_some(), "the tail read every round was evicted");
        assert!(t.take("cold-0").is_none() && t.take("cold-4").is_some());
        assert!(t.bytes <= DEFAULT_MAX_BYTES);
        t.put("gone", tail(10), Segment::Probation);
        t.forget(&["gone".to_owned()]);
        assert!(t.take("gone").is_none());
        assert!(t.len() <= 4 && t.probation.len() + t.protected.len() <= 2 * t.len() + 64);
    }

    #[test]
    fn a_burst_of_new_sessions_leaves_the_ones_read_again_cached() {
        // How many of three sessions read twice are still cached after 500
        // sessions read once, each 1 % of the bound.
        let left = |plain: bool| {
            let mut t = Tails::default();
            let fifth = DEFAULT_MAX_BYTES / 5 - 1024;
            for _ in 0..2 {
                for hot in ["a", "b", "c"] {
                    read(&mut t, hot, fifth, plain);
                }
            }
            for new in 0..500 {
                read(&mut t, &format!("new-{new}"), DEFAULT_MAX_BYTES / 100, plain);
            }
            assert!(t.bytes <= DEFAULT_MAX_BYTES);
            ["a", "b", "c"].iter().filter(|hot| t.take(hot).is_some()).count()
        };
        assert_eq!((left(false), left(true)), (3, 0));
    }

    /// 15 sessions read in turn, each read a little longer, until together
    /// they are over twice the bound. Plain LRU evicts each tail just
    /// before it is read again: once they outgrow the bound, nothing hits.
    #[test]
    fn sessions_read_in_turn_past_the_bound_still_hit() {
        let hits = |plain: bool| {
            let mut t = Tails::default();
            let mut late = 0;
            for round in 0..9 {
                for s in 0..15 {
                    let bytes = (round + 1) * DEFAULT_MAX_BYTES / 60;
                    if read(&mut t, &format!("s{s}"), bytes, plain) && round >= 5 {
                        late += 1;
                    }
                }
                assert!(t.bytes <= DEFAULT_MAX_BYTES && t.protected_bytes <= DEFAULT_MAX_BYTES / 5 * 4);
            }
            late
        };
        let (segmented, plain) = (hits(false), hits(true));
        assert_eq!(plain, 0);
        // Four rounds, the protected share holding ~5 of the late tails.
        assert!(segmented >= 4 * 4, "{segmented} hits in the last four rounds");
    }

    #[test]
    fn an_extended_tail_counts_what_it_holds_and_leaves_a_shared_one_alone() {
        let mut t = tail(10);
        let reader = t.entries.clone();
        t.extend(Vec::new());
        assert!(Arc::ptr_eq(&t.entries, &reader), "nothing new: still the one the reader holds");
        t.extend(tail(20).entries.to_vec());
        assert_eq!((t.bytes, t.entries.len(), reader.len()), (cost(&t.entries), 2, 1));
    }

    #[test]
    fn a_short_message_costs_several_times_its_encoding_and_a_long_one_its_text() {
        use prost::Message as _;
        let msg = |text: &str| pb::TranscriptEntry {
            id: "e".repeat(32),
            turn_id: "t".repeat(32),
            entry: Some(Entry::Message(pb::AgentMessage {
                id: "m".repeat(32),
                content: vec![pb::ContentPart { part: Some(Part::Text(text.into())) }],
                metadata: [("k".to_owned(), "v".to_owned())].into(),
                ..Default::default()
            })),
            ..Default::default()
        };
        let short = msg("hi");
        assert!(heap_size(&short) > 3 * short.encoded_len(), "{} vs {}", heap_size(&short), short.encoded_len());
        let long = msg(&"x".repeat(100_000));
        assert!((100_000..101_500).contains(&heap_size(&long)), "{}", heap_size(&long));
    }
}
