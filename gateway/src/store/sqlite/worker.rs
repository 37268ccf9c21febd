//! The SQLite store's one thread: it owns the connection, runs reads as
//! they come and group-commits writes. Writes that arrive while the thread
//! is busy share the next transaction, and so its one fsync (with
//! `synchronous=FULL` the fsync, not SQL, bounds how many turns per second
//! one file takes); one thread means no lock on the connection and one
//! wake-up per batch instead of one per call.
//!
//! Each write runs inside its own savepoint of the batch's `BEGIN
//! IMMEDIATE … COMMIT`: a write that fails is rolled back alone and gets
//! its own error; the others commit. No write answers before its batch's
//! COMMIT returned, so an answer still means "durable"; a COMMIT that fails
//! fails every write of its batch (all were rolled back). Reads run outside
//! the batch, each in its own read transaction, so they never see a write
//! that might still roll back.
//!
//! The queue is bounded ([`QUEUE`]); a caller waits for room, and callers
//! are bounded by admission control. A queued call runs even if its caller
//! is cancelled, so a transaction is never abandoned half way.

use rusqlite::{Connection, TransactionBehavior};
use tokio::sync::{mpsc, oneshot};

use super::StoreError;
use crate::metrics::StoreCounters;

/// Calls waiting for the thread.
const QUEUE: usize = 1024;
/// Calls gathered into one round at most (reads and writes: a bound on how
/// long one batch holds its callers, whatever the mix).
const MAX_BATCH: usize = 256;

/// One write, run inside the batch's transaction.
trait Write: Send {
    /// Runs the write; its error when it failed (its savepoint is rolled
    /// back).
    fn run(&mut self, c: &Connection) -> Result<(), StoreError>;
    /// Answers the caller once the batch committed (or failed to).
    fn finish(self: Box<Self>, committed: Result<(), StoreError>);
}

struct Pending<T, F> {
    f: Option<F>,
    result: Option<Result<T, StoreError>>,
    reply: oneshot::Sender<Result<T, StoreError>>,
}

impl<T: Send, F: FnOnce(&Connection) -> Result<T, StoreError> + Send> Write for Pending<T, F> {
    fn run(&mut self, c: &Connection) -> Result<(), StoreError> {
        let Some(f) = self.f.take() else { return Err(StoreError::Backend("the write ran twice".into())) };
        let r = f(c);
        let outcome = r.as_ref().map(drop).map_err(Clone::clone);
        self.result = Some(r);
        outcome
    }

    fn finish(self: Box<Self>, committed: Result<(), StoreError>) {
        let answer = match (committed, self.result) {
            (_, Some(Err(e))) | (Err(e), _) => Err(e),
            (Ok(()), Some(ok)) => ok,
            (Ok(()), None) => Err(StoreError::Backend("the write never ran".into())),
        };
        // The caller may be gone (cancelled): the write stands anyway.
        let _ = self.reply.send(answer);
    }
}

enum Call {
    Read(Box<dyn FnOnce(&mut Connection) + Send>),
    Write(Box<dyn Write>),
}

/// The handle: a queue to the thread. Dropping the last handle stops the
/// thread after the calls already queued, and waits for it (so the
/// connection is closed, and the directory lock released, when the store is
/// gone).
pub(super) struct Worker {
    calls: Option<mpsc::Sender<Call>>,
    thread: Option<std::thread::JoinHandle<()>>,
    counts: StoreCounters,
}

impl Worker {
    /// Starts the thread; `keep` (the directory lock) lives as long as the
    /// connection.
    pub(super) fn start<K: Send + 'static>(conn: Connection, keep: K) -> std::io::Result<Self> {
        let (calls, rx) = mpsc::channel(QUEUE);
        let counts = StoreCounters::default();
        let c = counts.clone();
        let thread = std::thread::Builder::new().name("ctxgate-store".into()).spawn(move || {
            serve(conn, rx, &c);
            drop(keep);
        })?;
        Ok(Self { calls: Some(calls), thread: Some(thread), counts })
    }

    async fn send(&self, call: Call) -> Result<(), StoreError> {
        let gone = || StoreError::Backend("the store has stopped".into());
        self.calls.as_ref().ok_or_else(gone)?.send(call).await.map_err(|_| gone())
    }

    /// Runs `f` in a read transaction (one snapshot, one lock for all its
    /// statements).
    pub(super) async fn read<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let (reply, answer) = oneshot::channel();
        let call = move |c: &mut Connection| {
            let r = c.transaction().map_err(StoreError::from).and_then(|tx| f(&tx));
            let _ = reply.send(r);
        };
        self.send(Call::Read(Box::new(call))).await?;
        answer.await.map_err(|_| StoreError::Backend("a store read panicked".into()))?
    }

    /// Runs `f` in the next batch; answers after the batch committed.
    pub(super) async fn write<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let (reply, answer) = oneshot::channel();
        self.send(Call::Write(Box::new(Pending { f: Some(f), result: None, reply }))).await?;
        answer.await.map_err(|_| StoreError::Backend("a store write panicked".into()))?
    }

    /// Batches committed and the writes they held (shared counters).
    pub(super) fn counters(&self) -> StoreCounters {
        self.counts.clone()
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.calls.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The thread: take what is queued (waiting for the first), run the reads,
/// commit the writes as one batch, repeat until every handle is gone.
fn serve(mut conn: Connection, mut rx: mpsc::Receiver<Call>, counts: &StoreCounters) {
    let mut batch: Vec<Box<dyn Write>> = Vec::with_capacity(MAX_BATCH);
    while let Some(first) = rx.blocking_recv() {
        let (mut next, mut gathered) = (Some(first), 0);
        while let Some(call) = next.take() {
            match call {
                // A read that panics drops its answer; the thread goes on.
                Call::Read(read) => drop(std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| read(&mut conn)))),
                Call::Write(w) => batch.push(w),
            }
            gathered += 1;
            if gathered < MAX_BATCH {
                next = rx.try_recv().ok();
            }
        }
        if batch.is_empty() {
            continue;
        }
        // A panicking write must not take the thread (and every later
        // call) with it: its batch fails, the connection rolls back.
        let committed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_batch(&mut conn, &mut batch)))
            .unwrap_or_else(|_| Err(StoreError::Backend("a store write panicked; its batch was rolled back".into())));
        if committed.is_ok() {
            counts.commits.inc();
            counts.writes.inc_by(batch.len() as u64);
        }
        for w in batch.drain(..) {
            w.finish(committed.clone());
        }
    }
}

fn run_batch(conn: &mut Connection, batch: &mut [Box<dyn Write>]) -> Result<(), StoreError> {
    let mut tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    for w in batch.iter_mut() {
        let sp = tx.savepoint()?;
        match w.run(&sp) {
            Ok(()) => sp.commit()?,
            // Rolled back to where it began, on drop…
            Err(e) => {
                drop(sp);
                // …unless SQLite rolled back the whole transaction (a full
                // disk, an I/O error): then the writes before it are gone
                // too, and running the rest would commit them outside the
                // batch. The batch fails with that error.
                if tx.is_autocommit() {
                    return Err(e);
                }
            }
        }
    }
    tx.commit()?;
    Ok(())
}
