//! The store: sessions and their transcript trees. What a store does is
//! split into role traits ([`Sessions`], [`Transcript`], [`Cursors`],
//! [`Outbox`], [`EngineRecords`], [`Subagents`], [`Claims`]), and
//! [`Store`] is their sum, the one the gateway holds (`Arc<dyn Store>`).
//! Two backends implement them: SQLite (WAL, `sqlite/`), the embedded
//! default one gateway owns, and PostgreSQL (`postgres/`), shared by
//! several gateways. What both compute the same way is in `shared.rs`.
//!
//! A transcript is a tree of entries (message or compaction) linked by
//! `parent_id`; a session's active leaf names the branch in use. Every
//! method is one transaction, so a crash at any point leaves each session
//! readable and consistent: an append is either all there or not at all.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use ctxgate_proto::pb::{self, AgentMessage, transcript_entry::Entry};

pub mod postgres;
mod shared;
mod sqlite;
mod tails;

pub(crate) use shared::plan_page;
pub use sqlite::{DB_FILE, LOCK_FILE, SCHEMA_VERSION, SqliteStore};

/// A store opened (and migrated), with the counters its metrics read.
pub struct Opened {
    pub store: Arc<dyn Store>,
    pub counters: crate::metrics::StoreCounters,
}

/// The configured store, opened and migrated: PostgreSQL when
/// `store.url` is set, else SQLite in the state directory.
pub async fn open(config: &crate::config::Config) -> Result<Opened, OpenError> {
    Ok(match &config.store.url {
        Some(url) => {
            let pg = postgres::PostgresStore::open(url, &config.store).await?;
            Opened { counters: pg.counters(), store: Arc::new(pg) }
        }
        None => {
            let sqlite = SqliteStore::open(&config.state_dir)?.with_tail_cache(config.store.tail_cache_mib);
            Opened { counters: sqlite.counters(), store: Arc::new(sqlite) }
        }
    })
}

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

/// A session as a turn begins it ([`Sessions::turn_session`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TurnSession {
    pub session: Session,
    /// The key is a live subagent's: its engine tools are the subagent
    /// audience's.
    pub subagent: bool,
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

/// The whole store, as the gateway holds it (`Arc<dyn Store>`): every
/// role below. Any type with them all is one.
pub trait Store: Sessions + Transcript + Cursors + Outbox + EngineRecords + Subagents + Claims {}

impl<T: Sessions + Transcript + Cursors + Outbox + EngineRecords + Subagents + Claims> Store for T {}

/// Sessions by (agent, key): the active one, replaced, listed, archived,
/// deleted.
#[async_trait]
pub trait Sessions: Send + Sync + 'static {
    /// The active session of a key, created when `create` and missing.
    async fn session(&self, agent: &str, key: &str, create: bool) -> Result<Option<Session>, StoreError>;
    /// What a turn starts from: the key's active session (created when
    /// missing) and whether the key is a live subagent's
    /// ([`Subagents::is_subagent`]), read together — every turn asks both,
    /// and each store round trip is a wake-up on a turn's critical path.
    async fn turn_session(&self, agent: &str, key: &str) -> Result<TurnSession, StoreError>;
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
    async fn count_sessions(&self) -> Result<u32, StoreError>;
}

