//! One turn (or compaction) at a time per session: the session locks, the
//! bounded queue behind a running turn, the busy policies, and Abort.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio_util::sync::CancellationToken;

use super::types::BusyPolicy;

/// Why a session could not be entered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BusyError {
    #[error("session busy: a turn is running (busy policy reject)")]
    Busy,
    #[error("session busy: {0} turns already wait for this session (gateway.limits.queuedTurnsPerSession)")]
    QueueFull(usize),
    /// The caller went away (or was interrupted) while it waited.
    #[error("cancelled while waiting for the session")]
    Cancelled,
}

struct Slot {
    lock: Arc<tokio::sync::Mutex<()>>,
    /// The running work's token (Abort and interrupt fire it).
    cancel: Option<CancellationToken>,
    /// Everyone waiting for the lock (the slot is forgotten at zero).
    waiting: usize,
    /// Client turns among them (counted against the queue limit).
    queued: usize,
    /// Numbers the waiters, so an interrupt can tell who came before it.
    next_ticket: u64,
    /// An interrupt that found the lock between two holders: the waiter it
    /// names was queued after whoever takes the lock next, who then counts
    /// as the running turn and leaves aborted.
    interrupt: Option<u64>,
}

/// The per-session locks. Shared (`Arc`) so a guard can outlive any borrow
/// of the core: a harness turn holds its guard across many requests.
#[derive(Default)]
pub struct SessionLocks {
    slots: Mutex<HashMap<String, Slot>>,
}

/// Holds a session: dropping it lets the next waiter in.
pub struct SessionGuard {
    locks: Arc<SessionLocks>,
    session_id: String,
    /// Released inside `drop`, under the map's lock, so a waiter giving up
    /// at the same moment sees either the holder or nobody.
    lock: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl Drop for SessionGuard {
    fn drop(&mut self) {
        let mut slots = self.locks.slots.lock().unwrap_or_else(|e| e.into_inner());
        drop(self.lock.take());
        if let Some(s) = slots.get_mut(&self.session_id) {
            s.cancel = None;
            // Nobody waits: forget the session.
            if s.waiting == 0 {
                slots.remove(&self.session_id);
            }
        }
    }
}

/// A waiter's place: given back when it stops waiting (entered,
/// cancelled, or dropped).
struct Waiting<'a> {
    locks: &'a SessionLocks,
    session_id: &'a str,
    ticket: u64,
    counted: bool,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let mut slots = self.locks.slots.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = slots.get_mut(self.session_id) {
            s.waiting = s.waiting.saturating_sub(1);
            if self.counted {
                s.queued = s.queued.saturating_sub(1);
            }
            if s.interrupt == Some(self.ticket) {
                s.interrupt = None;
            }
            // A waiter that gave up after the holder left: nobody holds or
            // waits for the session any more, forget it.
            if s.waiting == 0 && s.lock.try_lock().is_ok() {
                slots.remove(self.session_id);
            }
        }
    }
}

