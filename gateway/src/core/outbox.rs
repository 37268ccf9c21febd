//! Durable turns: a turn's CommitTurn is queued with its reply and
//! delivered in order per (session, engine), now or by the background pass.
//! An engine's refusal blocks that session on that engine only, with
//! backoff; rows for an engine that is gone wait without blocking anything
//! else. Deleting a session queues a ForgetSession for every engine that
//! saw it.

use std::sync::Arc;
use std::time::Duration;

use ctxgate_proto::estimate;
use ctxgate_proto::pb::{self, Role};
use tokio_util::sync::CancellationToken;

use crate::core::claims::SessionGate;
use crate::core::engine_lease::{Engines, session_target};
use crate::core::maintenance::Upkeep;
use crate::core::session_locks::BusyError;
use crate::core::types::BusyPolicy;
use crate::core::{CoreError, now_unix_ms, session_ref};
use crate::engines::{Call, Engine, EngineCallError};
use crate::grants::HostOperation;
use crate::store::{
    Advance, CommitDraft, DueQueue, Forget, OutboxCounts, OutboxDrop, OutboxPage, OutboxRow, PendingCommit, Session,
    Store,
};

/// The first retry of a refused commit; doubled per refusal up to the cap.
const FIRST_RETRY: Duration = Duration::from_secs(1);
const MAX_RETRY: Duration = Duration::from_secs(300);

/// `next_attempt_ms` of a row held after repeated failures: never retried
/// on its own, only by `ctxgate outbox retry` (one attempt each time).
pub const HELD: i64 = i64::MAX;

/// When to retry after `attempts` refusals.
fn retry_after(attempts: u32) -> Duration {
    FIRST_RETRY.saturating_mul(1 << attempts.saturating_sub(1).min(16)).min(MAX_RETRY)
}

/// A delivered commit's messages for the engine's cursor (a no-op in the
/// store for engines without one).
fn advance(engine_id: &str, req: &pb::CommitTurnRequest) -> Option<Advance> {
    let (last, terminal) = (req.messages.last()?, req.terminal.as_ref()?);
    Some(Advance {
        engine_id: engine_id.into(),
        last_message_id: last.id.clone(),
        seq: terminal.raw_seq,
        messages: req.messages.len() as u64,
        tokens: estimate::messages_tokens(&req.messages),
    })
}

/// What still waits after a drain of one (session, engine) queue.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Backlog {
    pub waiting: usize,
    /// The oldest waiting row's refusal, when the engine refused it.
    pub refused: Option<Refusal>,
    /// Due unless every commit this drain delivered said none is due.
    pub upkeep: Upkeep,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub attempts: u32,
    pub error: String,
    pub next_attempt_ms: i64,
}

impl Backlog {
    fn at(pending: &[PendingCommit]) -> Self {
        let refused = pending.first().filter(|p| p.attempts > 0).map(|p| Refusal {
            attempts: p.attempts,
            error: p.last_error.clone().unwrap_or_default(),
            next_attempt_ms: p.next_attempt_ms,
        });
        Self { waiting: pending.len(), refused, upkeep: Upkeep::Due }
    }

    /// Why the session's next turn on `engine` cannot start, for its caller.
    pub(super) fn reason(&self, engine: &str) -> String {
        let Self { waiting, refused, .. } = self;
        match refused {
            Some(r) if r.next_attempt_ms == HELD => format!(
                "The context engine \"{engine}\" failed on an earlier turn of this session every time it was sent ({}); that turn is held and this session's turns on it wait until it is retried or dropped (`ctxgate outbox retry|drop <session>`).",
                r.error
            ),
            Some(r) => {
                let wait = (r.next_attempt_ms - now_unix_ms()).max(0) as f64 / 1000.0;
                format!(
                    "The context engine \"{engine}\" refused an earlier turn of this session ({} attempt(s), last: {}); this session's turns on it wait until that turn is delivered (next retry in {wait:.0} s) or dropped (`ctxgate outbox retry|drop <session>`).",
                    r.attempts, r.error
                )
            }
            None => format!(
                "The context engine \"{engine}\" has not accepted {waiting} earlier turn(s) of this session yet; they are retried in the background. Try again shortly."
            ),
        }
    }
}

