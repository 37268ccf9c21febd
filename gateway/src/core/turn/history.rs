//! The session's history as a turn sends it to its engine: the whole
//! visible history, or — for an engine that keeps the history itself
//! (DELTA) — only what follows the engine's cursor. Reading it costs as
//! much as an assemble, so it is read once per turn, kept current by the
//! turn's own appends, and read again only after a compaction or a resync
//! changed it.

use ctxgate_proto::estimate;
use ctxgate_proto::pb::{self, AgentMessage, transcript_entry::Entry};

use super::TurnServices;
use crate::core::CoreError;
use crate::core::engine_lease::EngineLease;
use crate::engines::Call;
use crate::store::{Delta, Session};
use crate::transcript::Messages;

/// What a turn read for its engine.
#[derive(Debug)]
pub(super) enum Read {
    /// The whole visible history (shared with the store's cached tail).
    Full(Messages),
    /// What follows the engine's cursor; the engine holds what precedes it.
    Delta { cursor: pb::HistoryCursor, after: Vec<AgentMessage> },
}

impl Read {
    /// What follows the cursor, for a delta read.
    pub(super) fn delta(&self) -> Option<&[AgentMessage]> {
        match self {
            Self::Full(_) => None,
            Self::Delta { after, .. } => Some(after),
        }
    }

    pub(super) fn cursor(&self) -> Option<&pb::HistoryCursor> {
        match self {
            Self::Full(_) => None,
            Self::Delta { cursor, .. } => Some(cursor),
        }
    }

    /// Tokens of the whole visible history, the engine's share included.
    pub(super) fn tokens(&self) -> u64 {
        match self {
            Self::Full(m) => m.tokens(),
            Self::Delta { cursor, after } => cursor.tokens.saturating_add(estimate::messages_tokens(after)),
        }
    }

    /// The messages (a copy, if shared), and the cursor they follow.
    pub(super) fn into_parts(self) -> (Vec<AgentMessage>, Option<pb::HistoryCursor>) {
        match self {
            Self::Full(m) => (m.into_vec(), None),
            Self::Delta { cursor, after } => (after, Some(cursor)),
        }
    }
}

/// A turn's view of the history: what it read, and how it may read next.
#[derive(Debug)]
pub(super) struct HistoryView {
    /// `None`: read at the next use.
    read: Option<Read>,
    /// The turn may send deltas: a remote DELTA engine that has not failed
    /// a delta call in this turn (after one, legacy may have to answer,
    /// and legacy needs the whole history).
    delta: bool,
    /// A history gap was resynced in this turn (at most once).
    gap_resynced: bool,
}

/// What reading the history needs from the turn.
pub(super) struct Source<'a> {
    pub services: &'a TurnServices,
    pub lease: &'a EngineLease,
    pub session: &'a Session,
    /// The message id of the turn's first user message: the engine is
    /// resynced with everything before it.
    pub fence: &'a str,
    pub call: &'a Call,
}

impl HistoryView {
    pub(super) fn new(lease: &EngineLease) -> Self {
        Self { read: None, delta: lease.remote && crate::engines::delta(&lease.info), gap_resynced: false }
    }

    /// The history now, read when needed.
    pub(super) async fn get(&mut self, from: &Source<'_>) -> Result<&Read, CoreError> {
        if self.read.is_none() {
            let read = if self.delta {
                read_delta(from).await?
            } else {
                Read::Full(from.services.visible(from.session).await?)
            };
            self.read = Some(read);
        }
        Ok(self.read.get_or_insert(Read::Full(Messages::default())))
    }

    /// Takes the history (the turn is closing: not copied).
    pub(super) async fn take(&mut self, from: &Source<'_>) -> Result<Read, CoreError> {
        self.get(from).await?;
        Ok(self.read.take().unwrap_or(Read::Full(Messages::default())))
    }

