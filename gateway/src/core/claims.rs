//! A session across gateways: the local lock (one turn at a time in this
//! process, with its busy policy and bounded queue) and, on a shared store,
//! the session's lease (one gateway at a time), renewed while held.
//!
//! The busy policy reads the same across gateways: `reject` fails at once
//! when another gateway holds the session; `enqueue` waits (polling the
//! lease, the caller's cancel ends the wait) while holding the local lock,
//! so this gateway's other waiters queue behind it as usual; `interrupt`
//! flags the holder's lease, whose renewal stops its turn. A renewal that
//! finds the lease taken over cancels the running turn: its writes would
//! be fenced anyway.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::core::CoreError;
use crate::core::session_locks::{BusyError, SessionGuard, SessionLocks};
use crate::core::types::BusyPolicy;
use crate::store::{Claim, Claimed, Renewal, Store};

/// First and longest pause between two claims of a session another
/// gateway holds.
const FIRST_POLL: Duration = Duration::from_millis(10);
const MAX_POLL: Duration = Duration::from_millis(250);

/// Holds a session; dropping it releases the lease (in the background),
/// then the local lock. [`Held::release`] releases the lease first.
pub struct Held {
    claim: Option<SessionClaim>,
    _local: SessionGuard,
}

/// This gateway's lease on a session in a shared store (one gateway at a
/// time), renewed while held. Not the engine lease a turn runs with.
struct SessionClaim {
    store: Arc<dyn Store>,
    /// `None` once released.
    claim: Option<Claim>,
    _renewal: tokio_util::sync::DropGuard,
}

impl Held {
    /// Gives the session up now: a turn releases its lease before its
    /// caller hears the outcome, so that the caller's next turn, sent to
    /// any gateway, finds the session free.
    pub async fn release(mut self) {
        if let Some(mut held) = self.claim.take()
            && let Some(claim) = held.claim.take()
            && let Err(e) = held.store.release_claim(&claim).await
        {
            // It expires by itself.
            tracing::warn!(session = claim.session_id, error = %e, "lease release failed");
        }
    }
}

impl Drop for SessionClaim {
    fn drop(&mut self) {
        let Some(claim) = self.claim.take() else { return };
        let store = self.store.clone();
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        runtime.spawn(async move {
            if let Err(e) = store.release_claim(&claim).await {
                tracing::warn!(session = claim.session_id, error = %e, "lease release failed");
            }
        });
    }
}

/// The session gate: who may work on a session now — one turn or
/// compaction at a time in this process (the local locks, with the busy
/// policies and the bounded queue) and, on a shared store, one gateway at a
/// time (the session's lease).
pub struct SessionGate {
    locks: Arc<SessionLocks>,
    store: Arc<dyn Store>,
    /// The lease a claim takes (`store.leaseSeconds`).
    ttl: Duration,
    /// How many clients' turns and compactions may wait for one session
    /// (`gateway.limits.queuedTurnsPerSession`).
    queue_limit: usize,
}

impl SessionGate {
    pub fn new(store: Arc<dyn Store>, ttl: Duration, queue_limit: usize) -> Self {
        Self { locks: Arc::default(), store, ttl, queue_limit }
    }

    /// Fires the running work's token on `session_id` here (Abort).
    pub fn abort(&self, session_id: &str) -> bool {
        self.locks.abort(session_id)
    }

    pub fn is_busy(&self, session_id: &str) -> bool {
        self.locks.is_busy(session_id)
    }

    /// Sessions with work running here.
    pub fn running(&self) -> usize {
        self.locks.running()
    }

    /// Turns and compactions waiting for a session here.
    pub fn queued(&self) -> usize {
        self.locks.queued()
    }

    /// Waits for the session (Enqueue: the caller's cancel ends the wait)
    /// for work that is not a turn. `bounded`: a client's (manual
    /// compaction) waits in the session's bounded queue; the gateway's own
    /// (the outbox, background maintenance) is bounded by construction.
    pub async fn enter(&self, session_id: &str, cancel: &CancellationToken, bounded: bool) -> Result<Held, CoreError> {
        let limit = bounded.then_some(self.queue_limit);
        self.hold(session_id, cancel, BusyPolicy::Enqueue, limit).await
    }

