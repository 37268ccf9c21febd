//! The store: sessions and their transcript trees. A trait, so a PostgreSQL
//! backend can join later; SQLite (WAL) is the embedded default.
//!
//! A transcript is a tree of entries (message or compaction) linked by
//! `parent_id`; a session's active leaf names the branch in use. Every
//! method is one transaction, so a crash at any point leaves each session
//! readable and consistent: an append is either all there or not at all.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use ctxgate_proto::pb::{self, AgentMessage, transcript_entry::Entry};
use prost::Message as _;
use rusqlite::{Connection, OptionalExtension, params};

pub mod postgres;
mod tails;
mod worker;

#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("session {0} does not exist")]
    NoSession(String),
    /// The disk (or the database's size limit) is full: the write was
    /// rolled back whole; reads still work.
    #[error("the state storage is full: {0}")]
    Full(String),
    #[error("storage failure: {0}")]
    Backend(String),
    /// A write for a session this gateway no longer holds (its lease
    /// expired and another gateway took the session over): refused whole.
    #[error("session {0} was taken over by another gateway; this gateway's write was refused")]
    Fenced(String),
    /// The shared store cannot be reached or is overloaded right now
    /// (connection lost, pool exhausted, lock timeout): retry later.
    #[error("the store is unavailable: {0}")]
    Unavailable(String),
}

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

/// Why the store cannot be opened: each a sentence for the operator.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("the state directory {dir} cannot be used: {detail}")]
    Dir { dir: String, detail: String },
    #[error("the state directory {dir} is read-only: ctxgate needs to write its database there")]
    ReadOnly { dir: String },
    #[error(
        "another ctxgate gateway is already using the state directory {dir} (lock {lock}); only a PostgreSQL store can be shared by several gateways"
    )]
    Locked { dir: String, lock: String },
    #[error("{file} is not a ctxgate database or is corrupt ({detail}); restore it from a backup or move it away")]
    Corrupt { file: String, detail: String },
    #[error(
        "{file} was written by a newer ctxgate (schema version {found}; this build knows up to {known}); upgrade ctxgate"
    )]
    NewerSchema { file: String, found: i64, known: i64 },
    #[error("the state storage is full: {0}")]
    Full(String),
    #[error("cannot open the database {file}: {detail}")]
    Other { file: String, detail: String },
}

/// A session row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    pub session_id: String,
    pub agent_id: String,
    pub session_key: String,
    /// "active", "inactive" or "archived".
    pub state: String,
    pub created_at_ms: i64,
}

/// A session with its transcript counts (listings).
#[derive(Debug, Clone)]
pub struct SessionStats {
    pub session: Session,
    pub entries: u32,
    pub compactions: u32,
}

/// What to append: the store assigns id, parent and seq.
#[derive(Debug, Clone)]
pub struct NewEntry {
    pub turn_id: String,
    pub entry: Entry,
}

#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// The active session of a key, created when `create` and missing.
    async fn session(&self, agent: &str, key: &str, create: bool) -> Result<Option<Session>, StoreError>;
    /// Starts a fresh session for the key; the previous one becomes
    /// "archived" when `archive`, else "inactive".
    async fn replace_session(&self, agent: &str, key: &str, archive: bool) -> Result<Session, StoreError>;
    /// Sessions in (agent, key, creation) order: at most `limit` from
    /// `offset` on.
    async fn list_sessions(
        &self,
        agent: Option<&str>,
        include_archived: bool,
        offset: u64,
        limit: u32,
    ) -> Result<Vec<SessionStats>, StoreError>;
    /// Archives the key's active session without starting a new one.
    async fn archive_session(&self, agent: &str, key: &str) -> Result<bool, StoreError>;
    /// Deletes every session of the key with its entries, queued commits
    /// and subagent records, and queues a ForgetSession for every engine
    /// that saw one of them, in one transaction.
    async fn delete_sessions(&self, agent: &str, key: &str) -> Result<u32, StoreError>;
    /// The ids of every session of the key (any state).
    async fn session_ids(&self, agent: &str, key: &str) -> Result<Vec<String>, StoreError>;
    /// Appends entries to the session's active branch, atomically.
    async fn append(&self, session_id: &str, entries: Vec<NewEntry>) -> Result<Vec<pb::TranscriptEntry>, StoreError>;
    /// The active branch, oldest first.
    async fn branch(&self, session_id: &str) -> Result<Vec<pb::TranscriptEntry>, StoreError>;
    /// The end of the active branch that the visible history needs: from
    /// the latest compaction's first kept entry onwards (the whole branch
    /// if it was never compacted). `transcript::visible` of it equals that
    /// of the whole branch, at a cost bounded by the context window rather
    /// than the session's age.
    async fn visible_tail(&self, session_id: &str) -> Result<Vec<pb::TranscriptEntry>, StoreError>;
    async fn count_sessions(&self) -> Result<u32, StoreError>;
    /// Applies transcript replacements (message id → new message) as a new
    /// branch from the parent of the first replaced entry; the old branch
    /// stays for audit. One transaction.
    async fn rewrite(
        &self,
        session_id: &str,
        replacements: Vec<(String, AgentMessage)>,
    ) -> Result<RewriteOutcome, StoreError>;
    /// Appends a turn's admitted entries and records the turn as open, in
    /// one transaction. A turn that is never closed (the gateway died) is
    /// rewound when the store is next opened, as an abort is. `seen_by`
    /// notes the engine serving the turn (see [`Store::note_engine_session`]).
    async fn open_turn(
        &self,
        session_id: &str,
        turn_id: &str,
        entries: Vec<NewEntry>,
        seen_by: Option<&str>,
    ) -> Result<Vec<pb::TranscriptEntry>, StoreError>;
    /// Closes the session's open turn (see [`TurnClose`]); returns the
    /// entries appended by an accepting close.
    async fn close_turn(&self, session_id: &str, close: TurnClose) -> Result<Vec<pb::TranscriptEntry>, StoreError>;
    /// Records the thread-bootstrap projection delivered to `host_id` for a
    /// session; true when it differs from the one recorded before (the
    /// host must re-inject).
    async fn record_projection(
        &self,
        session_id: &str,
        host_id: &str,
        epoch: &str,
        fingerprint: &str,
    ) -> Result<bool, StoreError>;
    /// The session's queued commits for one engine, oldest first.
    async fn pending_commits(&self, session_id: &str, engine_id: &str) -> Result<Vec<PendingCommit>, StoreError>;
    /// (session, engine) pairs with a commit due at `now_ms` for one of
    /// `engines` (those in service: rows for others never crowd them out),
    /// the longest-waiting first.
    async fn due_commits(&self, now_ms: i64, engines: &[String]) -> Result<Vec<(String, String)>, StoreError>;
    /// Removes a delivered commit and, in the same transaction, moves the
    /// engine's cursor (if it has one) over the commit's messages.
    async fn complete_commit(
        &self,
        session_id: &str,
        advancement_key: &str,
        advance: Option<Advance>,
    ) -> Result<(), StoreError>;
    /// Engines whose last attach declared durable turns.
    async fn durable_engines(&self) -> Result<Vec<String>, StoreError>;
    /// Records whether an engine's attach declared durable turns.
    async fn set_durable(&self, engine_id: &str, durable: bool) -> Result<(), StoreError>;
    /// A DELTA engine's cursor for a session.
    async fn cursor(&self, session_id: &str, engine_id: &str) -> Result<Option<pb::HistoryCursor>, StoreError>;
    /// Sets (or, with `None`, forgets) a DELTA engine's cursor.
    async fn set_cursor(
        &self,
        session_id: &str,
        engine_id: &str,
        cursor: Option<pb::HistoryCursor>,
    ) -> Result<(), StoreError>;
    /// The active branch after the cursor's message, oldest first, read from
    /// the leaf back (cost bounded by what is new, not by the session's
    /// age); `None` when the cursor's message is not on the branch.
    async fn branch_after(
        &self,
        session_id: &str,
        cursor: &pb::HistoryCursor,
    ) -> Result<Option<Vec<pb::TranscriptEntry>>, StoreError>;
    /// Records the engine's refusal of a commit: one more attempt, its
    /// error, and when to try again.
    async fn refuse_commit(
        &self,
        session_id: &str,
        advancement_key: &str,
        error: &str,
        next_attempt_ms: i64,
    ) -> Result<(), StoreError>;
    /// Queued commits with their sessions, oldest first, at most `limit`;
    /// and how many more there are.
    async fn list_outbox(&self, agent: Option<&str>, limit: u32) -> Result<(Vec<OutboxRow>, u32), StoreError>;
    /// The queued commits of a key's sessions (any engine), oldest first.
    async fn outbox_of_key(&self, agent: &str, key: &str) -> Result<Vec<OutboxRow>, StoreError>;
    /// Makes the key's queued commits due now; returns how many there are.
    async fn retry_outbox(&self, agent: &str, key: &str) -> Result<u32, StoreError>;
    /// Drops the key's queued commits, each recorded in `outbox_drops`, in
    /// one transaction; returns them.
    async fn drop_outbox(&self, agent: &str, key: &str) -> Result<Vec<OutboxRow>, StoreError>;
    /// Queued and refused (blocked) commits.
    async fn outbox_counts(&self) -> Result<(u32, u32), StoreError>;
    /// Notes that an engine has seen a session (it is told to forget it
    /// when the session is deleted).
    async fn note_engine_session(&self, session_id: &str, engine_id: &str) -> Result<(), StoreError>;
    /// ForgetSession calls due at `now_ms` to one of `engines`.
    async fn pending_forgets(&self, now_ms: i64, engines: &[String]) -> Result<Vec<Forget>, StoreError>;
    /// Removes a delivered forget, or (`retry_at`) records a failed one.
    async fn settle_forget(
        &self,
        session_id: &str,
        engine_id: &str,
        retry_at: Option<(i64, &str)>,
    ) -> Result<(), StoreError>;
    /// Records a live subagent.
    async fn add_subagent(&self, s: Subagent) -> Result<(), StoreError>;
    /// Removes and returns a subagent record.
    async fn take_subagent(&self, agent: &str, child_key: &str) -> Result<Option<Subagent>, StoreError>;
    /// Subagents whose ttl ended before `now_ms`.
    async fn expired_subagents(&self, now_ms: i64) -> Result<Vec<Subagent>, StoreError>;

    // --- sessions shared by several gateways ---------------------------------
    //
    // A store that one gateway owns (SQLite: the directory lock) needs none
    // of this, so these default to "always yours". A shared store leases
    // sessions: a turn holds its session's lease (owner, expiry, fencing
    // token) while it runs, and every write of the session checks the token
    // the store handed out, so a gateway whose lease was taken over can
    // never write again.

    /// Whether several gateways share this store.
    fn shared(&self) -> bool {
        false
    }

    /// Claims `session_id` for this gateway for `ttl`, when nobody else
    /// holds it (a turn left open by an earlier holder is rewound first, as
    /// an abort is). `interrupt`: ask the holder to stop (busy policy
    /// interrupt) when it is held.
    async fn claim_session(&self, session_id: &str, ttl: Duration, interrupt: bool) -> Result<Claimed, StoreError> {
        let _ = (ttl, interrupt);
        Ok(Claimed::Held(Claim { session_id: session_id.into(), token: 0 }))
    }

    /// Extends a held claim: `Held`, `Interrupted` (another gateway asked
    /// its turn to stop) or `Lost` (the lease expired and someone took it).
    async fn renew_claim(&self, claim: &Claim, ttl: Duration) -> Result<Renewal, StoreError> {
        let _ = (claim, ttl);
        Ok(Renewal::Held)
    }

    /// Gives a claim up (a no-op when it was taken over meanwhile).
    async fn release_claim(&self, claim: &Claim) -> Result<(), StoreError> {
        let _ = claim;
        Ok(())
    }

    /// Asks whichever gateway holds `session_id` to stop its turn; true if
    /// one held it.
    async fn interrupt_holder(&self, session_id: &str) -> Result<bool, StoreError> {
        let _ = session_id;
        Ok(false)
    }

    /// Sessions with a turn left open by a gateway whose lease on them
    /// lapsed (it died): claiming one rewinds the turn. A store one gateway
    /// owns rewinds them all when it opens.
    async fn abandoned_turns(&self) -> Result<Vec<String>, StoreError> {
        Ok(Vec::new())
    }
}

