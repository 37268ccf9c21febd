//! A SQLite connection on a thread of its own, with group commit (feature
//! `sqlite`). The gateway's embedded store and the window engine both keep
//! their state this way; an engine of yours that keeps state in SQLite can
//! too.
//!
//! The thread owns the connection: it runs reads as they come and
//! group-commits writes. Writes that arrive while it is busy share the next
//! transaction, and so its one fsync (with `synchronous=FULL` the fsync, not
//! SQL, bounds how many writes per second one file takes); one thread means
//! no lock on the connection and one wake-up per batch instead of one per
//! call.
//!
//! Each write runs inside its own savepoint of the batch's `BEGIN IMMEDIATE
//! … COMMIT`: a write that fails is rolled back alone and gets its own
//! error; the others commit. No write answers before its batch's COMMIT
//! returned, so an answer still means "durable"; a COMMIT that fails fails
//! every write of its batch (all were rolled back). Reads run between
//! batches, so they never see a write that might still roll back.
//!
//! The queue is bounded ([`QUEUE`]): a caller waits for room. A queued call
//! runs even if its caller is cancelled, so a transaction is never
//! abandoned half way. A call that panics loses its answer (a write, its
//! batch); the thread goes on serving.

use rusqlite::{Connection, TransactionBehavior};
use tokio::sync::{mpsc, oneshot};

/// Calls waiting for the thread.
pub const QUEUE: usize = 1024;
/// Calls gathered into one round at most (reads and writes: a bound on how
/// long one batch holds its callers, whatever the mix).
pub const MAX_BATCH: usize = 256;

/// The error type of a [`Worker`]'s calls: what a statement fails with, and
/// the worker's own failures (stopped, panicked), given to every write of a
/// failed batch (hence `Clone`).
pub trait Failure: From<rusqlite::Error> + Clone + Send + 'static {
    /// A failure of the worker itself, not of one statement.
    fn worker(message: &str) -> Self;
}

/// One write, run inside the batch's transaction.
trait Write<E>: Send {
    /// Runs the write; its error when it failed (its savepoint is rolled
    /// back).
    fn run(&mut self, c: &Connection) -> Result<(), E>;
    /// Answers the caller once the batch committed (or failed to).
    fn finish(self: Box<Self>, committed: Result<(), E>);
}

struct Pending<T, F, E> {
    f: Option<F>,
    result: Option<Result<T, E>>,
    reply: oneshot::Sender<Result<T, E>>,
}

impl<T: Send, E: Failure, F: FnOnce(&Connection) -> Result<T, E> + Send> Write<E> for Pending<T, F, E> {
    fn run(&mut self, c: &Connection) -> Result<(), E> {
        let Some(f) = self.f.take() else { return Err(E::worker("the write ran twice")) };
        let r = f(c);
        let outcome = r.as_ref().map(drop).map_err(Clone::clone);
        self.result = Some(r);
        outcome
    }

    fn finish(self: Box<Self>, committed: Result<(), E>) {
        let answer = match (committed, self.result) {
            (_, Some(Err(e))) | (Err(e), _) => Err(e),
            (Ok(()), Some(ok)) => ok,
            (Ok(()), None) => Err(E::worker("the write never ran")),
        };
        // The caller may be gone (cancelled): the write stands anyway.
        let _ = self.reply.send(answer);
    }
}

enum Call<E> {
    Read(Box<dyn FnOnce(&mut Connection) + Send>),
    Write(Box<dyn Write<E>>),
}

/// The handle: a queue to the thread. Dropping it stops the thread after
/// the calls already queued, and waits for it (so the connection is closed,
/// and whatever `keep` holds released, when the worker is gone).
pub struct Worker<E> {
    calls: Option<mpsc::Sender<Call<E>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl<E> std::fmt::Debug for Worker<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker").field("running", &self.calls.is_some()).finish()
    }
}