/// A session's transcript tree: appends, the active branch and its visible
/// end, rewrites as new branches, and turns (open, then accepted or
/// rewound).
#[async_trait]
pub trait Transcript: Send + Sync + 'static {
    /// Appends entries to the session's active branch, atomically.
    async fn append(&self, session_id: &str, entries: Vec<NewEntry>) -> Result<Vec<pb::TranscriptEntry>, StoreError>;
    /// The active branch, oldest first.
    async fn branch(&self, session_id: &str) -> Result<Vec<pb::TranscriptEntry>, StoreError>;
    /// One page of the active branch, oldest first (see [`PageRequest`]):
    /// only the page's bodies are read and decoded, so a reader paging
    /// through a long session costs the store one page at a time.
    async fn branch_page(&self, session_id: &str, page: PageRequest) -> Result<PageOutcome, StoreError>;
    /// The end of the active branch that the visible history needs: from
    /// the latest compaction's first kept entry onwards (the whole branch
    /// if it was never compacted). `transcript::visible` of it equals that
    /// of the whole branch, at a cost bounded by the context window rather
    /// than the session's age. Shared, not copied: a store may keep it
    /// cached, and a long session's tail is most of a turn's bytes.
    async fn visible_tail(&self, session_id: &str) -> Result<Arc<crate::transcript::Tail>, StoreError>;
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
    /// notes the engine serving the turn (see
    /// [`EngineRecords::note_engine_session`]).
    async fn open_turn(
        &self,
        session_id: &str,
        turn_id: &str,
        entries: Vec<NewEntry>,
        seen_by: Option<&str>,
    ) -> Result<Vec<pb::TranscriptEntry>, StoreError>;
    /// Closes the session's open turn (see [`TurnClose`]).
    async fn close_turn(&self, session_id: &str, close: TurnClose) -> Result<Closed, StoreError>;
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
}

/// DELTA engines' cursors: what each engine acknowledged of a session, and
/// the branch after it.
#[async_trait]
pub trait Cursors: Send + Sync + 'static {
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
    /// [`Cursors::cursor`] and, if there is one, [`Cursors::branch_after`]
    /// it, in one call (on SQLite one read, one snapshot): what a DELTA
    /// engine's turn needs before the engine assembles.
    async fn delta(&self, session_id: &str, engine_id: &str) -> Result<Option<Delta>, StoreError>;
}

/// A DELTA engine's cursor for a session and what follows it.
#[derive(Debug, Clone, PartialEq)]
pub struct Delta {
    pub cursor: pb::HistoryCursor,
    /// The active branch after the cursor's message, oldest first; `None`
    /// when that message is no longer on the branch.
    pub after: Option<Vec<pb::TranscriptEntry>>,
}

impl Delta {
    /// The cursor and the messages after it; `None` when its message left
    /// the branch or a compaction follows it (a host compaction changed
    /// what is visible since the engine's cursor).
    pub fn messages(self) -> Option<(pb::HistoryCursor, Vec<AgentMessage>)> {
        let after = self.after?;
        let mut messages = Vec::with_capacity(after.len());
        for e in after {
            match e.entry {
                Some(Entry::Message(m)) => messages.push(m),
                _ => return None,
            }
        }
        Some((self.cursor, messages))
    }
}

/// The durable-turn outbox: CommitTurn calls queued per session and
/// engine, delivered in order, refused with backoff, and the operator's
/// view of them (`ctxgate outbox`).
#[async_trait]
pub trait Outbox: Send + Sync + 'static {
    /// The session's queued commits for one engine, oldest first.
    async fn pending_commits(&self, session_id: &str, engine_id: &str) -> Result<Vec<PendingCommit>, StoreError>;
    /// (session, engine) queues with a commit due at `now_ms` for one of
    /// `engines` (those in service: rows for others never crowd them out),
    /// the longest-waiting first.
    async fn due_commits(&self, now_ms: i64, engines: &[String]) -> Result<Vec<DueQueue>, StoreError>;
    /// Removes a delivered commit and, in the same transaction, moves the
    /// engine's cursor (if it has one) over the commit's messages.
    async fn complete_commit(
        &self,
        session_id: &str,
        advancement_key: &str,
        advance: Option<Advance>,
    ) -> Result<(), StoreError>;
    /// Records the engine's refusal of a commit: one more attempt, its
    /// error, and when to try again.
    async fn refuse_commit(
        &self,
        session_id: &str,
        advancement_key: &str,
        error: &str,
        next_attempt_ms: i64,
    ) -> Result<(), StoreError>;
    /// Counts a failure of the engine on a commit (it crashed, answered
    /// UNAVAILABLE or UNKNOWN, timed out or broke the contract on it) rather
    /// than a refusal: how many there have been in a row.
    async fn fail_commit(&self, session_id: &str, advancement_key: &str) -> Result<u32, StoreError>;
    /// Queued commits with their sessions, oldest first, at most `limit`;
    /// and how many more there are.
    async fn list_outbox(&self, agent: Option<&str>, limit: u32) -> Result<OutboxPage, StoreError>;
    /// The queued commits of a key's sessions (any engine), oldest first.
    async fn outbox_of_key(&self, agent: &str, key: &str) -> Result<Vec<OutboxRow>, StoreError>;
    /// Makes the key's queued commits due now; returns how many there are.
    async fn retry_outbox(&self, agent: &str, key: &str) -> Result<u32, StoreError>;
    /// Drops the key's queued commits, each recorded in `outbox_drops`, in
    /// one transaction; returns them.
    async fn drop_outbox(&self, agent: &str, key: &str) -> Result<Vec<OutboxRow>, StoreError>;
    /// Queued and refused (blocked) commits.
    async fn outbox_counts(&self) -> Result<OutboxCounts, StoreError>;
    /// The audited drops, newest first, at most `limit`; and how many more.
    async fn list_drops(&self, limit: u32) -> Result<(Vec<OutboxDrop>, u32), StoreError>;
    /// Forgets the audited drops made before `before_ms`; how many.
    async fn prune_drops(&self, before_ms: i64) -> Result<u32, StoreError>;
}