/// A session held by this gateway in a shared store; `token` fences its
/// writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    pub session_id: String,
    pub token: i64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claimed {
    Held(Claim),
    /// Another gateway holds the session.
    Busy {
        owner: String,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renewal {
    Held,
    Interrupted,
    Lost,
}

/// A durable turn's commit before the turn is closed.
#[derive(Debug, Clone)]
pub struct CommitDraft {
    pub engine_id: String,
    /// Admission and session fields; the store adds the terminal anchor and
    /// the turn's messages (the closed range admission..terminal).
    pub request: pb::CommitTurnRequest,
}

/// How a turn closes. Built once per turn: not worth a box.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum TurnClose {
    /// Append `entries` (the last ones, e.g. the managed reply) and queue
    /// the durable commit, in one transaction: a stored reply always has
    /// its commit queued.
    Accept { entries: Vec<NewEntry>, commit: Option<CommitDraft> },
    /// Aborted or failed: the active leaf goes back to the admitted entry,
    /// so the turn's own messages leave the branch (they stay in the tree).
    /// Compaction entries written during the turn are carried over unless
    /// they keep from a dropped message.
    Rewind,
}

/// A queued commit.
#[derive(Debug, Clone)]
pub struct PendingCommit {
    pub engine_id: String,
    pub request: pb::CommitTurnRequest,
    /// Deliveries the engine refused so far (0: never refused).
    pub attempts: u32,
    pub last_error: Option<String>,
    /// Not retried before this time (unix ms; 0 = now).
    pub next_attempt_ms: i64,
}

/// A delivered commit's messages, added to the engine's cursor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Advance {
    pub engine_id: String,
    pub last_message_id: String,
    pub seq: u64,
    pub messages: u64,
    pub tokens: u64,
}

/// A queued commit as listed (`ctxgate outbox ls`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxRow {
    pub agent_id: String,
    pub session_key: String,
    pub session_id: String,
    pub advancement_key: String,
    pub engine_id: String,
    pub attempts: u32,
    pub last_error: Option<String>,
    pub next_attempt_ms: i64,
    pub created_at_ms: i64,
}

/// A ForgetSession owed to an engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Forget {
    pub session_id: String,
    pub engine_id: String,
    pub agent_id: String,
    pub session_key: String,
    pub attempts: u32,
}

/// A live subagent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subagent {
    pub agent_id: String,
    pub child_key: String,
    pub parent_key: String,
    pub rollback_token: Option<String>,
    pub expires_at_ms: Option<i64>,
}

/// What a rewrite did (OpenClaw's TranscriptRewriteResult).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RewriteOutcome {
    pub changed: bool,
    pub bytes_freed: i64,
    pub rewritten_entries: u32,
    pub reason: String,
    /// Old entry id → the id of its copy on the new branch.
    pub remap: std::collections::HashMap<String, String>,
}

/// Schema migrations in order; `PRAGMA user_version` is how many have been
/// applied. A database from before versioning (version 0) already has the
/// first one's tables, which it creates only if missing.
const MIGRATIONS: &[&str] = &[SCHEMA_V1, SCHEMA_V2, SCHEMA_V3, SCHEMA_V4];
/// The schema version this build writes (`PRAGMA user_version`).
pub const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