impl<E: Failure> Worker<E> {
    /// Starts the thread `name` on `conn`. `keep` (a directory lock, say)
    /// lives as long as the connection; `committed` is called after each
    /// batch that committed, with its number of writes.
    pub fn start<K: Send + 'static>(
        name: &str,
        conn: Connection,
        keep: K,
        committed: impl Fn(usize) + Send + 'static,
    ) -> std::io::Result<Self> {
        let (calls, rx) = mpsc::channel(QUEUE);
        let thread = std::thread::Builder::new().name(name.into()).spawn(move || {
            serve(conn, rx, committed);
            drop(keep);
        })?;
        Ok(Self { calls: Some(calls), thread: Some(thread) })
    }

    async fn send(&self, call: Call<E>) -> Result<(), E> {
        let gone = || E::worker("the store has stopped");
        self.calls.as_ref().ok_or_else(gone)?.send(call).await.map_err(|_| gone())
    }

    /// Runs `f` alone on the thread, between batches, outside any
    /// transaction: open one in `f` for a snapshot across statements.
    pub async fn read<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Connection) -> Result<T, E> + Send + 'static,
    ) -> Result<T, E> {
        let (reply, answer) = oneshot::channel();
        self.send(Call::Read(Box::new(move |c| drop(reply.send(f(c)))))).await?;
        answer.await.map_err(|_| E::worker("a store read panicked"))?
    }

    /// Runs `f` in the next batch, in a savepoint of its own (all of `f` or
    /// none of it is kept); answers after the batch committed.
    pub async fn write<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection) -> Result<T, E> + Send + 'static,
    ) -> Result<T, E> {
        let (reply, answer) = oneshot::channel();
        self.send(Call::Write(Box::new(Pending { f: Some(f), result: None, reply }))).await?;
        answer.await.map_err(|_| E::worker("a store write panicked"))?
    }

    /// Calls queued and not yet taken by the thread (the tests wait on it).
    #[cfg(test)]
    fn queued(&self) -> usize {
        self.calls.as_ref().map_or(0, |c| c.max_capacity() - c.capacity())
    }
}

impl<E> Drop for Worker<E> {
    fn drop(&mut self) {
        self.calls.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The thread: take what is queued (waiting for the first), run the reads,
/// commit the writes as one batch, repeat until the handle is gone.
fn serve<E: Failure>(mut conn: Connection, mut rx: mpsc::Receiver<Call<E>>, committed: impl Fn(usize)) {
    let mut batch: Vec<Box<dyn Write<E>>> = Vec::with_capacity(MAX_BATCH);
    while let Some(first) = rx.blocking_recv() {
        let (mut next, mut gathered) = (Some(first), 0);
        while let Some(call) = next.take() {
            match call {
                Call::Read(read) => {
                    // A read that panics drops its answer; the thread goes on.
                    drop(std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| read(&mut conn))));
                    // A read gets the bare connection: one that left a
                    // transaction open must not hold the next batch's lock.
                    if !conn.is_autocommit() {
                        let _ = conn.execute_batch("ROLLBACK");
                    }
                }
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
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_batch(&mut conn, &mut batch)))
            .unwrap_or_else(|_| Err(E::worker("a store write panicked; its batch was rolled back")));
        if outcome.is_ok() {
            // The caller's counter: a panic there must not take the thread.
            drop(std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| committed(batch.len()))));
        }
        for w in batch.drain(..) {
            w.finish(outcome.clone());
        }
    }
}

