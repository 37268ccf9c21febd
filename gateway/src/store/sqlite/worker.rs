//! The SQLite store's one thread: `ctxgate-runtime`'s group-commit worker
//! ([`ctxgate_runtime::sqlite`], which says how batches, savepoints and
//! panics behave) with the gateway's error type and its commit counters.
//! Writes that arrive while the thread is busy share the next transaction
//! and its one fsync; a caller waits for room in the bounded queue, and
//! callers are bounded by admission control.

use ctxgate_runtime::sqlite::{self, Failure};
use rusqlite::Connection;

use super::StoreError;
use crate::metrics::StoreCounters;

impl Failure for StoreError {
    fn worker(message: &str) -> Self {
        Self::Backend(message.into())
    }
}

/// The handle. Dropping it stops the thread after the calls already queued
/// and waits for it (so the connection is closed, and the directory lock
/// released, when the store is gone).
pub(super) struct Worker {
    thread: sqlite::Worker<StoreError>,
    counts: StoreCounters,
}

impl Worker {
    /// Starts the thread; `keep` (the directory lock) lives as long as the
    /// connection.
    pub(super) fn start<K: Send + 'static>(conn: Connection, keep: K) -> std::io::Result<Self> {
        let counts = StoreCounters::default();
        let c = counts.clone();
        let thread = sqlite::Worker::start("ctxgate-store", conn, keep, move |writes| {
            c.commits.inc();
            c.writes.inc_by(writes as u64);
        })?;
        Ok(Self { thread, counts })
    }

    /// Runs `f` in a read transaction (one snapshot, one lock for all its
    /// statements).
    pub(super) async fn read<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        self.thread
            .read(move |c| {
                let tx = c.transaction()?;
                f(&tx)
            })
            .await
    }

    /// Runs `f` in the next batch; answers after the batch committed.
    pub(super) async fn write<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        self.thread.write(f).await
    }

    /// Batches committed and the writes they held (shared counters).
    pub(super) fn counters(&self) -> StoreCounters {
        self.counts.clone()
    }
}