impl SessionLocks {
    /// Enters `session_id` under `policy`, registering `cancel` for Abort.
    /// `queue_limit` bounds how many client turns wait (for `Enqueue` and
    /// `Interrupt`); `None` is for the gateway's own bounded work (the
    /// outbox, background maintenance), which is not counted. A waiter
    /// whose `cancel` fires leaves at once, having changed nothing.
    pub async fn enter(
        self: &Arc<Self>,
        session_id: &str,
        cancel: &CancellationToken,
        policy: BusyPolicy,
        queue_limit: Option<usize>,
    ) -> Result<SessionGuard, BusyError> {
        let (lock, ticket) = {
            let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
            let slot = slots.entry(session_id.to_owned()).or_insert_with(|| Slot {
                lock: Arc::default(),
                cancel: None,
                waiting: 0,
                queued: 0,
                next_ticket: 0,
                interrupt: None,
            });
            // Nobody waits: take it if it is free. (With waiters, a newcomer
            // queues behind them even if the lock is free this instant.)
            if slot.waiting == 0
                && let Ok(guard) = slot.lock.clone().try_lock_owned()
            {
                slot.cancel = Some(cancel.clone());
                return Ok(self.guard(session_id, guard));
            }
            if policy == BusyPolicy::Reject {
                return Err(BusyError::Busy);
            }
            if let Some(limit) = queue_limit
                && slot.queued >= limit
            {
                return Err(BusyError::QueueFull(slot.queued));
            }
            let ticket = slot.next_ticket;
            slot.next_ticket += 1;
            if policy == BusyPolicy::Interrupt {
                match &slot.cancel {
                    Some(running) => running.cancel(),
                    // Between two holders: the next one is interrupted.
                    None => slot.interrupt = Some(ticket),
                }
            }
            slot.waiting += 1;
            if queue_limit.is_some() {
                slot.queued += 1;
            }
            (slot.lock.clone(), ticket)
        };
        let _waiting = Waiting { locks: self, session_id, ticket, counted: queue_limit.is_some() };
        let guard = tokio::select! {
            biased;
            () = cancel.cancelled() => return Err(BusyError::Cancelled),
            g = lock.lock_owned() => g,
        };
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        let Some(s) = slots.get_mut(session_id) else { return Err(BusyError::Cancelled) };
        match s.interrupt {
            Some(by) if by == ticket => s.interrupt = None,
            // Queued before an interrupt that came while the lock changed
            // hands: this one counts as the interrupted turn (one victim).
            Some(_) => {
                s.interrupt = None;
                return Err(BusyError::Cancelled);
            }
            None => {}
        }
        if cancel.is_cancelled() {
            return Err(BusyError::Cancelled);
        }
        s.cancel = Some(cancel.clone());
        drop(slots);
        Ok(self.guard(session_id, guard))
    }

    fn guard(self: &Arc<Self>, session_id: &str, lock: tokio::sync::OwnedMutexGuard<()>) -> SessionGuard {
        SessionGuard { locks: self.clone(), session_id: session_id.to_owned(), lock: Some(lock) }
    }

    /// Fires the running work's token. True if something ran.
    pub fn abort(&self, session_id: &str) -> bool {
        let slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        match slots.get(session_id).and_then(|s| s.cancel.as_ref()) {
            Some(c) => {
                c.cancel();
                true
            }
            None => false,
        }
    }

    pub fn is_busy(&self, session_id: &str) -> bool {
        self.slots.lock().unwrap_or_else(|e| e.into_inner()).get(session_id).is_some_and(|s| s.cancel.is_some())
    }

    /// Sessions with work running.
    pub fn running(&self) -> usize {
        self.slots.lock().unwrap_or_else(|e| e.into_inner()).values().filter(|s| s.cancel.is_some()).count()
    }

    /// Work waiting behind running work, over all sessions.
    pub fn queued(&self) -> usize {
        self.slots.lock().unwrap_or_else(|e| e.into_inner()).values().map(|s| s.queued).sum()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tokio_util::sync::CancellationToken;

    use super::{BusyError, SessionLocks};
    use crate::core::types::BusyPolicy;

    /// A refusal never waits for the session; nothing here waits long.
    const AT_ONCE: std::time::Duration = std::time::Duration::from_secs(5);

    /// `f`, or a failure naming `what` did not happen.
    async fn soon<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
        tokio::time::timeout(AT_ONCE, f).await.unwrap_or_else(|_| panic!("{what} did not happen within {AT_ONCE:?}"))
    }