/// What the store remembers about engines: which declared durable turns,
/// which saw a session, and the ForgetSession calls owed after a delete.
#[async_trait]
pub trait EngineRecords: Send + Sync + 'static {
    /// Engines whose last attach declared durable turns.
    async fn durable_engines(&self) -> Result<Vec<String>, StoreError>;
    /// Records whether an engine's attach declared durable turns.
    async fn set_durable(&self, engine_id: &str, durable: bool) -> Result<(), StoreError>;
    /// Notes that an engine has seen a session (it is told to forget it
    /// when the session is deleted).
    async fn note_engine_session(&self, session_id: &str, engine_id: &str) -> Result<(), StoreError>;
    /// ForgetSession calls due at `now_ms` to one of `engines`.
    async fn pending_forgets(&self, now_ms: i64, engines: &[String]) -> Result<Vec<Forget>, StoreError>;
    /// Every owed ForgetSession, oldest first, at most `limit`; and how
    /// many more.
    async fn list_forgets(&self, limit: u32) -> Result<(Vec<Forget>, u32), StoreError>;
    /// Drops the ForgetSession calls owed to `engine_id`, each recorded in
    /// `outbox_drops` (empty advancement key), in one transaction.
    async fn drop_forgets(&self, engine_id: &str) -> Result<Vec<Forget>, StoreError>;
    /// Removes a delivered forget, or (`retry_at`) records a failed one.
    async fn settle_forget(
        &self,
        session_id: &str,
        engine_id: &str,
        retry_at: Option<(i64, &str)>,
    ) -> Result<(), StoreError>;
}

/// Live subagent records.
#[async_trait]
pub trait Subagents: Send + Sync + 'static {
    /// Records a live subagent.
    async fn add_subagent(&self, s: Subagent) -> Result<(), StoreError>;
    /// Removes and returns a subagent record.
    async fn take_subagent(&self, agent: &str, child_key: &str) -> Result<Option<Subagent>, StoreError>;
    /// Whether `child_key` is a live subagent session of `agent` (its
    /// engine tools are the subagent audience's).
    async fn is_subagent(&self, agent: &str, child_key: &str) -> Result<bool, StoreError>;
    /// Subagents whose ttl ended before `now_ms`.
    async fn expired_subagents(&self, now_ms: i64) -> Result<Vec<Subagent>, StoreError>;
    /// The live subagents a parent key spawned.
    async fn children_of(&self, agent: &str, parent_key: &str) -> Result<Vec<Subagent>, StoreError>;
}

/// Sessions shared by several gateways.
///
/// A store that one gateway owns (SQLite: the directory lock) needs none
/// of this, so these default to "always yours". A shared store leases
/// sessions: a turn holds its session's lease (owner, expiry, fencing
/// token) while it runs, and every write of the session checks the token
/// the store handed out, so a gateway whose lease was taken over can
/// never write again.
#[async_trait]
pub trait Claims: Send + Sync + 'static {
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