/// Where a queued row's engine stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineState {
    InService,
    Quarantined,
    /// Gone from the configuration: its rows wait, droppable, and block
    /// nothing else.
    NotConfigured,
}

impl EngineState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::InService => "in-service",
            Self::Quarantined => "quarantined",
            Self::NotConfigured => "not-configured",
        }
    }
}

/// Delivery to engines of what they keep: durable turns' CommitTurns
/// through the outbox, ForgetSession for deleted sessions, and DELTA
/// engines' cursors (`cursors.rs`). Enters sessions through the gate, as
/// any work on a session does.
pub struct Delivery {
    pub(super) store: Arc<dyn Store>,
    engines: Arc<Engines>,
    gate: Arc<SessionGate>,
    /// One forget delivery at a time: a delete's own pass and the
    /// background pass would otherwise both read, and both send, the same
    /// owed ForgetSession.
    forgets: tokio::sync::Mutex<()>,
    /// Failures after which a commit is held (`store.holdCommitAfterFailures`).
    hold_after: u32,
    /// How long dropped rows stay in the audit (`store.auditRetentionDays`).
    audit_days: u32,
    /// The gateway's shutdown: every delivery's calls end with it.
    shutdown: tokio_util::sync::CancellationToken,
}

impl Delivery {
    pub fn new(
        store: Arc<dyn Store>,
        engines: Arc<Engines>,
        gate: Arc<SessionGate>,
        config: &crate::config::Config,
        shutdown: tokio_util::sync::CancellationToken,
    ) -> Self {
        Self {
            store,
            engines,
            gate,
            forgets: tokio::sync::Mutex::new(()),
            hold_after: config.store.hold_commit_after_failures,
            audit_days: config.store.audit_retention_days,
            shutdown,
        }
    }

    fn call_token(&self) -> CancellationToken {
        self.shutdown.child_token()
    }