    #[tokio::test]
    async fn policies_reject_queue_up_to_the_limit_and_interrupt() {
        let locks = Arc::new(SessionLocks::default());
        let first = CancellationToken::new();
        let running = locks.enter("s", &first, BusyPolicy::Enqueue, Some(1)).await.unwrap();
        assert!(locks.is_busy("s"));
        assert_eq!((locks.running(), locks.queued()), (1, 0), "what `status` shows as running and queued");
        // Refused at once: a refusal that waits for the holder is a broken
        // policy, and must fail here, not hang.
        let other = CancellationToken::new();
        let rejected = locks.enter("s", &other, BusyPolicy::Reject, Some(1));
        let e = soon("reject answering", rejected).await.err();
        assert_eq!(e, Some(BusyError::Busy));

        // One may wait; the second waiter is refused at once.
        let waiter_token = CancellationToken::new();
        let (l, t) = (locks.clone(), waiter_token.clone());
        let waiting = tokio::spawn(async move { l.enter("s", &t, BusyPolicy::Enqueue, Some(1)).await.map(|_| ()) });
        soon("the waiter queueing", async {
            while locks.slots.lock().unwrap().get("s").unwrap().queued == 0 {
                tokio::task::yield_now().await;
            }
        })
        .await;
        assert_eq!((locks.running(), locks.queued()), (1, 1));
        let full = locks.enter("s", &other, BusyPolicy::Enqueue, Some(1));
        let e = soon("a full queue answering", full).await.err();
        assert_eq!(e, Some(BusyError::QueueFull(1)));

        // A waiter that is cancelled leaves and frees its place.
        waiter_token.cancel();
        assert_eq!(soon("the cancelled waiter leaving", waiting).await.unwrap(), Err(BusyError::Cancelled));
        assert_eq!(locks.slots.lock().unwrap().get("s").unwrap().queued, 0);

        // Interrupt fires the running turn's token and gets in after it.
        let (l, t) = (locks.clone(), CancellationToken::new());
        let interrupting = tokio::spawn(async move { l.enter("s", &t, BusyPolicy::Interrupt, Some(1)).await.is_ok() });
        soon("the interrupt firing the running turn's token", first.cancelled()).await;
        drop(running);
        assert!(soon("the interrupting turn entering", interrupting).await.unwrap());
        assert!(!locks.is_busy("s"), "the guard was dropped with the task");
        assert!(locks.slots.lock().unwrap().is_empty(), "idle sessions are forgotten");
        assert_eq!((locks.running(), locks.queued()), (0, 0), "status shows nothing running");
    }

    /// Polls `f` once, without a runtime's help: it registers as a waiter
    /// (or finishes) and hands back what it left pending.
    fn poll_once<F: std::future::Future>(f: &mut std::pin::Pin<Box<F>>) -> std::task::Poll<F::Output> {
        f.as_mut().poll(&mut std::task::Context::from_waker(std::task::Waker::noop()))
    }