fn run_batch<E: Failure>(conn: &mut Connection, batch: &mut [Box<dyn Write<E>>]) -> Result<(), E> {
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[derive(Clone, Debug)]
    struct Text(String);

    impl From<rusqlite::Error> for Text {
        fn from(e: rusqlite::Error) -> Self {
            Self(e.to_string())
        }
    }

    impl Failure for Text {
        fn worker(message: &str) -> Self {
            Self(message.into())
        }
    }

    type Batches = Arc<AtomicUsize>;

    fn open() -> (Arc<Worker<Text>>, Batches, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let conn = Connection::open(dir.path().join("t.sqlite")).unwrap();
        conn.execute_batch("PRAGMA journal_mode=WAL; CREATE TABLE t (k TEXT PRIMARY KEY);").unwrap();
        let batches = Batches::default();
        let counted = batches.clone();
        let worker = Worker::start("test-store", conn, (), move |_| {
            counted.fetch_add(1, Ordering::SeqCst);
        });
        (Arc::new(worker.unwrap()), batches, dir)
    }

    /// Holds the thread in a read until the returned sender is dropped, so
    /// the calls sent meanwhile queue up.
    async fn hold(worker: &Arc<Worker<Text>>) -> std::sync::mpsc::Sender<()> {
        let (release, held) = std::sync::mpsc::channel::<()>();
        let (started, running) = oneshot::channel();
        let w = worker.clone();
        tokio::spawn(async move {
            w.read(move |_| {
                let _ = started.send(());
                let _ = held.recv();
                Ok(())
            })
            .await
        });
        running.await.unwrap();
        release
    }

    async fn until_queued(worker: &Worker<Text>, n: usize) {
        while worker.queued() < n {
            tokio::task::yield_now().await;
        }
    }

    fn insert(worker: &Arc<Worker<Text>>, k: &str) -> tokio::task::JoinHandle<Result<(), Text>> {
        let (w, k) = (worker.clone(), k.to_owned());
        tokio::spawn(async move {
            w.write(move |c| c.execute("INSERT INTO t VALUES (?1)", [k]).map(drop).map_err(Text::from)).await
        })
    }

    async fn keys(worker: &Worker<Text>) -> Vec<String> {
        worker
            .read(|c| {
                let mut stmt = c.prepare("SELECT k FROM t ORDER BY k")?;
                Ok(stmt.query_map([], |r| r.get(0))?.collect::<Result<_, _>>()?)
            })
            .await
            .unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn writes_queued_while_the_thread_is_busy_share_one_commit() {
        let (worker, batches, _dir) = open();
        let release = hold(&worker).await;
        let writes: Vec<_> = (0..8).map(|i| insert(&worker, &format!("k{i}"))).collect();
        until_queued(&worker, 8).await;
        drop(release);
        for w in writes {
            w.await.unwrap().unwrap();
        }
        assert_eq!(batches.load(Ordering::SeqCst), 1, "eight queued writes, one transaction");
        assert_eq!(keys(&worker).await.len(), 8);
        // A write that comes alone is its own batch, answered all the same.
        insert(&worker, "alone").await.unwrap().unwrap();
        assert_eq!(batches.load(Ordering::SeqCst), 2);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_write_is_rolled_back_alone_and_a_panic_fails_only_its_batch() {
        let (worker, batches, _dir) = open();
        let release = hold(&worker).await;
        let first = insert(&worker, "kept");
        until_queued(&worker, 1).await;
        let w = worker.clone();
        let failing = tokio::spawn(async move {
            w.write(|c| {
                c.execute("INSERT INTO t VALUES ('rolled-back')", [])?;
                c.execute("INSERT INTO no_such_table VALUES (1)", []).map(drop).map_err(Text::from)
            })
            .await
        });
        until_queued(&worker, 2).await;
        let last = insert(&worker, "also-kept");
        until_queued(&worker, 3).await;
        drop(release);
        first.await.unwrap().unwrap();
        assert!(failing.await.unwrap().unwrap_err().0.contains("no_such_table"));
        last.await.unwrap().unwrap();
        assert_eq!(batches.load(Ordering::SeqCst), 1);
        assert_eq!(keys(&worker).await, ["also-kept", "kept"]);

        // A write that panics fails its batch, rolled back whole; the
        // thread goes on serving.
        let release = hold(&worker).await;
        let lost = insert(&worker, "in-the-panicked-batch");
        until_queued(&worker, 1).await;
        let w = worker.clone();
        let panics = tokio::spawn(async move { w.write(|_| -> Result<(), Text> { panic!("a bug") }).await });
        until_queued(&worker, 2).await;
        drop(release);
        assert!(lost.await.unwrap().unwrap_err().0.contains("panicked"));
        assert!(panics.await.unwrap().is_err());
        insert(&worker, "after").await.unwrap().unwrap();
        assert_eq!(keys(&worker).await, ["after", "also-kept", "kept"]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_read_that_leaves_a_transaction_open_does_not_block_the_writes() {
        let (worker, _batches, _dir) = open();
        worker.read(|c| Ok(c.execute_batch("BEGIN IMMEDIATE; INSERT INTO t VALUES ('uncommitted')")?)).await.unwrap();
        insert(&worker, "written").await.unwrap().unwrap();
        assert_eq!(keys(&worker).await, ["written"]);
    }
}