    /// Moves a whole-history read out (into an engine request): the next
    /// use reads it again, from the store's cached tail. A delta is left
    /// in place (it is small, and a failed delta call falls back from it).
    pub(super) fn take_full(&mut self) -> Option<Messages> {
        match self.read.take() {
            Some(Read::Full(m)) => Some(m),
            other => {
                self.read = other;
                None
            }
        }
    }

    /// The branch changed (a compaction, a resync): read it again.
    pub(super) fn forget(&mut self) {
        self.read = None;
    }

    /// The engine failed (or shed) a delta call: the rest of the turn reads
    /// the whole history, which legacy can answer. False when the last
    /// read was not a delta (nothing to fall back from).
    pub(super) fn fall_back_to_full(&mut self) -> bool {
        if !matches!(self.read, Some(Read::Delta { .. })) {
            return false;
        }
        self.delta = false;
        self.read = None;
        true
    }

    /// The engine reported a history gap: true the first time in this turn
    /// (the caller drops the cursor and reads again), false after.
    pub(super) fn resync_after_gap(&mut self) -> bool {
        if std::mem::replace(&mut self.gap_resynced, true) {
            return false;
        }
        self.read = None;
        true
    }

    /// Extends what was read with entries the turn just stored.
    /// A history shared with the store's tail is read again instead: the
    /// tail has them, and extending it would copy it.
    pub(super) fn remember(&mut self, stored: &[pb::TranscriptEntry]) {
        let m = match &mut self.read {
            Some(Read::Full(Messages::Shared(_))) => return self.forget(),
            Some(Read::Full(Messages::Owned(m)) | Read::Delta { after: m, .. }) => m,
            None => return,
        };
        m.extend(stored.iter().filter_map(|e| match &e.entry {
            Some(Entry::Message(m)) => Some(m.clone()),
            _ => None,
        }));
    }
}

/// What follows the DELTA engine's cursor, resyncing it first when it is
/// missing or no longer on the branch; the whole visible history if the
/// engine failed meanwhile (legacy answers then).
async fn read_delta(from: &Source<'_>) -> Result<Read, CoreError> {
    let Source { services, lease, session, fence, call } = from;
    let sid = &session.session_id;
    let mut delta = services.store.delta(sid, &lease.key).await?;
    for resyncs in 0..2 {
        if let Some((cursor, after)) = delta.take().and_then(Delta::messages) {
            return Ok(Read::Delta { cursor, after });
        }
        let Some(cursor) = services.delivery.resync(lease, session, fence, call).await? else { break };
        // After a second resync the whole history is read anyway.
        if resyncs == 0 {
            delta = Some(Delta { after: services.store.branch_after(sid, &cursor).await?, cursor });
        }
    }
    Ok(Read::Full(services.visible(session).await?))
}

#[cfg(test)]
mod tests {
    use ctxgate_proto::limits::MAX_USAGE_TOKENS;
    use ctxgate_proto::pb::{self, AgentMessage};
    use proptest::prelude::*;

    use super::Read;
    use crate::untrusted_input_tests::usage_count;

    proptest! {
        /// A DELTA read's tokens: the cursor's count (the store's, or an
        /// engine's in a gap detail) plus the messages', saturating.
        #[test]
        fn a_delta_reads_tokens_saturate(cursor in usage_count(), counts in proptest::collection::vec(usage_count(), 0..8)) {
            let after: Vec<AgentMessage> = counts
                .iter()
                .map(|n| AgentMessage {
                    usage: Some(pb::Usage { output_tokens: Some(*n), ..Default::default() }),
                    ..Default::default()
                })
                .collect();
            let read = Read::Delta { cursor: pb::HistoryCursor { tokens: cursor, ..Default::default() }, after };
            let want = counts.iter().fold(cursor, |t, n| t.saturating_add((*n).min(MAX_USAGE_TOKENS)));
            prop_assert_eq!(read.tokens(), want);
        }
    }
}