    #[tokio::test]
    async fn a_free_session_is_taken_at_once_under_every_policy() {
        let locks = Arc::new(SessionLocks::default());
        for policy in [BusyPolicy::Reject, BusyPolicy::Enqueue, BusyPolicy::Interrupt] {
            let t = CancellationToken::new();
            let guard = soon("a free session entering", locks.enter("s", &t, policy, Some(1))).await;
            assert!(guard.is_ok(), "{policy:?} on a free session: {:?}", guard.err());
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_waiter_that_gives_up_as_the_holder_leaves_lets_nobody_in_beside_and_leaves_nothing() {
        let locks = Arc::new(SessionLocks::default());
        let (first, next, late) = (CancellationToken::new(), CancellationToken::new(), CancellationToken::new());
        let running = locks.enter("s", &first, BusyPolicy::Enqueue, Some(8)).await.unwrap();
        let mut waiting = Box::pin(locks.enter("s", &next, BusyPolicy::Enqueue, Some(8)));
        let mut leaving = Box::pin(locks.enter("s", &late, BusyPolicy::Enqueue, Some(8)));
        assert!(poll_once(&mut waiting).is_pending() && poll_once(&mut leaving).is_pending());
        // The holder leaves and, before the next waiter runs, another gives up.
        drop(running);
        drop(leaving);
        // The session is still spoken for: a newcomer is refused, not let in
        // beside the waiter about to enter.
        let t = CancellationToken::new();
        let e = soon("reject answering", locks.enter("s", &t, BusyPolicy::Reject, Some(8))).await.err();
        assert_eq!(e, Some(BusyError::Busy), "a second turn got the session while one was entering");
        drop(soon("the waiter entering", waiting).await.unwrap());
        // The last waiter giving up just after the holder left: nothing of
        // the idle session stays in memory.
        let running = locks.enter("s", &first, BusyPolicy::Enqueue, Some(8)).await.unwrap();
        let mut giving_up = Box::pin(locks.enter("s", &late, BusyPolicy::Enqueue, Some(8)));
        assert!(poll_once(&mut giving_up).is_pending());
        drop(running);
        drop(giving_up);
        assert!(locks.slots.lock().unwrap().is_empty(), "an idle session stayed in the map");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn an_interrupt_withdrawn_between_two_holders_interrupts_nobody() {
        let locks = Arc::new(SessionLocks::default());
        let (first, next, impatient) = (CancellationToken::new(), CancellationToken::new(), CancellationToken::new());
        let running = locks.enter("s", &first, BusyPolicy::Enqueue, Some(8)).await.unwrap();
        let mut waiting = Box::pin(locks.enter("s", &next, BusyPolicy::Enqueue, Some(8)));
        assert!(poll_once(&mut waiting).is_pending());
        drop(running);
        // Between the two holders an interrupt arrives, then is withdrawn.
        let mut interrupting = Box::pin(locks.enter("s", &impatient, BusyPolicy::Interrupt, Some(8)));
        assert!(poll_once(&mut interrupting).is_pending());
        drop(interrupting);
        let entered = soon("the waiter entering", waiting).await;
        assert!(entered.is_ok(), "the waiter paid for an interrupt nobody made: {:?}", entered.err());
    }

    #[tokio::test(flavor = "current_thread")]
    async fn an_interrupt_between_two_holders_cancels_the_next_waiter_and_gets_in() {
        let locks = Arc::new(SessionLocks::default());
        let (first, next, urgent) = (CancellationToken::new(), CancellationToken::new(), CancellationToken::new());
        let running = locks.enter("s", &first, BusyPolicy::Enqueue, Some(8)).await.unwrap();
        let mut waiting = Box::pin(locks.enter("s", &next, BusyPolicy::Enqueue, Some(8)));
        assert!(poll_once(&mut waiting).is_pending());
        drop(running);
        // Nothing runs to be interrupted: the turn about to enter is the one.
        let mut interrupting = Box::pin(locks.enter("s", &urgent, BusyPolicy::Interrupt, Some(8)));
        assert!(poll_once(&mut interrupting).is_pending());
        let waited = soon("the waiter", waiting).await;
        assert_eq!(waited.err(), Some(BusyError::Cancelled), "the waiter queued before the interrupt is its victim");
        let interrupted = soon("the interrupt", interrupting).await;
        assert!(interrupted.is_ok(), "the interrupting turn runs: {:?}", interrupted.err());
    }

    #[tokio::test(flavor = "current_thread")]
    async fn an_interrupt_whose_victim_gave_up_gets_in_itself() {
        let locks = Arc::new(SessionLocks::default());
        let (first, next, urgent) = (CancellationToken::new(), CancellationToken::new(), CancellationToken::new());
        let running = locks.enter("s", &first, BusyPolicy::Enqueue, Some(8)).await.unwrap();
        let mut waiting = Box::pin(locks.enter("s", &next, BusyPolicy::Enqueue, Some(8)));
        assert!(poll_once(&mut waiting).is_pending());
        drop(running);
        let mut interrupting = Box::pin(locks.enter("s", &urgent, BusyPolicy::Interrupt, Some(8)));
        assert!(poll_once(&mut interrupting).is_pending());
        // The waiter it would have interrupted leaves first.
        drop(waiting);
        let interrupted = soon("the interrupt", interrupting).await;
        assert!(interrupted.is_ok(), "the interrupting turn interrupted itself: {:?}", interrupted.err());
    }
}