    /// Waits for the session as a turn does: under its busy policy, in the
    /// session's bounded queue (the wait is the turn's wait to start).
    pub async fn enter_turn(
        &self,
        session_id: &str,
        cancel: &CancellationToken,
        policy: BusyPolicy,
    ) -> Result<Held, CoreError> {
        self.hold(session_id, cancel, policy, Some(self.queue_limit)).await
    }

    /// Enters `session_id` under `policy` here and, on a shared store, claims
    /// it from the other gateways; `cancel` is the work's token (Abort,
    /// interrupts and a lost lease fire it).
    pub async fn hold(
        &self,
        session_id: &str,
        cancel: &CancellationToken,
        policy: BusyPolicy,
        queue_limit: Option<usize>,
    ) -> Result<Held, CoreError> {
        let local = self.locks.enter(session_id, cancel, policy, queue_limit).await?;
        if !self.store.shared() {
            return Ok(Held { claim: None, _local: local });
        }
        let ttl = self.ttl;
        let mut pause = FIRST_POLL;
        // Interrupt asks the holder to stop once, not every holder after it.
        let mut interrupt = policy == BusyPolicy::Interrupt;
        loop {
            let claimed = self.store.claim_session(session_id, ttl, interrupt).await?;
            interrupt = false;
            match claimed {
                Claimed::Held(claim) => {
                    let renewal = renew(self.store.clone(), claim.clone(), ttl, cancel.clone());
                    let held = SessionClaim { store: self.store.clone(), claim: Some(claim), _renewal: renewal };
                    return Ok(Held { claim: Some(held), _local: local });
                }
                Claimed::Busy { owner } => {
                    tracing::debug!(session = session_id, owner, ?pause, "session held by another gateway");
                    if policy == BusyPolicy::Reject {
                        return Err(CoreError::Busy(BusyError::Busy));
                    }
                    tokio::select! {
                        biased;
                        () = cancel.cancelled() => return Err(CoreError::Busy(BusyError::Cancelled)),
                        () = tokio::time::sleep(pause) => {}
                    }
                    pause = (pause * 2).min(MAX_POLL);
                }
            }
        }
    }
}

/// Renews `claim` every third of `ttl` until the guard drops.
fn renew(store: Arc<dyn Store>, claim: Claim, ttl: Duration, work: CancellationToken) -> tokio_util::sync::DropGuard {
    let stop = CancellationToken::new();
    let stopped = stop.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(ttl / 3);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        // When the lease surely still ran: from before the last renewal
        // that succeeded was sent.
        let mut held_since = tokio::time::Instant::now();
        let mut lost = false;
        loop {
            tokio::select! {
                () = stopped.cancelled() => break,
                _ = tick.tick(), if !lost => {
                    let sent = tokio::time::Instant::now();
                    match store.renew_claim(&claim, ttl).await {
                        Ok(Renewal::Held) => held_since = sent,
                        Ok(Renewal::Interrupted) => {
                            held_since = sent;
                            work.cancel();
                        }
                        Ok(Renewal::Lost) => {
                            tracing::warn!(session = claim.session_id, "the session's lease was taken over by another gateway; its turn here stops");
                            lost = true;
                            work.cancel();
                        }
                        // The store is out of reach: the turn goes on while its
                        // lease may still run, and stops once it may not (its
                        // writes would be refused anyway; its engine calls and
                        // model requests must not go on either).
                        Err(e) if held_since.elapsed() >= ttl => {
                            tracing::warn!(session = claim.session_id, error = %e, "the session's lease could not be renewed before it ran out; its turn here stops");
                            lost = true;
                            work.cancel();
                        }
                        Err(e) => tracing::warn!(session = claim.session_id, error = %e, "lease renewal failed; retried"),
                    }
                }
            }
        }
    });
    stop.drop_guard()
}