/// What closing a turn stored.
#[derive(Debug, Default)]
pub struct Closed {
    /// The entries an accepting close appended.
    pub entries: Vec<pb::TranscriptEntry>,
    /// The commit it queued, as [`Outbox::pending_commits`] would read it
    /// back: a turn that found its session's queue empty delivers it
    /// without that read.
    pub queued: Option<PendingCommit>,
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

impl PendingCommit {
    /// A commit just queued: never refused, due now.
    pub(crate) fn queued(engine_id: String, request: pb::CommitTurnRequest) -> Self {
        Self { engine_id, request, attempts: 0, last_error: None, next_attempt_ms: 0 }
    }
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

/// A (session, engine) queue of the outbox whose oldest commit is due.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DueQueue {
    pub session_id: String,
    pub engine_id: String,
}

/// Compares with the `(session, engine)` pair `due_commits` used to return
/// (tests written against it still read as they did).
impl PartialEq<(String, String)> for DueQueue {
    fn eq(&self, (session_id, engine_id): &(String, String)) -> bool {
        self.session_id == *session_id && self.engine_id == *engine_id
    }
}

/// A page of the outbox listing: queued commits, oldest first, and how
/// many more the limit left out.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OutboxPage {
    pub rows: Vec<OutboxRow>,
    pub more: u32,
}

/// How many commits are queued, and how many of them an engine refused
/// (blocked: their queue waits behind them).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OutboxCounts {
    pub queued: u32,
    pub blocked: u32,
}

/// Compares with the `(queued, blocked)` pair `outbox_counts` used to
/// return (tests written against it still read as they did).
impl PartialEq<(u32, u32)> for OutboxCounts {
    fn eq(&self, &(queued, blocked): &(u32, u32)) -> bool {
        self.queued == queued && self.blocked == blocked
    }
}

/// A ForgetSession owed to an engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Forget {
    pub session_id: String,
    pub engine_id: String,
    pub agent_id: String,
    pub session_key: String,
    pub attempts: u32,
    pub last_error: Option<String>,
    /// Not retried before this time (unix ms; 0 = now).
    pub next_attempt_ms: i64,
}

/// An audited drop of a queued call (`ctxgate outbox drops`): a commit,
/// or — with an empty `advancement_key` — a ForgetSession.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxDrop {
    pub session_id: String,
    pub agent_id: String,
    pub session_key: String,
    pub advancement_key: String,
    pub engine_id: String,
    pub attempts: u32,
    pub last_error: Option<String>,
    pub dropped_at_ms: i64,
}

impl OutboxDrop {
    pub(crate) fn of_commit(r: &OutboxRow, at_ms: i64) -> Self {
        Self {
            session_id: r.session_id.clone(),
            agent_id: r.agent_id.clone(),
            session_key: r.session_key.clone(),
            advancement_key: r.advancement_key.clone(),
            engine_id: r.engine_id.clone(),
            attempts: r.attempts,
            last_error: r.last_error.clone(),
            dropped_at_ms: at_ms,
        }
    }

    pub(crate) fn of_forget(f: &Forget, at_ms: i64) -> Self {
        Self {
            session_id: f.session_id.clone(),
            agent_id: f.agent_id.clone(),
            session_key: f.session_key.clone(),
            advancement_key: String::new(),
            engine_id: f.engine_id.clone(),
            attempts: f.attempts,
            last_error: f.last_error.clone(),
            dropped_at_ms: at_ms,
        }
    }
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

/// Which page of a branch to read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PageRequest {
    /// Start after this entry; `None`: at the start.
    pub after: Option<String>,
    /// End before this entry; `None`: at the leaf.
    pub until: Option<String>,
    /// At most this many entries (at least 1 is read).
    pub limit: usize,
    /// At most about this many stored bytes (a first entry over it is still
    /// read alone, so every page makes progress).
    pub max_bytes: usize,
}

/// What a page read found.
#[derive(Debug, Clone, PartialEq)]
pub enum PageOutcome {
    /// The entries, and whether more follow before `until` (or the leaf).
    Page { entries: Vec<pb::TranscriptEntry>, more: bool },
    /// `after` is not on the branch.
    UnknownAfter,
    /// `until` is not on the branch.
    UnknownUntil,
}
