//! DELTA history delivery: an engine that keeps the session's history itself
//! gets only what follows its cursor. Without a usable cursor (first
//! contact, a reported gap, a rewrite or a host compaction since) the
//! session's history before the current turn is delivered with IngestBatch
//! and the cursor set after it.

use std::collections::HashSet;

use ctxgate_proto::estimate;
use ctxgate_proto::pb::{self, AgentMessage, transcript_entry::Entry};

use crate::core::CoreError;
use crate::core::engine_lease::EngineLease;
use crate::core::outbox::Delivery;
use crate::engines::{Call, EngineCallError};
use crate::store::Session;
use crate::transcript;

/// One IngestBatch of a resync carries at most this many messages and bytes
/// (the contract allows 20,000 messages and 16 MiB a request).
const RESYNC_MESSAGES: usize = 1_000;
const RESYNC_BYTES: usize = 4 * 1024 * 1024;

impl Delivery {
    /// Delivers the visible history before the turn's first message (by
    /// its message id, which rewrites keep) to the lease's engine and
    /// records the cursor it then holds. `None`: the engine failed on the
    /// way (it is quarantined now; legacy serves).
    pub(super) async fn resync(
        &self,
        lease: &EngineLease,
        session: &Session,
        fence: &str,
        call: &Call,
    ) -> Result<Option<pb::HistoryCursor>, CoreError> {
        let (messages, cursor) = self.before_fence(session, fence).await?;
        let mut chunk: Vec<AgentMessage> = Vec::new();
        let mut bytes = 0;
        let mut rest = messages.into_iter().peekable();
        while rest.peek().is_some() || !chunk.is_empty() {
            if let Some(m) = rest.next_if(|m| {
                chunk.is_empty()
                    || (chunk.len() < RESYNC_MESSAGES && bytes + prost::Message::encoded_len(m) <= RESYNC_BYTES)
            }) {
                bytes += prost::Message::encoded_len(&m);
                chunk.push(m);
                continue;
            }
            let req = pb::IngestBatchRequest {
                session_id: session.session_id.clone(),
                session_key: Some(session.session_key.clone()),
                messages: std::mem::take(&mut chunk),
                is_heartbeat: false,
            };
            bytes = 0;
            match lease.engine.ingest_batch(req, call).await {
                Ok(_) => {}
                Err(EngineCallError::Cancelled) => return Err(CoreError::Aborted),
                Err(e) => {
                    tracing::warn!(session = %session.session_id, error = %e, "resyncing the engine's history failed");
                    return Ok(None);
                }
            }
        }
        self.store.set_cursor(&session.session_id, &lease.key, Some(cursor.clone())).await?;
        Ok(Some(cursor))
    }

    /// The visible history before the turn's first message (by its message
    /// id, which rewrites keep), and the cursor of an engine that holds
    /// exactly that.
    async fn before_fence(
        &self,
        session: &Session,
        fence: &str,
    ) -> Result<(Vec<AgentMessage>, pb::HistoryCursor), CoreError> {
        let tail = self.store.visible_tail(&session.session_id).await?;
        let mut entries = transcript::visible_entries(&tail);
        let is_fence = |e: &pb::TranscriptEntry| matches!(&e.entry, Some(Entry::Message(m)) if m.id == fence);
        entries.truncate(entries.iter().position(is_fence).unwrap_or(entries.len()));
        let messages = transcript::render_entries(&entries);
        // The cursor names the last of them in *branch* order (a summary
        // is shown first but its compaction entry follows the kept
        // messages): a message by its id, a summary by its entry id. What
        // follows it on the branch is then exactly the turn.
        let sent: HashSet<&str> = entries.iter().map(|e| e.id.as_str()).collect();
        let cursor = match tail.iter().rev().find(|e| sent.contains(e.id.as_str())) {
            None => pb::HistoryCursor::default(),
            Some(last) => pb::HistoryCursor {
                message_id: match &last.entry {
                    Some(Entry::Message(m)) => m.id.clone(),
                    _ => last.id.clone(),
                },
                seq: last.seq,
                message_count: messages.len() as u64,
                tokens: estimate::messages_tokens(&messages),
            },
        };
        Ok((messages, cursor))
    }

    /// After a Bootstrap in which a DELTA engine imported the session's
    /// history itself (through the Host service, up to the turn's fence):
    /// when it took as many messages as are visible before the turn, it
    /// holds what a resync would send, so its cursor is recorded instead
    /// of sending the history a second time. Otherwise (a summary in the
    /// history, a count that differs) the first Assemble resyncs as usual.
    pub(super) async fn adopt_import(
        &self,
        lease: &EngineLease,
        session: &Session,
        fence: &str,
        imported: u64,
    ) -> Result<bool, CoreError> {
        if self.store.cursor(&session.session_id, &lease.key).await?.is_some() {
            return Ok(false);
        }
        let (messages, cursor) = self.before_fence(session, fence).await?;
        if messages.len() as u64 != imported {
            return Ok(false);
        }
        self.store.set_cursor(&session.session_id, &lease.key, Some(cursor)).await?;
        Ok(true)
    }

    /// Forgets a DELTA engine's cursor after it reported a gap: the next
    /// read of the history resyncs.
    pub(super) async fn drop_cursor(&self, lease: &EngineLease, session: &Session) -> Result<(), CoreError> {
        Ok(self.store.set_cursor(&session.session_id, &lease.key, None).await?)
    }

    /// After a successful AfterTurn of a DELTA engine: the cursor moves over
    /// what the engine was sent.
    pub(super) async fn advance_cursor(
        &self,
        lease: &EngineLease,
        session: &Session,
        base: &pb::HistoryCursor,
    ) -> Result<(), CoreError> {
        let Some(after) = self.store.branch_after(&session.session_id, base).await? else { return Ok(()) };
        let messages: Vec<(u64, &AgentMessage)> = after
            .iter()
            .filter_map(|e| match &e.entry {
                Some(Entry::Message(m)) => Some((e.seq, m)),
                _ => None,
            })
            .collect();
        let Some(&(seq, last)) = messages.last() else { return Ok(()) };
        let next = pb::HistoryCursor {
            message_id: last.id.clone(),
            seq,
            message_count: base.message_count.saturating_add(messages.len() as u64),
            tokens: base.tokens.saturating_add(estimate::messages_tokens(messages.iter().map(|(_, m)| *m))),
        };
        Ok(self.store.set_cursor(&session.session_id, &lease.key, Some(next)).await?)
    }
}
