//! The embedded store: SQLite (WAL) in the state directory, which one
//! gateway owns (an advisory lock on `ctxgate.lock`). `open` takes the lock,
//! applies the migrations (`schema.rs`), rewinds the turns the last run
//! left open and hands the connection to its one thread (`worker.rs`).
//! The roles are implemented by what they touch: `sessions.rs` (sessions,
//! subagents), `transcript.rs` (the transcript tree, turns, cursors) and
//! `outbox.rs` (the outbox, engine records); the store's `tails.rs` keeps
//! the last visible tail read per session. Claims are the trait's "always
//! yours".

use std::path::Path;
use std::sync::Arc;

use rusqlite::Connection;

use super::tails::Tails;
use super::{Claims, OpenError, StoreError};

mod outbox;
mod schema;
mod sessions;
#[cfg(test)]
mod tests;
mod transcript;
mod worker;

pub use schema::SCHEMA_VERSION;

impl From<rusqlite::Error> for StoreError {
    fn from(e: rusqlite::Error) -> Self {
        match e.sqlite_error_code() {
            Some(rusqlite::ErrorCode::DiskFull) => Self::Full(e.to_string()),
            // The extended code says which I/O failed (the message does not).
            _ => Self::Backend(match &e {
                rusqlite::Error::SqliteFailure(f, _) => format!("{e} (SQLite extended code {})", f.extended_code),
                _ => e.to_string(),
            }),
        }
    }
}

/// The embedded SQLite store. One connection, used from blocking tasks
/// only (nothing touches SQLite on the async path); writes are group
/// committed (`worker`).
#[derive(Clone)]
pub struct SqliteStore {
    db: Arc<worker::Worker>,
    tails: Arc<std::sync::Mutex<Tails>>,
}

/// The database file in a state directory.
pub const DB_FILE: &str = "ctxgate.sqlite";
/// The lock file next to it (an advisory `flock`, released by the kernel
/// when the process dies, however it dies).
pub const LOCK_FILE: &str = "ctxgate.lock";

/// Takes the state directory's lock, or says who has it.
fn lock_dir(dir: &Path) -> Result<std::fs::File, OpenError> {
    let d = dir.display().to_string();
    std::fs::create_dir_all(dir).map_err(|e| dir_error(&d, &e))?;
    let path = dir.join(LOCK_FILE);
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| dir_error(&d, &e))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(OpenError::Locked { dir: d, lock: path.display().to_string() }),
        Err(std::fs::TryLockError::Error(e)) => Err(dir_error(&d, &e)),
    }
}

fn dir_error(dir: &str, e: &std::io::Error) -> OpenError {
    use std::io::ErrorKind::{PermissionDenied, ReadOnlyFilesystem};
    match e.kind() {
        ReadOnlyFilesystem | PermissionDenied => OpenError::ReadOnly { dir: dir.into() },
        _ if e.raw_os_error() == Some(28) => OpenError::Full(format!("{dir}: {e}")),
        _ => OpenError::Dir { dir: dir.into(), detail: e.to_string() },
    }
}

/// An error opening or migrating the database, as the operator needs it.
fn open_error(file: &Path, e: &rusqlite::Error) -> OpenError {
    let file = file.display().to_string();
    match e.sqlite_error_code() {
        Some(rusqlite::ErrorCode::NotADatabase | rusqlite::ErrorCode::DatabaseCorrupt) => {
            OpenError::Corrupt { file, detail: e.to_string() }
        }
        Some(rusqlite::ErrorCode::DiskFull) => OpenError::Full(format!("{file}: {e}")),
        _ => OpenError::Other { file, detail: e.to_string() },
    }
}

impl SqliteStore {
    /// Opens (creating or migrating) the store in `dir`. Fails with a
    /// sentence when the directory is not writable, another gateway holds
    /// it, or the file is corrupt or from a newer ctxgate.
    pub fn open(dir: &Path) -> Result<Self, OpenError> {
        let lock = lock_dir(dir)?;
        let file = dir.join(DB_FILE);
        let fail = |e: rusqlite::Error| open_error(&file, &e);
        let mut conn = Connection::open(&file).map_err(fail)?;
        // The first read of the header: a file that is not SQLite fails here.
        conn.pragma_update(None, "journal_mode", "WAL").map_err(fail)?;
        // FULL: an acknowledged message survives a power cut, not just a crash.
        conn.pragma_update(None, "synchronous", "FULL").map_err(fail)?;
        conn.pragma_update(None, "foreign_keys", "ON").map_err(fail)?;
        // Statement journals and sorts in memory, never in a temp file: an
        // image FROM scratch has no /tmp, and SQLite without a temp
        // directory fails those statements with "disk I/O error"
        // (SQLITE_IOERR_GETTEMPPATH). What they hold is bounded by one
        // statement over one session's visible history.
        conn.pragma_update(None, "temp_store", "MEMORY").map_err(fail)?;
        conn.busy_timeout(std::time::Duration::from_secs(5)).map_err(fail)?;
        // Every statement of a turn stays prepared…
        conn.set_prepared_statement_cache_capacity(64);
        // …and is not prepared again on each new binding: without the
        // query planner stability guarantee, SQLite (built with STAT4)
        // re-plans a statement whose parameter meets an indexed column
        // every time the parameter changes, i.e. on nearly every call.
        conn.set_db_config(rusqlite::config::DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG, true).map_err(fail)?;
        // 8 MiB of pages (SQLite's default is 2): a turn reads its session's
        // visible history, and re-reading it from the file was the largest
        // syscall cost at 64 sessions.
        conn.pragma_update(None, "cache_size", -8192).map_err(fail)?;
        schema::migrate(&mut conn, &file)?;
        transcript::recover_open_turns(&mut conn).map_err(|e| match e {
            StoreError::Full(detail) => OpenError::Full(detail),
            other => OpenError::Other { file: file.display().to_string(), detail: other.to_string() },
        })?;
        // The state directory's lock lives as long as the connection: one
        // SQLite file has one gateway.
        let worker = worker::Worker::start(conn, lock)
            .map_err(|e| OpenError::Other { file: file.display().to_string(), detail: e.to_string() })?;
        Ok(Self { db: Arc::new(worker), tails: Arc::default() })
    }

    /// Bounds the cache of visible tails to `mib` MiB of estimated heap
    /// (`store.tailCacheMiB`): sessions whose tails do not fit are read
    /// from the file each turn.
    pub fn with_tail_cache(self, mib: u32) -> Self {
        Self { tails: Arc::new(std::sync::Mutex::new(Tails::with_mib(mib))), ..self }
    }

    /// Batches committed and the writes they held, since the store opened
    /// (more writes than batches: group commit at work).
    pub fn commit_counts(&self) -> (u64, u64) {
        let c = self.db.counters();
        (c.commits.get(), c.writes.get())
    }

    /// The same counters, for the metrics endpoint.
    pub fn counters(&self) -> crate::metrics::StoreCounters {
        self.db.counters()
    }
}

/// One gateway owns the file (the directory lock): every session is always
/// its own, as the defaults say.
impl Claims for SqliteStore {}
