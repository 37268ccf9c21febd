//! Durable turns: a turn's CommitTurn is queued with its reply and
//! delivered in order per session, now or by the background pass.

use super::*;

impl Core {
    /// The CommitTurn of a durable turn before it closes; the store adds
    /// the turn's messages and its terminal anchor. `position` is the
    /// admitted message's index in the visible history.
    pub(super) fn commit_draft(
        &self,
        lease: &Lease,
        session: &Session,
        turn_id: &str,
        admitted: &pb::TranscriptEntry,
        position: u64,
    ) -> crate::store::CommitDraft {
        let anchor = pb::TranscriptEntryAnchor {
            agent_id: session.agent_id.clone(),
            session_id: session.session_id.clone(),
            session_key: session.session_key.clone(),
            store_path: String::new(),
            generation: 0,
            entry_id: admitted.id.clone(),
            raw_seq: admitted.seq,
            effective_parent_id: admitted.parent_id.clone(),
            active_message_position: position,
            idempotency_key: None,
        };
        crate::store::CommitDraft {
            engine_id: lease.key.clone(),
            request: pb::CommitTurnRequest {
                advancement_key: turn_id.into(),
                admission: Some(pb::TranscriptTurnAdmission {
                    anchor: Some(anchor),
                    logical_turn_id: turn_id.into(),
                    role: Role::User as i32,
                }),
                terminal: None,
                messages: Vec::new(),
                session_id: session.session_id.clone(),
                session_key: Some(session.session_key.clone()),
                session_target: Some(target(session)),
                ..Default::default()
            },
        }
    }

    /// Delivers the session's queued commits in order; returns how many
    /// still wait (the engine is out of service or refused one).
    pub(super) async fn drain_commits(&self, session_id: &str, cancel: &CancellationToken) -> Result<usize, CoreError> {
        let pending = self.store.pending_commits(session_id).await?;
        let registry = self.registry();
        let mut delivered = 0;
        for p in &pending {
            let Some(engine) = registry.get(&p.engine_id).filter(|g| !g.is_quarantined()) else { break };
            match engine.commit_turn(p.request.clone(), &Call::new(cancel.clone())).await {
                Ok(_) => {
                    self.store.complete_commit(session_id, &p.request.advancement_key).await?;
                    delivered += 1;
                }
                Err(e) => {
                    tracing::warn!(session = session_id, key = %p.request.advancement_key, error = %e, "commit not accepted; it stays queued");
                    break;
                }
            }
        }
        Ok(pending.len() - delivered)
    }

    /// One pass of the outbox, round-robin across sessions: each session
    /// with queued commits gets a turn at draining (under its lock).
    pub async fn drain_outbox(&self) -> Result<(), CoreError> {
        for session_id in self.store.sessions_with_pending_commits().await? {
            // A session with a turn running drains at that turn's start; do
            // not stall every other session's pass behind it.
            if self.sessions.is_busy(&session_id) {
                continue;
            }
            let cancel = self.call_token();
            let _guard = self.enter(&session_id, &cancel, false).await?;
            self.drain_commits(&session_id, &cancel).await?;
        }
        Ok(())
    }
}