    /// The CommitTurn of a durable turn before it closes; the store adds
    /// the turn's messages and its terminal anchor. `position` is the
    /// admitted message's index in the visible history. `host` is what
    /// the turn's host allows the engine to call back for: kept in the
    /// request as a grant with no token, made a live grant at each
    /// delivery ([`Engines::commit_grant`]).
    #[allow(clippy::too_many_arguments)] // one draft, its parts named
    pub(super) fn commit_draft(
        &self,
        engine_id: &str,
        session: &Session,
        turn_id: &str,
        admitted: &pb::TranscriptEntry,
        position: u64,
        runtime_context: pb::RuntimeContext,
        host: &[HostOperation],
    ) -> CommitDraft {
        let anchor = pb::TranscriptEntryAnchor {
            agent_id: session.agent_id.clone(),
            session_id: session.session_id.clone(),
            session_key: session.session_key.clone(),
            store_path: String::new(),
            generation: session.session_id.clone(),
            entry_id: admitted.id.clone(),
            raw_seq: admitted.seq,
            effective_parent_id: admitted.parent_id.clone(),
            active_message_position: position,
            idempotency_key: None,
        };
        CommitDraft {
            engine_id: engine_id.into(),
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
                session_target: Some(session_target(session)),
                runtime_context: Some(runtime_context),
                host: Some(pb::HostAccess {
                    endpoint: String::new(),
                    grant: Some(pb::Grant {
                        operations: host.iter().map(|o| o.as_str().to_owned()).collect(),
                        ..Default::default()
                    }),
                }),
                ..Default::default()
            },
        }
    }

    /// Delivers the session's queued commits for `engine_id` in order, up
    /// to the first one that cannot go now (engine out of service, refused,
    /// or waiting out its backoff unless `force`). The caller holds the
    /// session's lock.
    pub(super) async fn drain_commits(
        &self,
        session_id: &str,
        engine_id: &str,
        cancel: &CancellationToken,
        force: bool,
    ) -> Result<Backlog, CoreError> {
        let pending = self.store.pending_commits(session_id, engine_id).await?;
        self.deliver_commits(session_id, engine_id, &pending, cancel, force).await
    }

    /// [`drain_commits`](Self::drain_commits) of `pending`, the session's
    /// queue for `engine_id` as the caller knows it.
    pub(super) async fn deliver_commits(
        &self,
        session_id: &str,
        engine_id: &str,
        pending: &[PendingCommit],
        cancel: &CancellationToken,
        force: bool,
    ) -> Result<Backlog, CoreError> {
        let Some(engine) = self.engines.registry().get(engine_id).cloned() else { return Ok(Backlog::at(pending)) };
        // Due unless every commit delivered here said it is not.
        let mut upkeep = None;
        for (i, p) in pending.iter().enumerate() {
            let now = now_unix_ms();
            if engine.is_quarantined() || (!force && p.next_attempt_ms > now) {
                return Ok(Backlog::at(&pending[i..]));
            }
            let key = &p.request.advancement_key;
            let mut request = p.request.clone();
            let grant = self.engines.commit_grant(engine_id, &request);
            request.host = grant.as_ref().map(|g| g.access.clone());
            match engine.commit_turn(request, &Call::new(cancel.clone())).await {
                Ok(r) => {
                    self.store.complete_commit(session_id, key, advance(engine_id, &p.request)).await?;
                    upkeep = Some(upkeep.unwrap_or(Upkeep::NotDue).and(Upkeep::hinted(r.maintenance_due)));
                }
                // A gap on a commit: the engine lost the session; the next
                // turn resyncs it, the row waits with backoff meanwhile.
                Err(e @ (EngineCallError::Refused { .. } | EngineCallError::HistoryGap { .. })) => {
                    if matches!(e, EngineCallError::HistoryGap { .. }) {
                        self.store.set_cursor(session_id, engine_id, None).await?;
                    }
                    let attempts = p.attempts + 1;
                    let error = e.to_string();
                    let next_attempt_ms = now + retry_after(attempts).as_millis() as i64;
                    tracing::warn!(
                        session = session_id,
                        key,
                        attempts,
                        error,
                        "the engine refused a commit; this session's turns on it wait"
                    );
                    self.store.refuse_commit(session_id, key, &error, next_attempt_ms).await?;
                    let refused = Some(Refusal { attempts, error, next_attempt_ms });
                    return Ok(Backlog { waiting: pending.len() - i, refused, upkeep: Upkeep::Due });
                }
                // The engine broke on this row (the call quarantined it):
                // after a few times in a row the row is the likelier cause,
                // and is held rather than sent to break the engine again.
                Err(
                    e @ (EngineCallError::Failed { .. }
                    | EngineCallError::DeadlineExceeded { .. }
                    | EngineCallError::ContractViolation { .. }),
                ) => {
                    let failures = self.store.fail_commit(session_id, key).await?;
                    let hold_after = self.hold_after;
                    if failures < hold_after {
                        tracing::warn!(session = session_id, key, failures, error = %e, "commit not delivered; it stays queued");
                        return Ok(Backlog::at(&pending[i..]));
                    }
                    let error = format!("the engine failed on it {failures} times in a row, last: {e}");
                    tracing::error!(
                        session = session_id,
                        key,
                        error,
                        "a commit is held: this session's turns on the engine wait for `ctxgate outbox retry|drop`"
                    );
                    self.store.refuse_commit(session_id, key, &error, HELD).await?;
                    let refused = Some(Refusal { attempts: p.attempts + 1, error, next_attempt_ms: HELD });
                    return Ok(Backlog { waiting: pending.len() - i, refused, upkeep: Upkeep::Due });
                }
                Err(e) => {
                    tracing::warn!(session = session_id, key = ?key, error = %e, "commit not delivered; it stays queued");
                    return Ok(Backlog::at(&pending[i..]));
                }
            }
        }
        Ok(Backlog { upkeep: upkeep.unwrap_or(Upkeep::Due), ..Backlog::default() })
    }

    /// One pass of the outbox, round-robin across sessions: each due
    /// (session, engine) queue with its engine in service gets a turn at
    /// draining (under the session's lock); then owed forgets.
    pub async fn drain_outbox(&self) -> Result<(), CoreError> {
        let live = self.engines.registry().in_service();
        for DueQueue { session_id, engine_id } in self.store.due_commits(now_unix_ms(), &live).await? {
            // A session with a turn running drains at that turn's start; do
            // not stall every other session's pass behind it.
            if self.gate.is_busy(&session_id) || self.engine_state(&engine_id) != EngineState::InService {
                continue;
            }
            let cancel = self.call_token();
            // Held by another gateway: its turn drains it.
            let _guard = match self.gate.hold(&session_id, &cancel, BusyPolicy::Reject, None).await {
                Ok(held) => held,
                Err(CoreError::Busy(BusyError::Busy)) => continue,
                // One session's trouble must not stop the pass for the others.
                Err(e) => {
                    tracing::warn!(session = session_id, error = %e, "outbox: session not entered; next pass");
                    continue;
                }
            };
            if let Err(e) = self.drain_commits(&session_id, &engine_id, &cancel, false).await {
                tracing::warn!(session = session_id, engine = engine_id, error = %e, "outbox drain failed; next pass");
            }
        }
        self.deliver_forgets(None).await
    }

    /// Rewinds the turns of gateways that died holding their session (a
    /// shared store; nothing to do on one the gateway owns).
    pub async fn recover_abandoned_turns(&self) -> Result<u32, CoreError> {
        let mut n = 0;
        for session_id in self.store.abandoned_turns().await? {
            // The claim rewinds the turn; a session in use meanwhile is skipped.
            match self.gate.hold(&session_id, &self.call_token(), BusyPolicy::Reject, None).await {
                Ok(_held) => n += 1,
                Err(CoreError::Busy(_)) => {}
                Err(e) => {
                    tracing::warn!(session = session_id, error = %e, "an abandoned turn was not rewound; next pass")
                }
            }
        }
        if n > 0 {
            tracing::info!(turns = n, "turns left open by gateways that died were rewound");
        }
        Ok(n)
    }

    /// Sends the ForgetSession calls owed for deleted sessions (`only`
    /// these sessions' when given); a failed one is retried with backoff,
    /// one for an engine that is gone waits.
    pub(super) async fn deliver_forgets(&self, only: Option<&[String]>) -> Result<(), CoreError> {
        // One pass at a time (see `Core::forgets`). A delete that finds
        // the background pass running leaves its forgets to that pass or
        // the next (every half second) rather than wait behind a slow engine.
        let _one_at_a_time = match only {
            Some(_) => match self.forgets.try_lock() {
                Ok(held) => held,
                Err(_) => return Ok(()),
            },
            None => self.forgets.lock().await,
        };
        let registry = self.engines.registry();
        let due = self.store.pending_forgets(now_unix_ms(), &registry.in_service()).await?;
        let wanted = |f: &Forget| only.is_none_or(|ids| ids.contains(&f.session_id));
        for Forget { session_id, engine_id, agent_id, session_key, attempts, .. } in due.into_iter().filter(wanted) {
            let Some(engine) = registry.get(&engine_id).filter(|g| !g.is_quarantined()) else { continue };
            let req = pb::ForgetSessionRequest {
                session_id: session_id.clone(),
                session_key: Some(session_key),
                agent_id: Some(agent_id),
            };
            let retry = match engine.forget_session(req, &Call::new(self.call_token())).await {
                // An engine without ForgetSession holds nothing to forget.
                Ok(_) | Err(EngineCallError::Unimplemented(_)) => None,
                Err(e) => {
                    tracing::warn!(engine = engine_id, session = session_id, error = %e, "ForgetSession failed; retried later");
                    Some((now_unix_ms() + retry_after(attempts + 1).as_millis() as i64, e.to_string()))
                }
            };
            let retry = retry.as_ref().map(|(at, why)| (*at, why.as_str()));
            self.store.settle_forget(&session_id, &engine_id, retry).await?;
        }
        Ok(())
    }

    pub fn engine_state(&self, engine_id: &str) -> EngineState {
        match self.engines.registry().get(engine_id) {
            None => EngineState::NotConfigured,
            Some(g) if g.is_quarantined() => EngineState::Quarantined,
            Some(_) => EngineState::InService,
        }
    }

    // --- operator actions (`ctxgate outbox`) ---------------------------------

    /// Queued commits, oldest first; and how many more the limit left out.
    pub async fn list_outbox(&self, agent: Option<&str>, limit: u32) -> Result<OutboxPage, CoreError> {
        Ok(self.store.list_outbox(agent, limit).await?)
    }

    /// Queued and refused commits (status).
    pub async fn outbox_counts(&self) -> Result<OutboxCounts, CoreError> {
        Ok(self.store.outbox_counts().await?)
    }

    /// Retries the key's queued commits now, ignoring their backoff, under
    /// each session's lock; returns how many were delivered and what waits.
    pub async fn retry_outbox(
        &self,
        agent: &str,
        key: &str,
        cancel: CancellationToken,
    ) -> Result<(u32, Vec<OutboxRow>), CoreError> {
        let (agent, key) = session_ref(agent, key)?;
        let rows = self.store.outbox_of_key(&agent, &key).await?;
        self.store.retry_outbox(&agent, &key).await?;
        let mut queues: Vec<(&str, &str)> =
            rows.iter().map(|r| (r.session_id.as_str(), r.engine_id.as_str())).collect();
        queues.sort_unstable();
        queues.dedup();
        for (session_id, engine_id) in queues {
            let _guard = self.gate.enter(session_id, &cancel, false).await?;
            self.drain_commits(session_id, engine_id, &cancel, true).await?;
        }
        let remaining = self.store.outbox_of_key(&agent, &key).await?;
        Ok((rows.len().saturating_sub(remaining.len()) as u32, remaining))
    }

    /// Drops the key's queued commits (audited in the store; the transcript
    /// is untouched), under each session's lock so that no delivery races.
    pub async fn drop_outbox(
        &self,
        agent: &str,
        key: &str,
        cancel: CancellationToken,
    ) -> Result<Vec<OutboxRow>, CoreError> {
        let (agent, key) = session_ref(agent, key)?;
        let mut guards = Vec::new();
        for session_id in self.store.session_ids(&agent, &key).await? {
            guards.push(self.gate.enter(&session_id, &cancel, false).await?);
        }
        let dropped = self.store.drop_outbox(&agent, &key).await?;
        for r in &dropped {
            tracing::warn!(
                session = r.session_id,
                key = r.advancement_key,
                engine = r.engine_id,
                attempts = r.attempts,
                "queued commit dropped by the operator: the engine will never receive this turn"
            );
        }
        Ok(dropped)
    }

    /// Owed ForgetSession calls, oldest first, at most `limit`; and how
    /// many more.
    pub async fn list_forgets(&self, limit: u32) -> Result<(Vec<Forget>, u32), CoreError> {
        Ok(self.store.list_forgets(limit).await?)
    }

    /// Drops the forgets owed to an engine gone from the config (a
    /// configured one's are delivered: refused), audited.
    pub async fn drop_forgets(&self, engine_id: &str) -> Result<Vec<Forget>, CoreError> {
        if self.engine_state(engine_id) != EngineState::NotConfigured {
            return Err(CoreError::Precondition(format!(
                "the engine {engine_id:?} is configured: its forgets are delivered, not dropped (remove it from the config first)"
            )));
        }
        let dropped = self.store.drop_forgets(engine_id).await?;
        for f in &dropped {
            tracing::warn!(
                session = f.session_id,
                engine = f.engine_id,
                "owed ForgetSession dropped by the operator: the engine is never told to forget this session"
            );
        }
        Ok(dropped)
    }

    /// The audited drops, newest first.
    pub async fn list_drops(&self, limit: u32) -> Result<(Vec<OutboxDrop>, u32), CoreError> {
        Ok(self.store.list_drops(limit).await?)
    }

    /// Forgets audited drops older than `store.auditRetentionDays`.
    pub async fn prune_audit(&self) -> Result<u32, CoreError> {
        let days = i64::from(self.audit_days);
        Ok(self.store.prune_drops(now_unix_ms().saturating_sub(days * 86_400_000)).await?)
    }
}

#[cfg(test)]
mod tests {
    use super::retry_after;

    #[test]
    fn refusals_back_off_from_one_second_doubling_to_five_minutes() {
        let secs: Vec<u64> = [1, 2, 3, 4, 9, 10, 40].iter().map(|n| retry_after(*n).as_secs()).collect();
        assert_eq!(secs, [1, 2, 4, 8, 256, 300, 300]);
    }
}