const SCHEMA_V1: &str = "
CREATE TABLE IF NOT EXISTS sessions (
    session_id    TEXT PRIMARY KEY,
    agent_id      TEXT NOT NULL,
    session_key   TEXT NOT NULL,
    state         TEXT NOT NULL,
    created_at_ms INTEGER NOT NULL,
    leaf_id       TEXT,
    next_seq      INTEGER NOT NULL DEFAULT 1
);
CREATE INDEX IF NOT EXISTS sessions_by_key ON sessions (agent_id, session_key, state);
CREATE TABLE IF NOT EXISTS entries (
    id         TEXT PRIMARY KEY,
    session_id TEXT NOT NULL REFERENCES sessions (session_id) ON DELETE CASCADE,
    parent_id  TEXT,
    seq        INTEGER NOT NULL,
    kind       INTEGER NOT NULL,
    body       BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS entries_by_session ON entries (session_id, seq);
CREATE TABLE IF NOT EXISTS outbox (
    session_id      TEXT NOT NULL,
    advancement_key TEXT NOT NULL,
    engine_id       TEXT NOT NULL,
    payload         BLOB NOT NULL,
    created_at_ms   INTEGER NOT NULL,
    PRIMARY KEY (session_id, advancement_key)
);
CREATE TABLE IF NOT EXISTS projections (
    session_id  TEXT NOT NULL REFERENCES sessions (session_id) ON DELETE CASCADE,
    host_id     TEXT NOT NULL,
    epoch       TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    PRIMARY KEY (session_id, host_id)
);
CREATE TABLE IF NOT EXISTS open_turns (
    session_id     TEXT PRIMARY KEY REFERENCES sessions (session_id) ON DELETE CASCADE,
    turn_id        TEXT NOT NULL,
    first_entry_id TEXT NOT NULL,
    anchor_id      TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS subagents (
    agent_id       TEXT NOT NULL,
    child_key      TEXT NOT NULL,
    parent_key     TEXT NOT NULL,
    rollback_token TEXT,
    expires_at_ms  INTEGER,
    PRIMARY KEY (agent_id, child_key)
);
";

/// Engines known to be durable, remembered across restarts: a turn served
/// by legacy before such an engine's first attach is still queued for it.
const SCHEMA_V4: &str = "
CREATE TABLE durable_engines (engine_id TEXT PRIMARY KEY) WITHOUT ROWID;
";

/// DELTA engines' cursors: what each engine acknowledged of each session.
const SCHEMA_V3: &str = "
CREATE TABLE cursors (
    session_id    TEXT NOT NULL,
    engine_id     TEXT NOT NULL,
    message_id    TEXT NOT NULL,
    seq           INTEGER NOT NULL,
    message_count INTEGER NOT NULL,
    tokens        INTEGER NOT NULL,
    PRIMARY KEY (session_id, engine_id)
) WITHOUT ROWID;
";

/// Refused commits (attempts, error, backoff), audited drops, which engines
/// saw a session, and ForgetSession calls owed after a delete.
const SCHEMA_V2: &str = "
ALTER TABLE outbox ADD COLUMN attempts INTEGER NOT NULL DEFAULT 0;
ALTER TABLE outbox ADD COLUMN last_error TEXT;
ALTER TABLE outbox ADD COLUMN next_attempt_ms INTEGER NOT NULL DEFAULT 0;
CREATE INDEX outbox_by_engine ON outbox (session_id, engine_id);
CREATE TABLE outbox_drops (
    session_id      TEXT NOT NULL,
    agent_id        TEXT NOT NULL,
    session_key     TEXT NOT NULL,
    advancement_key TEXT NOT NULL,
    engine_id       TEXT NOT NULL,
    attempts        INTEGER NOT NULL,
    last_error      TEXT,
    dropped_at_ms   INTEGER NOT NULL
);
CREATE TABLE engine_sessions (
    session_id TEXT NOT NULL,
    engine_id  TEXT NOT NULL,
    PRIMARY KEY (session_id, engine_id)
) WITHOUT ROWID;
CREATE TABLE forgets (
    session_id      TEXT NOT NULL,
    engine_id       TEXT NOT NULL,
    agent_id        TEXT NOT NULL,
    session_key     TEXT NOT NULL,
    attempts        INTEGER NOT NULL DEFAULT 0,
    last_error      TEXT,
    next_attempt_ms INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (session_id, engine_id)
);
";

const KIND_MESSAGE: i64 = 1;
const KIND_COMPACTION: i64 = 2;

/// The embedded SQLite store. One connection, used from blocking tasks
/// only (nothing touches SQLite on the async path); writes are group
/// committed (`worker`).
#[derive(Clone)]
pub struct SqliteStore {
    db: Arc<worker::Worker>,
    tails: Arc<std::sync::Mutex<tails::Tails>>,
}

fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

fn new_id() -> String {
    uuid::Uuid::new_v4().simple().to_string()
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

/// Applies the migrations the database lacks, each in its own transaction.
fn migrate(conn: &mut Connection, file: &Path) -> Result<(), OpenError> {
    let fail = |e: rusqlite::Error| open_error(file, &e);
    let found: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0)).map_err(fail)?;
    let known = SCHEMA_VERSION;
    if found > known {
        return Err(OpenError::NewerSchema { file: file.display().to_string(), found, known });
    }
    for (done, sql) in MIGRATIONS.iter().enumerate().skip(found.max(0) as usize) {
        let tx = conn.transaction().map_err(fail)?;
        tx.execute_batch(sql).map_err(fail)?;
        tx.pragma_update(None, "user_version", done as i64 + 1).map_err(fail)?;
        tx.commit().map_err(fail)?;
    }
    Ok(())
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
        // Every statement of a turn stays prepared.
        conn.set_prepared_statement_cache_capacity(64);
        // 8 MiB of pages (SQLite's default is 2): a turn reads its session's
        // visible history, and re-reading it from the file was the largest
        // syscall cost at 64 sessions.
        conn.pragma_update(None, "cache_size", -8192).map_err(fail)?;
        migrate(&mut conn, &file)?;
        recover_open_turns(&mut conn).map_err(|e| match e {
            StoreError::Full(detail) => OpenError::Full(detail),
            other => OpenError::Other { file: file.display().to_string(), detail: other.to_string() },
        })?;
        // The state directory's lock lives as long as the connection: one
        // SQLite file has one gateway.
        let worker = worker::Worker::start(conn, lock)
            .map_err(|e| OpenError::Other { file: file.display().to_string(), detail: e.to_string() })?;
        Ok(Self { db: Arc::new(worker), tails: Arc::default() })
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

fn read_session(r: &rusqlite::Row<'_>) -> rusqlite::Result<Session> {
    Ok(Session {
        session_id: r.get(0)?,
        agent_id: r.get(1)?,
        session_key: r.get(2)?,
        state: r.get(3)?,
        created_at_ms: r.get(4)?,
    })
}

const SESSION_COLS: &str = "session_id, agent_id, session_key, state, created_at_ms";

fn active(c: &Connection, agent: &str, key: &str) -> rusqlite::Result<Option<Session>> {
    c.prepare_cached(&format!(
        "SELECT {SESSION_COLS} FROM sessions WHERE agent_id = ?1 AND session_key = ?2 AND state = 'active'"
    ))?
    .query_row(params![agent, key], read_session)
    .optional()
}

fn create(c: &Connection, agent: &str, key: &str) -> rusqlite::Result<Session> {
    let s = Session {
        session_id: new_id(),
        agent_id: agent.into(),
        session_key: key.into(),
        state: "active".into(),
        created_at_ms: now_ms(),
    };
    c.prepare_cached("INSERT INTO sessions (session_id, agent_id, session_key, state, created_at_ms) VALUES (?1, ?2, ?3, 'active', ?4)")?.execute(params![s.session_id, s.agent_id, s.session_key, s.created_at_ms])?;
    Ok(s)
}

fn read_subagent(r: &rusqlite::Row<'_>) -> rusqlite::Result<Subagent> {
    Ok(Subagent {
        agent_id: r.get(0)?,
        child_key: r.get(1)?,
        parent_key: r.get(2)?,
        rollback_token: r.get(3)?,
        expires_at_ms: r.get(4)?,
    })
}

/// Appends entries to the session's active branch inside `tx`.
fn append_in(
    tx: &Connection,
    session_id: &str,
    entries: Vec<NewEntry>,
) -> Result<Vec<pb::TranscriptEntry>, StoreError> {
    let (mut parent, mut seq): (Option<String>, i64) = tx
        .query_row("SELECT leaf_id, next_seq FROM sessions WHERE session_id = ?1", [session_id], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
        .optional()?
        .ok_or_else(|| StoreError::NoSession(session_id.to_owned()))?;
    let mut out = Vec::with_capacity(entries.len());
    for e in entries {
        let id = new_id();
        let (kind, entry) = match e.entry {
            Entry::Message(mut m) => {
                // A stored message's id is its entry id: engines key
                // idempotency and rewrites by it.
                m.id = id.clone();
                (KIND_MESSAGE, Entry::Message(m))
            }
            c @ Entry::Compaction(_) => (KIND_COMPACTION, c),
        };
        let stored = pb::TranscriptEntry {
            id: id.clone(),
            parent_id: parent.clone(),
            seq: seq as u64,
            turn_id: e.turn_id,
            entry: Some(entry),
        };
        tx.prepare_cached(
            "INSERT INTO entries (id, session_id, parent_id, seq, kind, body) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        )?
        .execute(params![id, session_id, parent, seq, kind, stored.encode_to_vec()])?;
        parent = Some(id);
        seq += 1;
        out.push(stored);
    }
    tx.prepare_cached("UPDATE sessions SET leaf_id = ?2, next_seq = ?3 WHERE session_id = ?1")?
        .execute(params![session_id, parent, seq])?;
    Ok(out)
}

fn decode(body: &[u8]) -> rusqlite::Result<pb::TranscriptEntry> {
    pb::TranscriptEntry::decode(body)
        .map_err(|e| rusqlite::Error::FromSqlConversionFailure(0, rusqlite::types::Type::Blob, Box::new(e)))
}

/// The active branch from its leaf back to (and including) `stop`, newest
/// first; `None` when `stop` is not on it.
fn branch_back_to(
    tx: &Connection,
    session_id: &str,
    stop: &str,
) -> Result<Option<Vec<pb::TranscriptEntry>>, StoreError> {
    let leaf: Option<String> = tx
        .prepare_cached("SELECT leaf_id FROM sessions WHERE session_id = ?1")?
        .query_row([session_id], |r| r.get(0))?;
    let mut stmt = tx.prepare_cached("SELECT body FROM entries WHERE id = ?1")?;
    let mut out = Vec::new();
    let mut next = leaf;
    while let Some(id) = next {
        let e = stmt.query_row([&id], |r| decode(&r.get::<_, Vec<u8>>(0)?))?;
        next = e.parent_id.clone();
        let done = e.id == stop;
        out.push(e);
        if done {
            return Ok(Some(out));
        }
    }
    Ok(None)
}

/// Queues a closed durable turn's commit: the messages from the first
/// admitted entry to the leaf, and the leaf as the terminal anchor.
fn queue_commit_in(tx: &Connection, session_id: &str, draft: CommitDraft) -> Result<(), StoreError> {
    let first: String = tx
        .prepare_cached("SELECT first_entry_id FROM open_turns WHERE session_id = ?1")?
        .query_row([session_id], |r| r.get(0))?;
    let range = branch_back_to(tx, session_id, &first)?
        .ok_or_else(|| StoreError::Backend(format!("the open turn's first entry {first} is not on the branch")))?;
    let engine = draft.engine_id.clone();
    let req = commit_request(draft, range);
    tx.prepare_cached("INSERT INTO outbox (session_id, advancement_key, engine_id, payload, created_at_ms) VALUES (?1, ?2, ?3, ?4, ?5)")?.execute(params![session_id, req.advancement_key, engine, req.encode_to_vec(), now_ms()])?;
    Ok(())
}

/// A closed turn's CommitTurn: `range` is the branch from its leaf back to
/// the turn's first admitted entry (newest first, as walked).
fn commit_request(draft: CommitDraft, mut range: Vec<pb::TranscriptEntry>) -> pb::CommitTurnRequest {
    range.reverse();
    let mut req = draft.request;
    req.messages = range
        .iter()
        .filter_map(|e| match &e.entry {
            Some(Entry::Message(m)) => Some(m.clone()),
            _ => None,
        })
        .collect();
    // The terminal anchor is the turn's last message (a compaction entry
    // may follow it on the branch).
    if let Some(last) = range.iter().rev().find(|e| matches!(e.entry, Some(Entry::Message(_)))) {
        let mut terminal = req.admission.as_ref().and_then(|a| a.anchor.clone()).unwrap_or_default();
        terminal.entry_id = last.id.clone();
        terminal.raw_seq = last.seq;
        terminal.effective_parent_id = last.parent_id.clone();
        terminal.active_message_position += req.messages.len().saturating_sub(1) as u64;
        req.terminal = Some(terminal);
    }
    req
}

/// Rewinds the session's open turn (if any): the leaf goes back to the
/// turn's anchor (its last admitted entry). Compaction entries made during
/// the turn are copied onto the anchor unless they keep from a message the
/// rewind drops; everything stays in the tree.
fn rewind_in(tx: &Connection, session_id: &str) -> Result<(), StoreError> {
    let anchor: Option<String> = tx
        .query_row("SELECT anchor_id FROM open_turns WHERE session_id = ?1", [session_id], |r| r.get(0))
        .optional()?;
    tx.prepare_cached("DELETE FROM open_turns WHERE session_id = ?1")?.execute([session_id])?;
    let Some(anchor) = anchor else { return Ok(()) };
    let Some(tail) = branch_back_to(tx, session_id, &anchor)? else {
        // Rewrites follow the anchor; a branch without it was changed by hand.
        tracing::warn!(session = session_id, anchor, "an open turn's anchor is not on the branch; not rewound");
        return Ok(());
    };
    let Some(carried) = rewind_carries(tail) else { return Ok(()) };
    tx.prepare_cached("UPDATE sessions SET leaf_id = ?2 WHERE session_id = ?1")?
        .execute(params![session_id, anchor])?;
    append_in(tx, session_id, carried)?;
    Ok(())
}

/// What a rewind puts back on the anchor: `tail` is the branch from the
/// leaf back to the anchor (newest first). `None` when the turn added no
/// message (nothing to rewind); else the compactions made during the turn
/// that keep from no dropped message, oldest first.
fn rewind_carries(mut tail: Vec<pb::TranscriptEntry>) -> Option<Vec<NewEntry>> {
    tail.pop();
    tail.reverse();
    let dropped: std::collections::HashSet<&str> =
        tail.iter().filter(|e| matches!(e.entry, Some(Entry::Message(_)))).map(|e| e.id.as_str()).collect();
    if dropped.is_empty() {
        return None;
    }
    let carried = tail
        .iter()
        .filter_map(|e| match &e.entry {
            Some(Entry::Compaction(cmp)) if !dropped.contains(cmp.first_kept_entry_id.as_str()) => {
                Some(NewEntry { turn_id: e.turn_id.clone(), entry: Entry::Compaction(cmp.clone()) })
            }
            _ => None,
        })
        .collect();
    Some(carried)
}

/// Turns left open by a gateway that died end as aborted ones do.
fn recover_open_turns(conn: &mut Connection) -> Result<(), StoreError> {
    let tx = conn.transaction()?;
    let open: Vec<String> = {
        let mut stmt = tx.prepare("SELECT session_id FROM open_turns")?;
        stmt.query_map([], |r| r.get(0))?.collect::<rusqlite::Result<_>>()?
    };
    for session_id in &open {
        rewind_in(&tx, session_id)?;
    }
    tx.commit()?;
    if !open.is_empty() {
        tracing::info!(turns = open.len(), "turns left open by the last run were rewound");
    }
    Ok(())
}

/// `?N, ?N+1, …` for `n` values starting at `?first` (`NULL` for none, which
/// matches nothing in `IN (…)`).
fn placeholders(n: usize, first: usize) -> String {
    if n == 0 {
        return "NULL".into();
    }
    (first..first + n).map(|i| format!("?{i}")).collect::<Vec<_>>().join(", ")
}

/// Queued commits with their sessions matching `filter` (over `o`, the
/// outbox, and `s`, the session), oldest first.
fn query_outbox(
    c: &Connection,
    filter: &str,
    args: impl rusqlite::Params,
    limit: u32,
) -> Result<Vec<OutboxRow>, StoreError> {
    let mut stmt = c.prepare(&format!(
        "SELECT s.agent_id, s.session_key, o.session_id, o.advancement_key, o.engine_id, o.attempts, o.last_error,
                o.next_attempt_ms, o.created_at_ms
         FROM outbox o JOIN sessions s USING (session_id) WHERE {filter} ORDER BY o.rowid LIMIT {limit}"
    ))?;
    let rows = stmt.query_map(args, |r| {
        Ok(OutboxRow {
            agent_id: r.get(0)?,
            session_key: r.get(1)?,
            session_id: r.get(2)?,
            advancement_key: r.get(3)?,
            engine_id: r.get(4)?,
            attempts: r.get(5)?,
            last_error: r.get(6)?,
            next_attempt_ms: r.get(7)?,
            created_at_ms: r.get(8)?,
        })
    })?;
    Ok(rows.collect::<rusqlite::Result<_>>()?)
}

/// A rewrite worked out from the branch it applies to: the copies to
/// append (ids, parents and seqs assigned) and what it did.
struct RewritePlan {
    entries: Vec<pb::TranscriptEntry>,
    outcome: RewriteOutcome,
}

impl RewritePlan {
    /// The new leaf and the session's next seq after the copies.
    fn leaf_and_next_seq(&self, seq: i64) -> (Option<String>, i64) {
        (self.entries.last().map(|e| e.id.clone()), seq + self.entries.len() as i64)
    }
}

fn kind_of(e: &pb::TranscriptEntry) -> i64 {
    if matches!(e.entry, Some(Entry::Compaction(_))) { KIND_COMPACTION } else { KIND_MESSAGE }
}

/// Plans a rewrite of `branch` (read before the write transaction; `leaf`
/// and `seq` are the session's as the transaction sees them). `Err` is
/// the outcome when nothing changes, with its reason.
fn plan_rewrite(
    branch: &[pb::TranscriptEntry],
    replacements: Vec<(String, AgentMessage)>,
    leaf: Option<&str>,
    mut seq: i64,
) -> Result<RewritePlan, RewriteOutcome> {
    let kept = |reason: &str| RewriteOutcome { reason: reason.into(), ..Default::default() };
    let wanted: std::collections::HashMap<String, AgentMessage> =
        replacements.into_iter().filter(|(id, _)| !id.trim().is_empty()).collect();
    if wanted.is_empty() {
        return Err(kept("no replacements requested"));
    }
    if branch.is_empty() {
        return Err(kept("empty session"));
    }
    // Matches by message id, only where the content really changes.
    let matched = |e: &pb::TranscriptEntry| match &e.entry {
        Some(Entry::Message(m)) => wanted.get(&m.id).filter(|new| new.content != m.content),
        _ => None,
    };
    let Some(first) = branch.iter().position(|e| matched(e).is_some()) else {
        return Err(kept("no changed matching message entries"));
    };
    // The leaf moved since the branch was read: someone appended; let them win.
    if leaf != branch.last().map(|e| e.id.as_str()) {
        return Err(kept("the branch changed while rewriting"));
    }
    let mut parent = branch[first].parent_id.clone();
    let mut remap = std::collections::HashMap::new();
    let (mut freed, mut rewritten) = (0i64, 0u32);
    let mut entries = Vec::new();
    for old in &branch[first..] {
        let id = new_id();
        remap.insert(old.id.clone(), id.clone());
        let entry = match (&old.entry, matched(old)) {
            (Some(Entry::Message(m)), Some(new)) => {
                freed += ctxgate_proto::validate::content_bytes(m) as i64
                    - ctxgate_proto::validate::content_bytes(new) as i64;
                rewritten += 1;
                // Engines know messages by id: the replacement keeps it.
                Entry::Message(AgentMessage { id: m.id.clone(), ..new.clone() })
            }
            (Some(Entry::Compaction(cmp)), _) => {
                let mut cmp = cmp.clone();
                if let Some(n) = remap.get(&cmp.first_kept_entry_id) {
                    cmp.first_kept_entry_id = n.clone();
                }
                Entry::Compaction(cmp)
            }
            (Some(other), None) => other.clone(),
            (None, _) => continue,
        };
        entries.push(pb::TranscriptEntry {
            id: id.clone(),
            parent_id: parent.clone(),
            seq: seq as u64,
            turn_id: old.turn_id.clone(),
            entry: Some(entry),
        });
        parent = Some(id);
        seq += 1;
    }
    let outcome = RewriteOutcome {
        changed: true,
        bytes_freed: freed,
        rewritten_entries: rewritten,
        reason: String::new(),
        remap,
    };
    Ok(RewritePlan { entries, outcome })
}

#[async_trait]
impl Store for SqliteStore {
    async fn session(&self, agent: &str, key: &str, create_missing: bool) -> Result<Option<Session>, StoreError> {
        let (agent, key) = (agent.to_owned(), key.to_owned());
        // Every turn starts here: a read, and a write only to create.
        let (a, k) = (agent.clone(), key.clone());
        if let Some(s) = self.db.read(move |c| Ok(active(c, &a, &k)?)).await? {
            return Ok(Some(s));
        }
        if !create_missing {
            return Ok(None);
        }
        self.db
            .write(move |tx| match active(tx, &agent, &key)? {
                Some(s) => Ok(Some(s)),
                None => Ok(Some(create(tx, &agent, &key)?)),
            })
            .await
    }

    async fn replace_session(&self, agent: &str, key: &str, archive: bool) -> Result<Session, StoreError> {
        let (agent, key) = (agent.to_owned(), key.to_owned());
        self.db
            .write(move |tx| {
                let state = if archive { "archived" } else { "inactive" };
                tx.prepare_cached(
                    "UPDATE sessions SET state = ?3 WHERE agent_id = ?1 AND session_key = ?2 AND state = 'active'",
                )?
                .execute(params![agent, key, state])?;
                let s = create(tx, &agent, &key)?;
                Ok(s)
            })
            .await
    }

    async fn list_sessions(
        &self,
        agent: Option<&str>,
        include_archived: bool,
        offset: u64,
        limit: u32,
    ) -> Result<Vec<SessionStats>, StoreError> {
        let agent = agent.map(str::to_owned);
        self.db
            .read(move |c| {
                let mut stmt = c.prepare(&format!(
                    "SELECT {SESSION_COLS},
                   (SELECT COUNT(*) FROM entries e WHERE e.session_id = s.session_id),
                   (SELECT COUNT(*) FROM entries e WHERE e.session_id = s.session_id AND e.kind = {KIND_COMPACTION})
                 FROM sessions s
                 WHERE (?1 IS NULL OR agent_id = ?1) AND (?2 OR state != 'archived')
                 ORDER BY agent_id, session_key, created_at_ms, s.rowid LIMIT ?3 OFFSET ?4"
                ))?;
                let rows = stmt.query_map(params![agent, include_archived, limit, offset as i64], |r| {
                    Ok(SessionStats { session: read_session(r)?, entries: r.get(5)?, compactions: r.get(6)? })
                })?;
                Ok(rows.collect::<rusqlite::Result<_>>()?)
            })
            .await
    }

    async fn archive_session(&self, agent: &str, key: &str) -> Result<bool, StoreError> {
        let (agent, key) = (agent.to_owned(), key.to_owned());
        self.db.write(move |c| {
            let n = c.prepare_cached("UPDATE sessions SET state = 'archived' WHERE agent_id = ?1 AND session_key = ?2 AND state = 'active'")?.execute(params![agent, key])?;
            Ok(n > 0)
        })
        .await
    }

    async fn delete_sessions(&self, agent: &str, key: &str) -> Result<u32, StoreError> {
        let (agent, key) = (agent.to_owned(), key.to_owned());
        let (n, ids) = self
            .db
            .write(move |tx| {
                const OF_KEY: &str = "SELECT session_id FROM sessions WHERE agent_id = ?1 AND session_key = ?2";
                let ids: Vec<String> = tx
                    .prepare_cached(OF_KEY)?
                    .query_map(params![agent, key], |r| r.get(0))?
                    .collect::<Result<_, _>>()?;
                // Every engine that saw a session, by a call or a queued commit,
                // is owed a ForgetSession; the queue survives a crash.
                tx.prepare_cached(&format!(
                    "INSERT OR IGNORE INTO forgets (session_id, engine_id, agent_id, session_key)
                     SELECT session_id, engine_id, ?1, ?2 FROM engine_sessions WHERE session_id IN ({OF_KEY})
                     UNION SELECT session_id, engine_id, ?1, ?2 FROM outbox WHERE session_id IN ({OF_KEY})"
                ))?
                .execute(params![agent, key])?;
                for table in ["outbox", "engine_sessions", "cursors", "entries"] {
                    tx.prepare_cached(&format!("DELETE FROM {table} WHERE session_id IN ({OF_KEY})"))?
                        .execute(params![agent, key])?;
                }
                // The key's own subagent record (it was a child); a parent's
                // children stay sessions of their own.
                tx.prepare_cached("DELETE FROM subagents WHERE agent_id = ?1 AND child_key = ?2")?
                    .execute(params![agent, key])?;
                let n = tx
                    .prepare_cached("DELETE FROM sessions WHERE agent_id = ?1 AND session_key = ?2")?
                    .execute(params![agent, key])?;
                Ok((n as u32, ids))
            })
            .await?;
        // What a deleted session said leaves memory with it.
        if let Ok(mut t) = self.tails.lock() {
            t.forget(&ids);
        }
        Ok(n)
    }

    async fn session_ids(&self, agent: &str, key: &str) -> Result<Vec<String>, StoreError> {
        let (agent, key) = (agent.to_owned(), key.to_owned());
        self.db
            .read(move |c| {
                // Ordered: callers lock them in this order.
                let mut stmt = c.prepare(
                    "SELECT session_id FROM sessions WHERE agent_id = ?1 AND session_key = ?2 ORDER BY session_id",
                )?;
                let rows = stmt.query_map(params![agent, key], |r| r.get(0))?;
                Ok(rows.collect::<rusqlite::Result<_>>()?)
            })
            .await
    }

    async fn append(&self, session_id: &str, entries: Vec<NewEntry>) -> Result<Vec<pb::TranscriptEntry>, StoreError> {
        let session_id = session_id.to_owned();
        self.db
            .write(move |tx| {
                let out = append_in(tx, &session_id, entries)?;
                Ok(out)
            })
            .await
    }

    async fn open_turn(
        &self,
        session_id: &str,
        turn_id: &str,
        entries: Vec<NewEntry>,
        seen_by: Option<&str>,
    ) -> Result<Vec<pb::TranscriptEntry>, StoreError> {
        let (session_id, turn_id) = (session_id.to_owned(), turn_id.to_owned());
        let seen_by = seen_by.map(str::to_owned);
        self.db
            .write(move |tx| {
                // A turn left open (its rewind failed) ends as an abort first.
                rewind_in(tx, &session_id)?;
                let out = append_in(tx, &session_id, entries)?;
                let (Some(first), Some(last)) = (out.first(), out.last()) else {
                    return Err(StoreError::Backend("a turn is admitted with at least one entry".into()));
                };
                tx.prepare_cached(
                    "INSERT INTO open_turns (session_id, turn_id, first_entry_id, anchor_id) VALUES (?1, ?2, ?3, ?4)",
                )?
                .execute(params![session_id, turn_id, first.id, last.id])?;
                if let Some(engine) = seen_by {
                    tx.prepare_cached("INSERT OR IGNORE INTO engine_sessions (session_id, engine_id) VALUES (?1, ?2)")?
                        .execute(params![session_id, engine])?;
                }
                Ok(out)
            })
            .await
    }

    async fn close_turn(&self, session_id: &str, close: TurnClose) -> Result<Vec<pb::TranscriptEntry>, StoreError> {
        let session_id = session_id.to_owned();
        self.db
            .write(move |tx| {
                let out = match close {
                    TurnClose::Rewind => {
                        rewind_in(tx, &session_id)?;
                        Vec::new()
                    }
                    TurnClose::Accept { entries, commit } => {
                        let out = append_in(tx, &session_id, entries)?;
                        if let Some(draft) = commit {
                            queue_commit_in(tx, &session_id, draft)?;
                        }
                        tx.prepare_cached("DELETE FROM open_turns WHERE session_id = ?1")?.execute([&session_id])?;
                        out
                    }
                };
                Ok(out)
            })
            .await
    }

    async fn record_projection(
        &self,
        session_id: &str,
        host_id: &str,
        epoch: &str,
        fingerprint: &str,
    ) -> Result<bool, StoreError> {
        let (session_id, host_id, epoch, fingerprint) =
            (session_id.to_owned(), host_id.to_owned(), epoch.to_owned(), fingerprint.to_owned());
        self.db.write(move |tx| {
            let before: Option<(String, String)> = tx
                .query_row(
                    "SELECT epoch, fingerprint FROM projections WHERE session_id = ?1 AND host_id = ?2",
                    params![session_id, host_id],
                    |r| Ok((r.get(0)?, r.get(1)?)),
                )
                .optional()?;
            let changed = before.as_ref() != Some(&(epoch.clone(), fingerprint.clone()));
            if changed {
                tx.prepare_cached("INSERT OR REPLACE INTO projections (session_id, host_id, epoch, fingerprint) VALUES (?1, ?2, ?3, ?4)")?.execute(params![session_id, host_id, epoch, fingerprint])?;
            }
            Ok(changed)
        })
        .await
    }

    async fn pending_commits(&self, session_id: &str, engine_id: &str) -> Result<Vec<PendingCommit>, StoreError> {
        let (session_id, engine_id) = (session_id.to_owned(), engine_id.to_owned());
        self.db
            .read(move |c| {
                let mut stmt = c.prepare_cached(
                    "SELECT engine_id, payload, attempts, last_error, next_attempt_ms FROM outbox
                 WHERE session_id = ?1 AND engine_id = ?2 ORDER BY rowid",
                )?;
                let rows = stmt.query_map([&session_id, &engine_id], |r| {
                    let body: Vec<u8> = r.get(1)?;
                    let request = pb::CommitTurnRequest::decode(body.as_slice()).map_err(|e| {
                        rusqlite::Error::FromSqlConversionFailure(1, rusqlite::types::Type::Blob, Box::new(e))
                    })?;
                    Ok(PendingCommit {
                        engine_id: r.get(0)?,
                        request,
                        attempts: r.get(2)?,
                        last_error: r.get(3)?,
                        next_attempt_ms: r.get(4)?,
                    })
                })?;
                Ok(rows.collect::<rusqlite::Result<_>>()?)
            })
            .await
    }

    async fn due_commits(&self, now_ms: i64, engines: &[String]) -> Result<Vec<(String, String)>, StoreError> {
        let engines = engines.to_vec();
        self.db
            .read(move |c| {
                // A pair is due when its oldest row is: later rows wait behind it.
                let mut stmt = c.prepare_cached(&format!(
                    "SELECT session_id, engine_id FROM outbox o WHERE rowid =
                   (SELECT MIN(rowid) FROM outbox f WHERE f.session_id = o.session_id AND f.engine_id = o.engine_id)
                 AND next_attempt_ms <= ?1 AND engine_id IN ({}) ORDER BY rowid LIMIT 1024",
                    placeholders(engines.len(), 2)
                ))?;
                let args =
                    std::iter::once(rusqlite::types::Value::from(now_ms)).chain(engines.into_iter().map(Into::into));
                let rows = stmt.query_map(rusqlite::params_from_iter(args), |r| Ok((r.get(0)?, r.get(1)?)))?;
                Ok(rows.collect::<rusqlite::Result<_>>()?)
            })
            .await
    }

    async fn complete_commit(
        &self,
        session_id: &str,
        advancement_key: &str,
        advance: Option<Advance>,
    ) -> Result<(), StoreError> {
        let (s, k) = (session_id.to_owned(), advancement_key.to_owned());
        self.db.write(move |tx| {
            tx.prepare_cached("DELETE FROM outbox WHERE session_id = ?1 AND advancement_key = ?2")?.execute(params![s, k])?;
            if let Some(a) = advance {
                // Only forwards: a redelivered (DUPLICATE) commit moves nothing.
                tx.prepare_cached(
                    "UPDATE cursors SET message_id = ?3, seq = ?4, message_count = message_count + ?5, tokens = tokens + ?6
                     WHERE session_id = ?1 AND engine_id = ?2 AND seq < ?4",
                )?
                .execute(params![s, a.engine_id, a.last_message_id, a.seq as i64, a.messages as i64, a.tokens as i64])?;
            }
            Ok(())
        })
        .await
    }

    async fn durable_engines(&self) -> Result<Vec<String>, StoreError> {
        self.db
            .read(|c| {
                let mut stmt = c.prepare("SELECT engine_id FROM durable_engines")?;
                let rows = stmt.query_map([], |r| r.get(0))?;
                Ok(rows.collect::<rusqlite::Result<_>>()?)
            })
            .await
    }

    async fn set_durable(&self, engine_id: &str, durable: bool) -> Result<(), StoreError> {
        let e = engine_id.to_owned();
        self.db
            .write(move |c| {
                if durable {
                    c.prepare_cached("INSERT OR IGNORE INTO durable_engines (engine_id) VALUES (?1)")?.execute([e])?;
                } else {
                    c.prepare_cached("DELETE FROM durable_engines WHERE engine_id = ?1")?.execute([e])?;
                }
                Ok(())
            })
            .await
    }

    async fn cursor(&self, session_id: &str, engine_id: &str) -> Result<Option<pb::HistoryCursor>, StoreError> {
        let (s, e) = (session_id.to_owned(), engine_id.to_owned());
        self.db
            .read(move |c| {
                Ok(c.prepare_cached(
                "SELECT message_id, seq, message_count, tokens FROM cursors WHERE session_id = ?1 AND engine_id = ?2",
            )?
            .query_row(params![s, e], |r| {
                Ok(pb::HistoryCursor {
                    message_id: r.get(0)?,
                    seq: r.get::<_, i64>(1)? as u64,
                    message_count: r.get::<_, i64>(2)? as u64,
                    tokens: r.get::<_, i64>(3)? as u64,
                })
            })
            .optional()?)
            })
            .await
    }

    async fn set_cursor(
        &self,
        session_id: &str,
        engine_id: &str,
        cursor: Option<pb::HistoryCursor>,
    ) -> Result<(), StoreError> {
        let (s, e) = (session_id.to_owned(), engine_id.to_owned());
        self.db.write(move |c| {
            match cursor {
                None => c.prepare_cached("DELETE FROM cursors WHERE session_id = ?1 AND engine_id = ?2")?.execute(params![s, e])?,
                Some(k) => c.prepare_cached("INSERT OR REPLACE INTO cursors (session_id, engine_id, message_id, seq, message_count, tokens)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6)")?.execute(params![s, e, k.message_id, k.seq as i64, k.message_count as i64, k.tokens as i64])?,
            };
            Ok(())
        })
        .await
    }

    async fn branch_after(
        &self,
        session_id: &str,
        cursor: &pb::HistoryCursor,
    ) -> Result<Option<Vec<pb::TranscriptEntry>>, StoreError> {
        let (session_id, cursor) = (session_id.to_owned(), cursor.clone());
        self.db
            .read(move |c| {
                let leaf: Option<Option<String>> = c
                    .query_row("SELECT leaf_id FROM sessions WHERE session_id = ?1", [&session_id], |r| r.get(0))
                    .optional()?;
                let mut next = leaf.ok_or_else(|| StoreError::NoSession(session_id.clone()))?;
                let mut stmt = c.prepare_cached("SELECT body FROM entries WHERE id = ?1")?;
                let mut out = Vec::new();
                // Seqs fall walking towards the root (a rewrite's copies get
                // higher ones than the entry they branch from).
                let mut found = cursor.message_id.is_empty();
                while let Some(id) = next.take() {
                    let e = stmt.query_row([&id], |r| decode(&r.get::<_, Vec<u8>>(0)?))?;
                    // A message by its id (stable across rewrites, whose copies
                    // get new seqs), or a summary by its entry id.
                    if !found
                        && (e.id == cursor.message_id
                            || matches!(&e.entry, Some(Entry::Message(m)) if m.id == cursor.message_id))
                    {
                        found = true;
                        break;
                    }
                    if e.seq <= cursor.seq {
                        break;
                    }
                    next = e.parent_id.clone();
                    out.push(e);
                }
                // Not met on the way back (an empty cursor holds nothing: the
                // whole branch follows it).
                if !found {
                    return Ok(None);
                }
                out.reverse();
                Ok(Some(out))
            })
            .await
    }

    async fn refuse_commit(
        &self,
        session_id: &str,
        advancement_key: &str,
        error: &str,
        next_attempt_ms: i64,
    ) -> Result<(), StoreError> {
        let (s, k, e) = (session_id.to_owned(), advancement_key.to_owned(), error.to_owned());
        self.db
            .write(move |c| {
                c.prepare_cached(
                    "UPDATE outbox SET attempts = attempts + 1, last_error = ?3, next_attempt_ms = ?4
                 WHERE session_id = ?1 AND advancement_key = ?2",
                )?
                .execute(params![s, k, e, next_attempt_ms])?;
                Ok(())
            })
            .await
    }

    async fn list_outbox(&self, agent: Option<&str>, limit: u32) -> Result<(Vec<OutboxRow>, u32), StoreError> {
        let agent = agent.map(str::to_owned);
        self.db.read(move |c| {
            let rows = query_outbox(c, "?1 IS NULL OR s.agent_id = ?1", params![agent], limit)?;
            let total: u32 = c.prepare_cached("SELECT COUNT(*) FROM outbox o JOIN sessions s USING (session_id) WHERE ?1 IS NULL OR s.agent_id = ?1")?.query_row(params![agent],
                |r| r.get(0))?;
            let more = total.saturating_sub(rows.len() as u32);
            Ok((rows, more))
        })
        .await
    }

    async fn outbox_of_key(&self, agent: &str, key: &str) -> Result<Vec<OutboxRow>, StoreError> {
        let (agent, key) = (agent.to_owned(), key.to_owned());
        self.db
            .read(move |c| query_outbox(c, "s.agent_id = ?1 AND s.session_key = ?2", params![agent, key], u32::MAX))
            .await
    }

    async fn retry_outbox(&self, agent: &str, key: &str) -> Result<u32, StoreError> {
        let (agent, key) = (agent.to_owned(), key.to_owned());
        self.db
            .write(move |c| {
                let n = c
                    .prepare_cached(
                        "UPDATE outbox SET next_attempt_ms = 0 WHERE session_id IN
                   (SELECT session_id FROM sessions WHERE agent_id = ?1 AND session_key = ?2)",
                    )?
                    .execute(params![agent, key])?;
                Ok(n as u32)
            })
            .await
    }

    async fn drop_outbox(&self, agent: &str, key: &str) -> Result<Vec<OutboxRow>, StoreError> {
        let (agent, key) = (agent.to_owned(), key.to_owned());
        self.db.write(move |tx| {
            let rows = query_outbox(tx, "s.agent_id = ?1 AND s.session_key = ?2", params![agent, key], u32::MAX)?;
            let at = now_ms();
            for r in &rows {
                tx.prepare_cached("INSERT INTO outbox_drops (session_id, agent_id, session_key, advancement_key, engine_id, attempts, last_error, dropped_at_ms)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)")?.execute(params![r.session_id, r.agent_id, r.session_key, r.advancement_key, r.engine_id, r.attempts, r.last_error, at])?;
                tx.prepare_cached("DELETE FROM outbox WHERE session_id = ?1 AND advancement_key = ?2")?.execute(params![r.session_id, r.advancement_key])?;
            }
            Ok(rows)
        })
        .await
    }

    async fn outbox_counts(&self) -> Result<(u32, u32), StoreError> {
        self.db
            .read(|c| {
                Ok(c.prepare_cached("SELECT COUNT(*), COUNT(*) FILTER (WHERE attempts > 0) FROM outbox")?
                    .query_row([], |r| Ok((r.get(0)?, r.get(1)?)))?)
            })
            .await
    }

    async fn note_engine_session(&self, session_id: &str, engine_id: &str) -> Result<(), StoreError> {
        let (s, e) = (session_id.to_owned(), engine_id.to_owned());
        self.db
            .write(move |c| {
                c.prepare_cached("INSERT OR IGNORE INTO engine_sessions (session_id, engine_id) VALUES (?1, ?2)")?
                    .execute(params![s, e])?;
                Ok(())
            })
            .await
    }

    async fn pending_forgets(&self, now_ms: i64, engines: &[String]) -> Result<Vec<Forget>, StoreError> {
        let engines = engines.to_vec();
        self.db
            .read(move |c| {
                let mut stmt = c.prepare_cached(&format!(
                    "SELECT session_id, engine_id, agent_id, session_key, attempts FROM forgets
                 WHERE next_attempt_ms <= ?1 AND engine_id IN ({}) ORDER BY rowid LIMIT 256",
                    placeholders(engines.len(), 2)
                ))?;
                let args =
                    std::iter::once(rusqlite::types::Value::from(now_ms)).chain(engines.into_iter().map(Into::into));
                let rows = stmt.query_map(rusqlite::params_from_iter(args), |r| {
                    Ok(Forget {
                        session_id: r.get(0)?,
                        engine_id: r.get(1)?,
                        agent_id: r.get(2)?,
                        session_key: r.get(3)?,
                        attempts: r.get(4)?,
                    })
                })?;
                Ok(rows.collect::<rusqlite::Result<_>>()?)
            })
            .await
    }

    async fn settle_forget(
        &self,
        session_id: &str,
        engine_id: &str,
        retry_at: Option<(i64, &str)>,
    ) -> Result<(), StoreError> {
        let (s, e) = (session_id.to_owned(), engine_id.to_owned());
        let retry = retry_at.map(|(at, why)| (at, why.to_owned()));
        self.db
            .write(move |c| {
                match retry {
                    None => c
                        .prepare_cached("DELETE FROM forgets WHERE session_id = ?1 AND engine_id = ?2")?
                        .execute(params![s, e])?,
                    Some((at, why)) => c
                        .prepare_cached(
                            "UPDATE forgets SET attempts = attempts + 1, last_error = ?3, next_attempt_ms = ?4
                     WHERE session_id = ?1 AND engine_id = ?2",
                        )?
                        .execute(params![s, e, why, at])?,
                };
                Ok(())
            })
            .await
    }

    async fn branch(&self, session_id: &str) -> Result<Vec<pb::TranscriptEntry>, StoreError> {
        let session_id = session_id.to_owned();
        self.db
            .read(move |c| {
                let leaf: Option<Option<String>> = c
                    .query_row("SELECT leaf_id FROM sessions WHERE session_id = ?1", [&session_id], |r| r.get(0))
                    .optional()?;
                let Some(leaf) = leaf else { return Err(StoreError::NoSession(session_id)) };
                let Some(leaf) = leaf else { return Ok(Vec::new()) };
                let mut stmt = c.prepare_cached(
                    "WITH RECURSIVE chain(id, parent_id, body, depth) AS (
                   SELECT id, parent_id, body, 0 FROM entries WHERE id = ?1
                   UNION ALL
                   SELECT e.id, e.parent_id, e.body, chain.depth + 1 FROM entries e JOIN chain ON e.id = chain.parent_id
                 ) SELECT body FROM chain ORDER BY depth DESC",
                )?;
                let rows = stmt.query_map([leaf], |r| decode(&r.get::<_, Vec<u8>>(0)?))?;
                Ok(rows.collect::<rusqlite::Result<_>>()?)
            })
            .await
    }

    async fn visible_tail(&self, session_id: &str) -> Result<Vec<pb::TranscriptEntry>, StoreError> {
        let session_id = session_id.to_owned();
        let tails = self.tails.clone();
        let cached = tails.lock().map(|mut t| t.take(&session_id)).unwrap_or(None);
        self.db
            .read(move |c| {
                let leaf: Option<Option<String>> = c
                    .prepare_cached("SELECT leaf_id FROM sessions WHERE session_id = ?1")?
                    .query_row([&session_id], |r| r.get(0))
                    .optional()?;
                let Some(mut next) = leaf.ok_or_else(|| StoreError::NoSession(session_id.clone()))? else {
                    return Ok(Vec::new());
                };
                let mut stmt = c.prepare_cached("SELECT body FROM entries WHERE id = ?1")?;
                let mut out = Vec::new();
                // Walk from the leaf towards the root; stop once the latest
                // compaction's first kept entry is in hand.
                let mut stop_at: Option<String> = None;
                let mut spliced = None;
                loop {
                    // The cached tail's leaf, with no newer summary on the
                    // way: the rest of the walk is that tail.
                    if stop_at.is_none() && cached.as_ref().is_some_and(|t| t.last().is_some_and(|l| l.id == next)) {
                        spliced = cached;
                        break;
                    }
                    let e = stmt.query_row([&next], |r| decode(&r.get::<_, Vec<u8>>(0)?))?;
                    let parent = e.parent_id.clone();
                    let reached = stop_at.as_deref() == Some(e.id.as_str());
                    if stop_at.is_none()
                        && let Some(Entry::Compaction(cmp)) = &e.entry
                    {
                        stop_at = Some(cmp.first_kept_entry_id.clone());
                    }
                    let summary_keeps_nothing = stop_at.as_deref() == Some("");
                    out.push(e);
                    match parent {
                        Some(p) if !reached && !summary_keeps_nothing => next = p,
                        _ => break,
                    }
                }
                out.reverse();
                let tail = match spliced {
                    // Ours alone (taken from the cache): extended in place.
                    Some(older) => {
                        let mut all = Arc::try_unwrap(older).unwrap_or_else(|shared| (*shared).clone());
                        all.extend(out);
                        all
                    }
                    None => out,
                };
                let answer = tail.clone();
                if let Ok(mut t) = tails.lock() {
                    t.put(&session_id, tail);
                }
                Ok(answer)
            })
            .await
    }

    async fn rewrite(
        &self,
        session_id: &str,
        replacements: Vec<(String, AgentMessage)>,
    ) -> Result<RewriteOutcome, StoreError> {
        let session_id = session_id.to_owned();
        let this = self.clone();
        let branch = self.branch(&session_id).await?;
        this.db.write(move |tx| {
            let (leaf, seq): (Option<String>, i64) =
                tx.prepare_cached("SELECT leaf_id, next_seq FROM sessions WHERE session_id = ?1")?.query_row([&session_id], |r| {
                    Ok((r.get(0)?, r.get(1)?))
                })?;
            let plan = match plan_rewrite(&branch, replacements, leaf.as_deref(), seq) {
                Ok(plan) => plan,
                Err(kept) => return Ok(kept),
            };
            for e in &plan.entries {
                tx.prepare_cached("INSERT INTO entries (id, session_id, parent_id, seq, kind, body) VALUES (?1, ?2, ?3, ?4, ?5, ?6)")?.execute(params![e.id, session_id, e.parent_id, e.seq as i64, kind_of(e), e.encode_to_vec()])?;
            }
            let (leaf, next) = plan.leaf_and_next_seq(seq);
            tx.prepare_cached("UPDATE sessions SET leaf_id = ?2, next_seq = ?3 WHERE session_id = ?1")?.execute(params![session_id, leaf, next])?;
            // An open turn's admitted entries were copied too: follow them.
            for column in ["first_entry_id", "anchor_id"] {
                let old: Option<String> = tx
                    .query_row(&format!("SELECT {column} FROM open_turns WHERE session_id = ?1"), [&session_id], |r| {
                        r.get(0)
                    })
                    .optional()?;
                if let Some(new) = old.and_then(|o| plan.outcome.remap.get(&o)) {
                    tx.prepare_cached(&format!("UPDATE open_turns SET {column} = ?2 WHERE session_id = ?1"))?.execute(params![session_id, new])?;
                }
            }
            Ok(plan.outcome)
        })
        .await
    }

    async fn add_subagent(&self, a: Subagent) -> Result<(), StoreError> {
        self.db.write(move |c| {
            c.prepare_cached("INSERT OR REPLACE INTO subagents (agent_id, child_key, parent_key, rollback_token, expires_at_ms) VALUES (?1, ?2, ?3, ?4, ?5)")?.execute(params![a.agent_id, a.child_key, a.parent_key, a.rollback_token, a.expires_at_ms])?;
            Ok(())
        })
        .await
    }

    async fn take_subagent(&self, agent: &str, child_key: &str) -> Result<Option<Subagent>, StoreError> {
        let (agent, key) = (agent.to_owned(), child_key.to_owned());
        self.db.write(move |tx| {
            let s = tx
                .query_row(
                    "SELECT agent_id, child_key, parent_key, rollback_token, expires_at_ms FROM subagents WHERE agent_id = ?1 AND child_key = ?2",
                    params![agent, key],
                    read_subagent,
                )
                .optional()?;
            tx.prepare_cached("DELETE FROM subagents WHERE agent_id = ?1 AND child_key = ?2")?.execute(params![agent, key])?;
            Ok(s)
        })
        .await
    }

    async fn expired_subagents(&self, now_ms: i64) -> Result<Vec<Subagent>, StoreError> {
        self.db.read(move |c| {
            let mut stmt = c.prepare(
                "SELECT agent_id, child_key, parent_key, rollback_token, expires_at_ms FROM subagents WHERE expires_at_ms IS NOT NULL AND expires_at_ms <= ?1",
            )?;
            let rows = stmt.query_map([now_ms], read_subagent)?;
            Ok(rows.collect::<rusqlite::Result<_>>()?)
        })
        .await
    }

    async fn count_sessions(&self) -> Result<u32, StoreError> {
        self.db
            .read(|c| {
                Ok(c.prepare_cached("SELECT COUNT(*) FROM sessions WHERE state = 'active'")?
                    .query_row([], |r| r.get(0))?)
            })
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ctxgate_proto::pb::{CompactionEntry, ContentPart, Role, content_part::Part};

    /// A store in a temp dir with one session for key "k".
    async fn fixture() -> (tempfile::TempDir, SqliteStore, Session) {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path()).unwrap();
        let s = store.session("main", "k", true).await.unwrap().unwrap();
        (dir, store, s)
    }

    fn compaction(summary: &str, first_kept: &str) -> NewEntry {
        NewEntry {
            turn_id: "c".into(),
            entry: Entry::Compaction(CompactionEntry {
                summary: summary.into(),
                first_kept_entry_id: first_kept.into(),
                ..Default::default()
            }),
        }
    }

    fn user(text: &str) -> NewEntry {
        let m = AgentMessage {
            role: Role::User as i32,
            content: vec![ContentPart { part: Some(Part::Text(text.into())) }],
            ..Default::default()
        };
        NewEntry { turn_id: "t".into(), entry: Entry::Message(m) }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_writes_share_a_commit_and_a_failing_one_fails_alone() {
        let (_dir, store, _) = fixture().await;
        let mut sessions = Vec::new();
        for i in 0..32 {
            sessions.push(store.session("main", &format!("k{i}"), true).await.unwrap().unwrap());
        }
        // A slow read holds the connection while every write queues.
        let (held_tx, held) = std::sync::mpsc::channel();
        let db = store.db.clone();
        let slow = async move {
            db.read(move |_| {
                held_tx.send(()).unwrap();
                std::thread::sleep(std::time::Duration::from_millis(300));
                Ok(())
            })
            .await
        };
        let slow = tokio::spawn(slow);
        held.recv().unwrap();
        let before = store.commit_counts();
        let mut writes: Vec<_> = sessions
            .iter()
            .map(|s| {
                let (store, id) = (store.clone(), s.session_id.clone());
                tokio::spawn(async move { store.append(&id, vec![user("hi")]).await })
            })
            .collect();
        let doomed = store.clone();
        writes.push(tokio::spawn(async move { doomed.append("no-such-session", vec![user("lost")]).await }));
        slow.await.unwrap().unwrap();
        let mut results = Vec::new();
        for w in writes {
            results.push(w.await.unwrap());
        }
        let doomed = results.pop().unwrap();
        assert!(matches!(doomed, Err(StoreError::NoSession(_))), "{doomed:?}");
        assert!(results.iter().all(Result::is_ok), "{results:?}");
        let after = store.commit_counts();
        assert_eq!(after.1 - before.1, 33, "every write ran in a batch");
        assert!(after.0 - before.0 <= 2, "33 writes queued behind one read took {} commits", after.0 - before.0);
        for s in &sessions {
            assert_eq!(store.branch(&s.session_id).await.unwrap().len(), 1, "each write committed");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_full_database_mid_batch_answers_each_write_as_it_landed() {
        let (_dir, store, _) = fixture().await;
        let mut ids = Vec::new();
        for i in 0..6 {
            ids.push(store.session("main", &format!("f{i}"), true).await.unwrap().unwrap().session_id);
        }
        // Room for a little more than what is there: the big writes fill it.
        let pages: i64 = store.db.read(|c| Ok(c.query_row("PRAGMA page_count", [], |r| r.get(0))?)).await.unwrap();
        store.db.read(move |c| Ok(c.pragma_update(None, "max_page_count", pages + 8)?)).await.unwrap();
        let (held_tx, held) = std::sync::mpsc::channel();
        let db = store.db.clone();
        let slow = tokio::spawn(async move {
            db.read(move |_| {
                held_tx.send(()).unwrap();
                std::thread::sleep(std::time::Duration::from_millis(300));
                Ok(())
            })
            .await
        });
        held.recv().unwrap();
        let writes: Vec<_> = ids
            .iter()
            .enumerate()
            .map(|(i, id)| {
                let (store, id) = (store.clone(), id.clone());
                // Every other write is far over the room left.
                let text = if i % 2 == 1 { "x".repeat(200_000) } else { "small".into() };
                tokio::spawn(async move { store.append(&id, vec![user(&text)]).await })
            })
            .collect();
        slow.await.unwrap().unwrap();
        let mut failed = 0;
        for (w, id) in writes.into_iter().zip(&ids) {
            let answer = w.await.unwrap();
            let stored = store.branch(id).await.unwrap().len();
            match answer {
                Ok(_) => assert_eq!(stored, 1, "answered Ok but not stored"),
                Err(e) => {
                    failed += 1;
                    assert!(matches!(e, StoreError::Full(_) | StoreError::Backend(_)), "{e:?}");
                    assert_eq!(stored, 0, "answered {e} but stored");
                }
            }
        }
        assert!(failed >= 3, "the big writes fail ({failed} failed)");
    }

    #[tokio::test]
    async fn a_turn_left_open_by_a_crash_is_rewound_at_open_and_keeps_its_compactions() {
        let (dir, store, s) = fixture().await;
        store.append(&s.session_id, vec![user("before")]).await.unwrap();
        let admitted = store.open_turn(&s.session_id, "t1", vec![user("question")], None).await.unwrap();
        let tool = NewEntry { turn_id: "t1".into(), entry: user("tool traffic").entry };
        store.append(&s.session_id, vec![tool]).await.unwrap();
        store.append(&s.session_id, vec![compaction("summary", &admitted[0].id)]).await.unwrap();
        drop(store);

        // The gateway died mid-turn: the next open rewinds it.
        let store = SqliteStore::open(dir.path()).unwrap();
        let branch = store.branch(&s.session_id).await.unwrap();
        let shape: Vec<String> = branch
            .iter()
            .map(|e| match &e.entry {
                Some(Entry::Message(m)) => crate::provider::message_text(m),
                Some(Entry::Compaction(c)) => format!("[{}]", c.summary),
                None => String::new(),
            })
            .collect();
        assert_eq!(shape, ["before", "question", "[summary]"], "the turn's message left, its summary stayed");
        // Nothing is lost: the rewound entry is still in the tree.
        let all: i64 =
            store.db.read(|c| Ok(c.query_row("SELECT COUNT(*) FROM entries", [], |r| r.get(0))?)).await.unwrap();
        assert_eq!(all, 5);
        // Closing an accepted turn moves nothing back.
        store.open_turn(&s.session_id, "t2", vec![user("next")], None).await.unwrap();
        let closed = TurnClose::Accept { entries: vec![user("reply")], commit: None };
        assert_eq!(store.close_turn(&s.session_id, closed).await.unwrap().len(), 1);
        drop(store);
        let store = SqliteStore::open(dir.path()).unwrap();
        assert_eq!(store.branch(&s.session_id).await.unwrap().len(), 5);
    }

    #[tokio::test]
    async fn a_database_from_before_versioning_is_migrated_and_keeps_its_queued_commits() {
        let dir = tempfile::tempdir().unwrap();
        {
            let c = Connection::open(dir.path().join(DB_FILE)).unwrap();
            c.execute_batch(SCHEMA_V1).unwrap();
            c.execute(
                "INSERT INTO sessions (session_id, agent_id, session_key, state, created_at_ms) VALUES ('s1', 'main', 'k', 'active', 1)",
                [],
            )
            .unwrap();
            let req = pb::CommitTurnRequest { advancement_key: "t1".into(), ..Default::default() };
            c.execute(
                "INSERT INTO outbox (session_id, advancement_key, engine_id, payload, created_at_ms) VALUES ('s1', 't1', 'e', ?1, 1)",
                [req.encode_to_vec()],
            )
            .unwrap();
        }
        let store = SqliteStore::open(dir.path()).unwrap();
        let pending = store.pending_commits("s1", "e").await.unwrap();
        assert_eq!(pending.len(), 1);
        assert_eq!((pending[0].attempts, pending[0].next_attempt_ms), (0, 0));
        let version: i64 =
            store.db.read(|c| Ok(c.pragma_query_value(None, "user_version", |r| r.get(0))?)).await.unwrap();
        assert_eq!(version, MIGRATIONS.len() as i64);
        drop(store);
        SqliteStore::open(dir.path()).expect("opening a current database again is a no-op");
    }
}
