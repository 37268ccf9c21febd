//! The shared store: PostgreSQL, for several gateways on one state
//! (`store.url: postgres://…`). Same trait and semantics as SQLite; what
//! differs is that no gateway owns the data:
//!
//! - **Session leases** (`session_leases`): a turn claims its session
//!   (owner, expiry on the server's clock, a fencing token that grows with
//!   every claim) and renews it while it runs. Every write of a session
//!   this gateway holds checks, in its own transaction and under a share
//!   lock on the lease row, that the token is still the current one: a
//!   gateway that lost its lease (paused, partitioned, slow) gets
//!   [`StoreError::Fenced`] and writes nothing.
//! - **Abandoned turns**: a gateway that dies leaves its open turn and its
//!   lease; once the lease has expired, the next claim of the session (or
//!   the recovery pass, through a claim) rewinds the turn as an abort, in a
//!   transaction fenced by the new claim's token. Nothing is rewound at
//!   start: other gateways are running.
//! - **Locks never outlive a lease**: connections carry `lock_timeout` and
//!   `idle_in_transaction_session_timeout` of one lease, so a gateway
//!   paused inside a write cannot hold the lease row past its expiry.
//! - **The outbox**: a pass claims the due heads of queues with `FOR
//!   UPDATE SKIP LOCKED` (picked for a few seconds), so gateways' passes
//!   split them; a delivery runs under the session's lease and the engine
//!   deduplicates by advancement key, so each turn reaches the engine's
//!   record once.
//! - No visible-tail cache: another gateway may have appended since.
//!
//! Each write is one transaction (a claim that finds a turn left open is
//! two: the claim, then the fenced rewind); the schema is versioned
//! (`ctxgate_schema`) and migrated at start under an advisory lock, so
//! gateways starting together migrate once.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use ctxgate_proto::pb::{self, AgentMessage, transcript_entry::Entry};
use deadpool_postgres::{GenericClient, Manager, ManagerConfig, Pool, RecyclingMethod, Transaction};
use prost::Message as _;
use tokio_postgres::Row;
use tokio_postgres::config::SslMode;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;

use super::{
    Advance, Claim, Claimed, CommitDraft, Forget, KIND_COMPACTION, NewEntry, OpenError, OutboxRow, PendingCommit,
    Renewal, RewriteOutcome, Session, SessionStats, Store, StoreError, Subagent, TurnClose, commit_request, kind_of,
    new_id, now_ms, plan_rewrite, rewind_carries,
};

/// Migrations in order; `ctxgate_schema.version` is how many ran.
const MIGRATIONS: &[&str] = &[SCHEMA_V1];
pub const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;
/// Serializes migrations of gateways starting together (any constant).
const MIGRATION_LOCK: i64 = 0x6374_7867_6174_6501;

const SCHEMA_V1: &str = "
CREATE TABLE sessions (
    session_id    TEXT PRIMARY KEY,
    agent_id      TEXT NOT NULL,
    session_key   TEXT NOT NULL,
    state         TEXT NOT NULL,
    created_at_ms BIGINT NOT NULL,
    leaf_id       TEXT,
    next_seq      BIGINT NOT NULL DEFAULT 1,
    ord           BIGSERIAL
);
-- One active session per key, whichever gateway creates it.
CREATE UNIQUE INDEX sessions_one_active ON sessions (agent_id, session_key) WHERE state = 'active';
CREATE INDEX sessions_by_key ON sessions (agent_id, session_key, state);
CREATE TABLE entries (
    id         TEXT PRIMARY KEY,
    session_id TEXT NOT NULL REFERENCES sessions (session_id) ON DELETE CASCADE,
    parent_id  TEXT,
    seq        BIGINT NOT NULL,
    kind       BIGINT NOT NULL,
    body       BYTEA NOT NULL,
    -- A compaction's first kept entry ('' keeps nothing): where a walk
    -- from the leaf for the visible history stops.
    first_kept TEXT
);
CREATE INDEX entries_by_session ON entries (session_id, seq);
CREATE TABLE outbox (
    ord             BIGSERIAL,
    session_id      TEXT NOT NULL,
    advancement_key TEXT NOT NULL,
    engine_id       TEXT NOT NULL,
    payload         BYTEA NOT NULL,
    created_at_ms   BIGINT NOT NULL,
    attempts        INTEGER NOT NULL DEFAULT 0,
    last_error      TEXT,
    next_attempt_ms BIGINT NOT NULL DEFAULT 0,
    -- The gateway whose outbox pass claimed the row, until when.
    picked_by       TEXT,
    picked_until    TIMESTAMPTZ,
    PRIMARY KEY (session_id, advancement_key)
);
CREATE INDEX outbox_by_engine ON outbox (session_id, engine_id, ord);
CREATE TABLE projections (
    session_id  TEXT NOT NULL REFERENCES sessions (session_id) ON DELETE CASCADE,
    host_id     TEXT NOT NULL,
    epoch       TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    PRIMARY KEY (session_id, host_id)
);
CREATE TABLE open_turns (
    session_id     TEXT PRIMARY KEY REFERENCES sessions (session_id) ON DELETE CASCADE,
    turn_id        TEXT NOT NULL,
    first_entry_id TEXT NOT NULL,
    anchor_id      TEXT NOT NULL
);
CREATE TABLE subagents (
    agent_id       TEXT NOT NULL,
    child_key      TEXT NOT NULL,
    parent_key     TEXT NOT NULL,
    rollback_token TEXT,
    expires_at_ms  BIGINT,
    PRIMARY KEY (agent_id, child_key)
);
CREATE TABLE outbox_drops (
    session_id      TEXT NOT NULL,
    agent_id        TEXT NOT NULL,
    session_key     TEXT NOT NULL,
    advancement_key TEXT NOT NULL,
    engine_id       TEXT NOT NULL,
    attempts        INTEGER NOT NULL,
    last_error      TEXT,
    dropped_at_ms   BIGINT NOT NULL
);
CREATE TABLE engine_sessions (
    session_id TEXT NOT NULL,
    engine_id  TEXT NOT NULL,
    PRIMARY KEY (session_id, engine_id)
);
CREATE TABLE forgets (
    ord             BIGSERIAL,
    session_id      TEXT NOT NULL,
    engine_id       TEXT NOT NULL,
    agent_id        TEXT NOT NULL,
    session_key     TEXT NOT NULL,
    attempts        INTEGER NOT NULL DEFAULT 0,
    last_error      TEXT,
    next_attempt_ms BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (session_id, engine_id)
);
CREATE TABLE cursors (
    session_id    TEXT NOT NULL,
    engine_id     TEXT NOT NULL,
    message_id    TEXT NOT NULL,
    seq           BIGINT NOT NULL,
    message_count BIGINT NOT NULL,
    tokens        BIGINT NOT NULL,
    PRIMARY KEY (session_id, engine_id)
);
CREATE TABLE durable_engines (engine_id TEXT PRIMARY KEY);
-- A session's lease; the row stays after a release so that tokens only
-- ever grow (a stale holder's token never matches again); it goes with its
-- session, whose id is never used again.
CREATE TABLE session_leases (
    session_id TEXT PRIMARY KEY REFERENCES sessions (session_id) ON DELETE CASCADE,
    owner      TEXT,
    token      BIGINT NOT NULL,
    expires_at TIMESTAMPTZ NOT NULL,
    interrupt  BOOLEAN NOT NULL DEFAULT false
);
";

impl From<tokio_postgres::Error> for StoreError {
    fn from(e: tokio_postgres::Error) -> Self {
        let detail = match e.as_db_error() {
            Some(db) => format!("PostgreSQL: {} ({})", db.message(), db.code().code()),
            None => format!("PostgreSQL: {}", crate::causes(&e)),
        };
        let transient = [
            SqlState::T_R_SERIALIZATION_FAILURE,
            SqlState::T_R_DEADLOCK_DETECTED,
            SqlState::LOCK_NOT_AVAILABLE,
            SqlState::QUERY_CANCELED,
            SqlState::TOO_MANY_CONNECTIONS,
            SqlState::ADMIN_SHUTDOWN,
            SqlState::CRASH_SHUTDOWN,
            SqlState::CANNOT_CONNECT_NOW,
            SqlState::IDLE_IN_TRANSACTION_SESSION_TIMEOUT,
        ];
        match e.code() {
            Some(c) if *c == SqlState::DISK_FULL => Self::Full(detail),
            Some(c) if *c == SqlState::FOREIGN_KEY_VIOLATION => Self::NoSession(detail),
            Some(c) if transient.contains(c) => Self::Unavailable(detail),
            // No SQLSTATE: the connection broke, or never came up.
            None => Self::Unavailable(detail),
            _ => Self::Backend(detail),
        }
    }
}

impl From<deadpool_postgres::PoolError> for StoreError {
    fn from(e: deadpool_postgres::PoolError) -> Self {
        match e {
            deadpool_postgres::PoolError::Backend(e) => e.into(),
            // Every connection busy for the pool's whole wait, or none can be made.
            other => Self::Unavailable(format!("PostgreSQL connection pool: {other}")),
        }
    }
}

/// The PostgreSQL store.
pub struct PostgresStore {
    pool: Pool,
    /// Lease renewals only.
    renewals: Pool,
    /// This gateway's name in lease rows (host, process, a random part).
    owner: String,
    /// Sessions this gateway holds, with their fencing tokens.
    held: Mutex<HashMap<String, i64>>,
    counts: crate::metrics::StoreCounters,
}

/// `store.url` without its password (or user), for messages and logs.
pub fn redacted(url: &str) -> String {
    match url.parse::<tokio_postgres::Config>() {
        Ok(c) => {
            let hosts: Vec<String> = c
                .get_hosts()
                .iter()
                .map(|h| match h {
                    tokio_postgres::config::Host::Tcp(h) => h.clone(),
                    tokio_postgres::config::Host::Unix(p) => p.display().to_string(),
                })
                .collect();
            let port = c.get_ports().first().copied().unwrap_or(5432);
            format!("postgres://{}:{port}/{}", hosts.join(","), c.get_dbname().unwrap_or(""))
        }
        Err(_) => "the configured store.url".into(),
    }
}

/// rustls (ring) trusting `ca_file`'s certificates, or the public roots.
fn tls_connector(ca_file: Option<&Path>) -> Result<tokio_postgres_rustls::MakeRustlsConnect, String> {
    use rustls::pki_types::{CertificateDer, pem::PemObject};
    let mut roots = rustls::RootCertStore::empty();
    match ca_file {
        None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
        Some(path) => {
            let shown = path.display();
            let certs = CertificateDer::pem_file_iter(path)
                .map_err(|e| format!("store.caFile {shown} cannot be read: {e}"))?
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("store.caFile {shown} is not PEM certificates: {e}"))?;
            let (added, _) = roots.add_parsable_certificates(certs);
            if added == 0 {
                return Err(format!("store.caFile {shown} holds no usable certificate"));
            }
        }
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(tokio_postgres_rustls::MakeRustlsConnect::new(config))
}

/// A connection error as the operator needs it.
fn connect_error(url: &str, e: &tokio_postgres::Error) -> OpenError {
    let at = redacted(url);
    let detail = match e.as_db_error() {
        Some(db) => db.message().to_owned(),
        None => crate::causes(e),
    };
    OpenError::Other { file: at, detail: format!("cannot connect to PostgreSQL: {detail}") }
}

impl PostgresStore {
    /// Connects to `url`, migrates the schema and checks it is not newer
    /// than this build; fails with a sentence (before any port is bound).
    /// TLS only when the URL says `sslmode=require`, and then verified (the
    /// server's name and chain, against `ca_file` or the public roots);
    /// otherwise plaintext (`prefer` does not mean an unverified TLS).
    pub async fn open(url: &str, opts: &crate::config::StoreSection) -> Result<Self, OpenError> {
        let mut config: tokio_postgres::Config = url.parse().map_err(|e| OpenError::Other {
            file: "store.url".into(),
            detail: format!("not a PostgreSQL URL ({e}); expected postgres://user[:password]@host[:port]/database"),
        })?;
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(Duration::from_secs(5));
        }
        if config.get_ssl_mode() == SslMode::Prefer {
            config.ssl_mode(SslMode::Disable);
        }
        // No lock or open transaction outlives a lease: a gateway paused
        // or cut off inside a write would otherwise hold the lease row (and
        // so every takeover) until the server noticed the dead connection.
        let lease_ms = opts.lease().as_millis();
        let mut options = config.get_options().unwrap_or("").to_owned();
        options.push_str(&format!(
            " -c lock_timeout={lease_ms} -c idle_in_transaction_session_timeout={lease_ms} -c statement_timeout={}",
            lease_ms.max(30_000)
        ));
        config.options(options.trim());
        let tls = tls_connector(opts.ca_file.as_deref())
            .map_err(|detail| OpenError::Other { file: redacted(url), detail })?;
        let pool = |size: usize| {
            let manager = Manager::from_config(
                config.clone(),
                tls.clone(),
                ManagerConfig { recycling_method: RecyclingMethod::Fast },
            );
            Pool::builder(manager)
                .max_size(size)
                .runtime(deadpool_postgres::Runtime::Tokio1)
                .wait_timeout(Some(Duration::from_secs(10)))
                .create_timeout(Some(Duration::from_secs(5)))
                .build()
                .map_err(|e| OpenError::Other { file: redacted(url), detail: e.to_string() })
        };
        // Renewals get connections of their own: a busy pool must not let
        // leases lapse under the turns that hold them.
        let (main, renewals) = (pool(opts.pool_size.max(1))?, pool(2)?);
        let mut client = main.get().await.map_err(|e| match e {
            deadpool_postgres::PoolError::Backend(e) => connect_error(url, &e),
            other => OpenError::Other { file: redacted(url), detail: format!("cannot connect to PostgreSQL: {other}") },
        })?;
        migrate(&mut client, url).await?;
        drop(client);
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        let owner = format!("{}/{}/{}", host.trim(), std::process::id(), &new_id()[..8]);
        Ok(Self {
            pool: main,
            renewals,
            owner,
            held: Mutex::default(),
            counts: crate::metrics::StoreCounters::default(),
        })
    }

    /// Write transactions committed, for the metrics endpoint (a write
    /// transaction holds one write: the counts stay equal; single-statement
    /// writes outside a turn are not counted).
    pub fn counters(&self) -> crate::metrics::StoreCounters {
        self.counts.clone()
    }

    async fn client(&self) -> Result<deadpool_postgres::Object, StoreError> {
        Ok(self.pool.get().await?)
    }

    async fn commit(&self, tx: Transaction<'_>) -> Result<(), StoreError> {
        tx.commit().await?;
        self.counts.commits.inc();
        self.counts.writes.inc();
        Ok(())
    }

    fn held_token(&self, session_id: &str) -> Option<i64> {
        self.held.lock().unwrap_or_else(|e| e.into_inner()).get(session_id).copied()
    }

    /// The fencing check of a write to `session_id`: if this gateway holds
    /// the session, its token must still be the lease's. The share lock
    /// makes a takeover wait for this transaction (or this one see it).
    async fn fence(&self, tx: &Transaction<'_>, session_id: &str) -> Result<(), StoreError> {
        let Some(token) = self.held_token(session_id) else { return Ok(()) };
        let row = q_opt(tx, "SELECT token FROM session_leases WHERE session_id = $1 FOR SHARE", &[&session_id]).await?;
        match row.map(|r| r.get::<_, i64>(0)) {
            Some(t) if t == token => Ok(()),
            _ => Err(StoreError::Fenced(session_id.into())),
        }
    }
}

/// Statements by their text, prepared once per connection (deadpool keeps
/// them): one round trip per statement instead of two.
async fn q<C: GenericClient>(c: &C, sql: &str, p: &[&(dyn ToSql + Sync)]) -> Result<Vec<Row>, StoreError> {
    let st = c.prepare_cached(sql).await?;
    Ok(c.query(&st, p).await?)
}

async fn q_opt<C: GenericClient>(c: &C, sql: &str, p: &[&(dyn ToSql + Sync)]) -> Result<Option<Row>, StoreError> {
    let st = c.prepare_cached(sql).await?;
    Ok(c.query_opt(&st, p).await?)
}

async fn q_one<C: GenericClient>(c: &C, sql: &str, p: &[&(dyn ToSql + Sync)]) -> Result<Row, StoreError> {
    let st = c.prepare_cached(sql).await?;
    Ok(c.query_one(&st, p).await?)
}

async fn exec<C: GenericClient>(c: &C, sql: &str, p: &[&(dyn ToSql + Sync)]) -> Result<u64, StoreError> {
    let st = c.prepare_cached(sql).await?;
    Ok(c.execute(&st, p).await?)
}

/// Applies the migrations the database lacks, under an advisory lock.
async fn migrate(client: &mut deadpool_postgres::Object, url: &str) -> Result<(), OpenError> {
    let at = redacted(url);
    let fail =
        |e: tokio_postgres::Error| OpenError::Other { file: at.clone(), detail: StoreError::from(e).to_string() };
    let tx = client.transaction().await.map_err(fail)?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK]).await.map_err(fail)?;
    tx.batch_execute("CREATE TABLE IF NOT EXISTS ctxgate_schema (version BIGINT NOT NULL)").await.map_err(fail)?;
    let found: i64 = match tx.query_opt("SELECT version FROM ctxgate_schema", &[]).await.map_err(fail)? {
        Some(r) => r.get(0),
        None => {
            tx.execute("INSERT INTO ctxgate_schema (version) VALUES (0)", &[]).await.map_err(fail)?;
            0
        }
    };
    if found > SCHEMA_VERSION {
        return Err(OpenError::NewerSchema { file: at.clone(), found, known: SCHEMA_VERSION });
    }
    for (done, sql) in MIGRATIONS.iter().enumerate().skip(found.max(0) as usize) {
        tx.batch_execute(sql).await.map_err(fail)?;
        tx.execute("UPDATE ctxgate_schema SET version = $1", &[&(done as i64 + 1)]).await.map_err(fail)?;
    }
    tx.commit().await.map_err(fail)
}

fn read_session(r: &Row) -> Session {
    Session {
        session_id: r.get(0),
        agent_id: r.get(1),
        session_key: r.get(2),
        state: r.get(3),
        created_at_ms: r.get(4),
    }
}

const SESSION_COLS: &str = "session_id, agent_id, session_key, state, created_at_ms";

fn decode(r: &Row, i: usize) -> Result<pb::TranscriptEntry, StoreError> {
    let body: &[u8] = r.get(i);
    pb::TranscriptEntry::decode(body).map_err(|e| StoreError::Backend(format!("a stored entry does not decode: {e}")))
}

fn read_subagent(r: &Row) -> Subagent {
    Subagent {
        agent_id: r.get(0),
        child_key: r.get(1),
        parent_key: r.get(2),
        rollback_token: r.get(3),
        expires_at_ms: r.get(4),
    }
}

fn read_outbox(r: &Row) -> OutboxRow {
    OutboxRow {
        agent_id: r.get(0),
        session_key: r.get(1),
        session_id: r.get(2),
        advancement_key: r.get(3),
        engine_id: r.get(4),
        attempts: r.get::<_, i32>(5) as u32,
        last_error: r.get(6),
        next_attempt_ms: r.get(7),
        created_at_ms: r.get(8),
    }
}

const OUTBOX_COLS: &str = "s.agent_id, s.session_key, o.session_id, o.advancement_key, o.engine_id, o.attempts,
    o.last_error, o.next_attempt_ms, o.created_at_ms FROM outbox o JOIN sessions s USING (session_id)";

async fn active(c: &impl GenericClient, agent: &str, key: &str) -> Result<Option<Session>, StoreError> {
    let sql =
        format!("SELECT {SESSION_COLS} FROM sessions WHERE agent_id = $1 AND session_key = $2 AND state = 'active'");
    Ok(q_opt(c, &sql, &[&agent, &key]).await?.as_ref().map(read_session))
}

/// Creates the key's active session unless another gateway just did.
async fn create(c: &impl GenericClient, agent: &str, key: &str) -> Result<Session, StoreError> {
    let id = new_id();
    exec(c,
        "INSERT INTO sessions (session_id, agent_id, session_key, state, created_at_ms) VALUES ($1, $2, $3, 'active', $4)
         ON CONFLICT (agent_id, session_key) WHERE state = 'active' DO NOTHING",
        &[&id, &agent, &key, &now_ms()],
    )
    .await?;
    active(c, agent, key).await?.ok_or_else(|| StoreError::Backend("a created session vanished".into()))
}

/// The session's (leaf, next seq), locking its row for this transaction.
async fn head(tx: &Transaction<'_>, session_id: &str) -> Result<(Option<String>, i64), StoreError> {
    let row = q_opt(tx, "SELECT leaf_id, next_seq FROM sessions WHERE session_id = $1 FOR UPDATE", &[&session_id])
        .await?
        .ok_or_else(|| StoreError::NoSession(session_id.to_owned()))?;
    Ok((row.get(0), row.get(1)))
}

async fn insert_entry(tx: &Transaction<'_>, session_id: &str, e: &pb::TranscriptEntry) -> Result<(), StoreError> {
    let seq = e.seq as i64;
    let first_kept = match &e.entry {
        Some(Entry::Compaction(c)) => Some(c.first_kept_entry_id.as_str()),
        _ => None,
    };
    exec(
        tx,
        "INSERT INTO entries (id, session_id, parent_id, seq, kind, body, first_kept) VALUES ($1, $2, $3, $4, $5, $6, $7)",
        &[&e.id, &session_id, &e.parent_id, &seq, &kind_of(e), &e.encode_to_vec(), &first_kept],
    )
    .await?;
    Ok(())
}

async fn set_head(tx: &Transaction<'_>, session_id: &str, leaf: Option<&str>, next: i64) -> Result<(), StoreError> {
    exec(tx, "UPDATE sessions SET leaf_id = $2, next_seq = $3 WHERE session_id = $1", &[&session_id, &leaf, &next])
        .await?;
    Ok(())
}

async fn append_in(
    tx: &Transaction<'_>,
    session_id: &str,
    entries: Vec<NewEntry>,
) -> Result<Vec<pb::TranscriptEntry>, StoreError> {
    let (mut parent, mut seq) = head(tx, session_id).await?;
    let mut out = Vec::with_capacity(entries.len());
    for e in entries {
        let id = new_id();
        let entry = match e.entry {
            // A stored message's id is its entry id (as in SQLite).
            Entry::Message(mut m) => {
                m.id = id.clone();
                Entry::Message(m)
            }
            c @ Entry::Compaction(_) => c,
        };
        let stored = pb::TranscriptEntry {
            id: id.clone(),
            parent_id: parent.clone(),
            seq: seq as u64,
            turn_id: e.turn_id,
            entry: Some(entry),
        };
        insert_entry(tx, session_id, &stored).await?;
        parent = Some(id);
        seq += 1;
        out.push(stored);
    }
    set_head(tx, session_id, parent.as_deref(), seq).await?;
    Ok(out)
}

/// The active branch, oldest first (one recursive query).
async fn branch_of(c: &impl GenericClient, session_id: &str) -> Result<Vec<pb::TranscriptEntry>, StoreError> {
    // One statement from the session's leaf; an empty answer is an empty
    // session or none at all (told apart only then).
    let rows = q(
        c,
        "WITH RECURSIVE chain(id, parent_id, body, depth) AS (
               SELECT e.id, e.parent_id, e.body, 0 FROM sessions s JOIN entries e ON e.id = s.leaf_id
                WHERE s.session_id = $1
               UNION ALL
               SELECT e.id, e.parent_id, e.body, chain.depth + 1 FROM entries e JOIN chain ON e.id = chain.parent_id
             ) SELECT body FROM chain ORDER BY depth DESC",
        &[&session_id],
    )
    .await?;
    if rows.is_empty() && q_opt(c, "SELECT 1 FROM sessions WHERE session_id = $1", &[&session_id]).await?.is_none() {
        return Err(StoreError::NoSession(session_id.to_owned()));
    }
    rows.iter().map(|r| decode(r, 0)).collect()
}

/// The branch from the leaf back to (and including) `stop`, newest first;
/// `None` when `stop` is not on it.
async fn branch_back_to(
    tx: &Transaction<'_>,
    session_id: &str,
    stop: &str,
) -> Result<Option<Vec<pb::TranscriptEntry>>, StoreError> {
    // From the leaf back, stopping at `stop`: what is new, not the session's age.
    let rows = q(
        tx,
        "WITH RECURSIVE walk(id, parent_id, body, depth, done) AS (
               SELECT e.id, e.parent_id, e.body, 0, e.id = $2 FROM sessions s JOIN entries e ON e.id = s.leaf_id
                WHERE s.session_id = $1
               UNION ALL
               SELECT e.id, e.parent_id, e.body, w.depth + 1, e.id = $2 FROM entries e JOIN walk w ON e.id = w.parent_id
                WHERE NOT w.done
             ) SELECT body, done FROM walk ORDER BY depth",
        &[&session_id, &stop],
    )
    .await?;
    if !rows.last().is_some_and(|r| r.get::<_, bool>(1)) {
        return Ok(None);
    }
    rows.iter().map(|r| decode(r, 0)).collect::<Result<Vec<_>, _>>().map(Some)
}

async fn rewind_in(tx: &Transaction<'_>, session_id: &str) -> Result<(), StoreError> {
    let anchor: Option<String> =
        q_opt(tx, "DELETE FROM open_turns WHERE session_id = $1 RETURNING anchor_id", &[&session_id])
            .await?
            .map(|r| r.get(0));
    let Some(anchor) = anchor else { return Ok(()) };
    let Some(tail) = branch_back_to(tx, session_id, &anchor).await? else {
        tracing::warn!(session = session_id, anchor, "an open turn's anchor is not on the branch; not rewound");
        return Ok(());
    };
    let Some(carried) = rewind_carries(tail) else { return Ok(()) };
    let (_, seq) = head(tx, session_id).await?;
    set_head(tx, session_id, Some(&anchor), seq).await?;
    append_in(tx, session_id, carried).await?;
    Ok(())
}

/// The claim statement: takes a free, expired or own (an earlier turn of
/// this gateway, released or not) lease, with the next token; and says
/// whether a turn was left open (then the claim rewinds it). One statement,
/// one round trip, in the common case.
const CLAIM: &str = "
WITH claimed AS (
  INSERT INTO session_leases (session_id, owner, token, expires_at)
  VALUES ($1, $2, 1, clock_timestamp() + $3 * interval '1 millisecond')
  ON CONFLICT (session_id) DO UPDATE
     SET owner = EXCLUDED.owner, token = session_leases.token + 1, expires_at = EXCLUDED.expires_at, interrupt = false
   WHERE session_leases.owner IS NULL OR session_leases.owner = EXCLUDED.owner
      OR session_leases.expires_at < clock_timestamp()
  RETURNING token
) SELECT token, EXISTS (SELECT 1 FROM open_turns WHERE session_id = $1) FROM claimed";

/// How long an outbox pass keeps the rows it claimed from other gateways'
/// passes (then they are anyone's again, should this gateway have died).
const PASS_PICK: Duration = Duration::from_secs(5);

fn millis(d: Duration) -> f64 {
    d.as_millis() as f64
}

#[async_trait]
impl Store for PostgresStore {
    async fn session(&self, agent: &str, key: &str, create_missing: bool) -> Result<Option<Session>, StoreError> {
        let c = self.client().await?;
        match active(&c, agent, key).await? {
            Some(s) => Ok(Some(s)),
            None if create_missing => Ok(Some(create(&c, agent, key).await?)),
            None => Ok(None),
        }
    }

    async fn replace_session(&self, agent: &str, key: &str, archive: bool) -> Result<Session, StoreError> {
        let mut c = self.client().await?;
        let tx = c.transaction().await?;
        let state = if archive { "archived" } else { "inactive" };
        exec(
            &tx,
            "UPDATE sessions SET state = $3 WHERE agent_id = $1 AND session_key = $2 AND state = 'active'",
            &[&agent, &key, &state],
        )
        .await?;
        let s = create(&tx, agent, key).await?;
        self.commit(tx).await?;
        Ok(s)
    }

    async fn list_sessions(
        &self,
        agent: Option<&str>,
        include_archived: bool,
        offset: u64,
        limit: u32,
    ) -> Result<Vec<SessionStats>, StoreError> {
        let c = self.client().await?;
        let sql = format!(
            "SELECT {SESSION_COLS},
               (SELECT COUNT(*) FROM entries e WHERE e.session_id = s.session_id),
               (SELECT COUNT(*) FROM entries e WHERE e.session_id = s.session_id AND e.kind = {KIND_COMPACTION})
             FROM sessions s
             WHERE ($1::TEXT IS NULL OR agent_id = $1) AND ($2 OR state != 'archived')
             ORDER BY agent_id COLLATE \"C\", session_key COLLATE \"C\", created_at_ms, ord LIMIT $3 OFFSET $4"
        );
        let rows =
            q(&c, &sql, &[&agent, &include_archived, &i64::from(limit), &(offset.min(i64::MAX as u64) as i64)]).await?;
        Ok(rows
            .iter()
            .map(|r| SessionStats {
                session: read_session(r),
                entries: r.get::<_, i64>(5) as u32,
                compactions: r.get::<_, i64>(6) as u32,
            })
            .collect())
    }

    async fn archive_session(&self, agent: &str, key: &str) -> Result<bool, StoreError> {
        let c = self.client().await?;
        let n = exec(
            &c,
            "UPDATE sessions SET state = 'archived' WHERE agent_id = $1 AND session_key = $2 AND state = 'active'",
            &[&agent, &key],
        )
        .await?;
        Ok(n > 0)
    }

    async fn delete_sessions(&self, agent: &str, key: &str) -> Result<u32, StoreError> {
        let mut c = self.client().await?;
        let tx = c.transaction().await?;
        const OF_KEY: &str = "SELECT session_id FROM sessions WHERE agent_id = $1 AND session_key = $2";
        let ids: Vec<String> = q(&tx, OF_KEY, &[&agent, &key]).await?.iter().map(|r| r.get(0)).collect();
        exec(
            &tx,
            &format!(
                "INSERT INTO forgets (session_id, engine_id, agent_id, session_key)
                 SELECT session_id, engine_id, $1, $2 FROM engine_sessions WHERE session_id IN ({OF_KEY})
                 UNION SELECT session_id, engine_id, $1, $2 FROM outbox WHERE session_id IN ({OF_KEY})
                 ON CONFLICT DO NOTHING"
            ),
            &[&agent, &key],
        )
        .await?;
        for id in &ids {
            self.fence(&tx, id).await?;
        }
        for table in ["outbox", "engine_sessions", "cursors"] {
            exec(&tx, &format!("DELETE FROM {table} WHERE session_id IN ({OF_KEY})"), &[&agent, &key]).await?;
        }
        exec(&tx, "DELETE FROM subagents WHERE agent_id = $1 AND child_key = $2", &[&agent, &key]).await?;
        // Entries, projections and open turns go with their session (cascade).
        let n = exec(&tx, "DELETE FROM sessions WHERE agent_id = $1 AND session_key = $2", &[&agent, &key]).await?;
        self.commit(tx).await?;
        Ok(n as u32)
    }

    async fn session_ids(&self, agent: &str, key: &str) -> Result<Vec<String>, StoreError> {
        let c = self.client().await?;
        let rows = q(
            &c,
            "SELECT session_id FROM sessions WHERE agent_id = $1 AND session_key = $2 ORDER BY session_id",
            &[&agent, &key],
        )
        .await?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }

    async fn append(&self, session_id: &str, entries: Vec<NewEntry>) -> Result<Vec<pb::TranscriptEntry>, StoreError> {
        let mut c = self.client().await?;
        let tx = c.transaction().await?;
        self.fence(&tx, session_id).await?;
        let out = append_in(&tx, session_id, entries).await?;
        self.commit(tx).await?;
        Ok(out)
    }

    async fn branch(&self, session_id: &str) -> Result<Vec<pb::TranscriptEntry>, StoreError> {
        let c = self.client().await?;
        branch_of(&c, session_id).await
    }

    async fn visible_tail(&self, session_id: &str) -> Result<Vec<pb::TranscriptEntry>, StoreError> {
        // From the leaf back to the latest compaction's first kept entry (or
        // to that compaction, when it keeps nothing), as SQLite walks it: a
        // cost bounded by the context window, not by the session's age.
        let c = self.client().await?;
        let rows = q(
            &c,
            "WITH RECURSIVE walk(id, parent_id, body, depth, target, done) AS (
               SELECT e.id, e.parent_id, e.body, 0, e.first_kept, COALESCE(e.first_kept = '', false)
                 FROM sessions s JOIN entries e ON e.id = s.leaf_id WHERE s.session_id = $1
               UNION ALL
               SELECT e.id, e.parent_id, e.body, w.depth + 1, COALESCE(w.target, e.first_kept),
                      CASE WHEN w.target IS NULL THEN COALESCE(e.first_kept = '', false) ELSE e.id = w.target END
                 FROM entries e JOIN walk w ON e.id = w.parent_id
                WHERE NOT w.done
             ) SELECT body FROM walk ORDER BY depth DESC",
            &[&session_id],
        )
        .await?;
        if rows.is_empty() && q_opt(&c, "SELECT 1 FROM sessions WHERE session_id = $1", &[&session_id]).await?.is_none()
        {
            return Err(StoreError::NoSession(session_id.to_owned()));
        }
        rows.iter().map(|r| decode(r, 0)).collect()
    }

    async fn count_sessions(&self) -> Result<u32, StoreError> {
        let c = self.client().await?;
        let n: i64 = q_one(&c, "SELECT COUNT(*) FROM sessions WHERE state = 'active'", &[]).await?.get(0);
        Ok(n as u32)
    }

    async fn rewrite(
        &self,
        session_id: &str,
        replacements: Vec<(String, AgentMessage)>,
    ) -> Result<RewriteOutcome, StoreError> {
        let branch = self.branch(session_id).await?;
        let mut c = self.client().await?;
        let tx = c.transaction().await?;
        self.fence(&tx, session_id).await?;
        let (leaf, seq) = head(&tx, session_id).await?;
        let plan = match plan_rewrite(&branch, replacements, leaf.as_deref(), seq) {
            Ok(plan) => plan,
            Err(kept) => return Ok(kept),
        };
        for e in &plan.entries {
            insert_entry(&tx, session_id, e).await?;
        }
        let (leaf, next) = plan.leaf_and_next_seq(seq);
        set_head(&tx, session_id, leaf.as_deref(), next).await?;
        if let Some(r) =
            q_opt(&tx, "SELECT first_entry_id, anchor_id FROM open_turns WHERE session_id = $1", &[&session_id]).await?
        {
            let follow = |old: String| plan.outcome.remap.get(&old).cloned().unwrap_or(old);
            let (first, anchor) = (follow(r.get(0)), follow(r.get(1)));
            exec(
                &tx,
                "UPDATE open_turns SET first_entry_id = $2, anchor_id = $3 WHERE session_id = $1",
                &[&session_id, &first, &anchor],
            )
            .await?;
        }
        self.commit(tx).await?;
        Ok(plan.outcome)
    }

    async fn open_turn(
        &self,
        session_id: &str,
        turn_id: &str,
        entries: Vec<NewEntry>,
        seen_by: Option<&str>,
    ) -> Result<Vec<pb::TranscriptEntry>, StoreError> {
        let mut c = self.client().await?;
        let tx = c.transaction().await?;
        self.fence(&tx, session_id).await?;
        rewind_in(&tx, session_id).await?;
        let out = append_in(&tx, session_id, entries).await?;
        let (Some(first), Some(last)) = (out.first(), out.last()) else {
            return Err(StoreError::Backend("a turn is admitted with at least one entry".into()));
        };
        exec(
            &tx,
            "INSERT INTO open_turns (session_id, turn_id, first_entry_id, anchor_id) VALUES ($1, $2, $3, $4)",
            &[&session_id, &turn_id, &first.id, &last.id],
        )
        .await?;
        if let Some(engine) = seen_by {
            exec(
                &tx,
                "INSERT INTO engine_sessions (session_id, engine_id) VALUES ($1, $2) ON CONFLICT DO NOTHING",
                &[&session_id, &engine],
            )
            .await?;
        }
        self.commit(tx).await?;
        Ok(out)
    }

    async fn close_turn(&self, session_id: &str, close: TurnClose) -> Result<Vec<pb::TranscriptEntry>, StoreError> {
        let mut c = self.client().await?;
        let tx = c.transaction().await?;
        self.fence(&tx, session_id).await?;
        let out = match close {
            TurnClose::Rewind => {
                rewind_in(&tx, session_id).await?;
                Vec::new()
            }
            TurnClose::Accept { entries, commit } => {
                let out = append_in(&tx, session_id, entries).await?;
                if let Some(draft) = commit {
                    queue_commit(&tx, session_id, draft).await?;
                }
                exec(&tx, "DELETE FROM open_turns WHERE session_id = $1", &[&session_id]).await?;
                out
            }
        };
        self.commit(tx).await?;
        Ok(out)
    }

    async fn record_projection(
        &self,
        session_id: &str,
        host_id: &str,
        epoch: &str,
        fingerprint: &str,
    ) -> Result<bool, StoreError> {
        let mut c = self.client().await?;
        let tx = c.transaction().await?;
        self.fence(&tx, session_id).await?;
        let before = q_opt(
            &tx,
            "SELECT epoch, fingerprint FROM projections WHERE session_id = $1 AND host_id = $2",
            &[&session_id, &host_id],
        )
        .await?
        .map(|r| (r.get::<_, String>(0), r.get::<_, String>(1)));
        let changed = before.as_ref().is_none_or(|(e, f)| e != epoch || f != fingerprint);
        if changed {
            exec(&tx,
                "INSERT INTO projections (session_id, host_id, epoch, fingerprint) VALUES ($1, $2, $3, $4)
                 ON CONFLICT (session_id, host_id) DO UPDATE SET epoch = EXCLUDED.epoch, fingerprint = EXCLUDED.fingerprint",
                &[&session_id, &host_id, &epoch, &fingerprint],
            )
            .await?;
        }
        self.commit(tx).await?;
        Ok(changed)
    }

    async fn pending_commits(&self, session_id: &str, engine_id: &str) -> Result<Vec<PendingCommit>, StoreError> {
        let c = self.client().await?;
        let rows = q(
            &c,
            "SELECT engine_id, payload, attempts, last_error, next_attempt_ms FROM outbox
                 WHERE session_id = $1 AND engine_id = $2 ORDER BY ord",
            &[&session_id, &engine_id],
        )
        .await?;
        rows.iter()
            .map(|r| {
                let body: &[u8] = r.get(1);
                let request = pb::CommitTurnRequest::decode(body)
                    .map_err(|e| StoreError::Backend(format!("a queued commit does not decode: {e}")))?;
                Ok(PendingCommit {
                    engine_id: r.get(0),
                    request,
                    attempts: r.get::<_, i32>(2) as u32,
                    last_error: r.get(3),
                    next_attempt_ms: r.get(4),
                })
            })
            .collect()
    }

    async fn due_commits(&self, now_ms: i64, engines: &[String]) -> Result<Vec<(String, String)>, StoreError> {
        let c = self.client().await?;
        // Claims the due heads of queues for this gateway's pass, so that
        // concurrent passes of several gateways split them: rows another
        // pass is claiming are skipped, not waited for; rows another pass
        // claimed stay its own for PASS_PICK (its next pass takes them
        // again). Sessions leased by a running
        // turn are left out (the turn drains them at its start). Delivery
        // itself runs under the session's lease, which is what makes it
        // one gateway's at a time.
        let rows = q(
            &c,
            "WITH due AS (
               SELECT o.session_id, o.advancement_key FROM outbox o
                 LEFT JOIN session_leases l ON l.session_id = o.session_id
                WHERE o.next_attempt_ms <= $1 AND o.engine_id = ANY($2)
                  AND (l.owner IS NULL OR l.expires_at < clock_timestamp())
                  AND (o.picked_until IS NULL OR o.picked_until < clock_timestamp() OR o.picked_by = $3)
                  AND o.ord = (SELECT MIN(f.ord) FROM outbox f
                                WHERE f.session_id = o.session_id AND f.engine_id = o.engine_id)
                ORDER BY o.ord LIMIT 1024
                FOR UPDATE OF o SKIP LOCKED
             )
             UPDATE outbox o SET picked_by = $3, picked_until = clock_timestamp() + $4 * interval '1 millisecond'
               FROM due WHERE o.session_id = due.session_id AND o.advancement_key = due.advancement_key
             RETURNING o.session_id, o.engine_id, o.ord",
            &[&now_ms, &engines, &self.owner, &millis(PASS_PICK)],
        )
        .await?;
        let mut due: Vec<(i64, String, String)> = rows.iter().map(|r| (r.get(2), r.get(0), r.get(1))).collect();
        due.sort_unstable();
        Ok(due.into_iter().map(|(_, s, e)| (s, e)).collect())
    }

    async fn complete_commit(
        &self,
        session_id: &str,
        advancement_key: &str,
        advance: Option<Advance>,
    ) -> Result<(), StoreError> {
        let mut c = self.client().await?;
        let tx = c.transaction().await?;
        self.fence(&tx, session_id).await?;
        exec(
            &tx,
            "DELETE FROM outbox WHERE session_id = $1 AND advancement_key = $2",
            &[&session_id, &advancement_key],
        )
        .await?;
        if let Some(a) = advance {
            exec(
                &tx,
                "UPDATE cursors SET message_id = $3, seq = $4, message_count = message_count + $5, tokens = tokens + $6
                 WHERE session_id = $1 AND engine_id = $2 AND seq < $4",
                &[
                    &session_id,
                    &a.engine_id,
                    &a.last_message_id,
                    &(a.seq as i64),
                    &(a.messages as i64),
                    &(a.tokens as i64),
                ],
            )
            .await?;
        }
        self.commit(tx).await
    }

    async fn durable_engines(&self) -> Result<Vec<String>, StoreError> {
        let c = self.client().await?;
        Ok(q(&c, "SELECT engine_id FROM durable_engines", &[]).await?.iter().map(|r| r.get(0)).collect())
    }

    async fn set_durable(&self, engine_id: &str, durable: bool) -> Result<(), StoreError> {
        let c = self.client().await?;
        let sql = if durable {
            "INSERT INTO durable_engines (engine_id) VALUES ($1) ON CONFLICT DO NOTHING"
        } else {
            "DELETE FROM durable_engines WHERE engine_id = $1"
        };
        exec(&c, sql, &[&engine_id]).await?;
        Ok(())
    }

    async fn cursor(&self, session_id: &str, engine_id: &str) -> Result<Option<pb::HistoryCursor>, StoreError> {
        let c = self.client().await?;
        let row = q_opt(
            &c,
            "SELECT message_id, seq, message_count, tokens FROM cursors WHERE session_id = $1 AND engine_id = $2",
            &[&session_id, &engine_id],
        )
        .await?;
        Ok(row.map(|r| pb::HistoryCursor {
            message_id: r.get(0),
            seq: r.get::<_, i64>(1) as u64,
            message_count: r.get::<_, i64>(2) as u64,
            tokens: r.get::<_, i64>(3) as u64,
        }))
    }

    async fn set_cursor(
        &self,
        session_id: &str,
        engine_id: &str,
        cursor: Option<pb::HistoryCursor>,
    ) -> Result<(), StoreError> {
        let mut c = self.client().await?;
        let tx = c.transaction().await?;
        self.fence(&tx, session_id).await?;
        match cursor {
            None => {
                exec(&tx, "DELETE FROM cursors WHERE session_id = $1 AND engine_id = $2", &[&session_id, &engine_id])
                    .await?
            }
            Some(k) => {
                exec(
                    &tx,
                    "INSERT INTO cursors (session_id, engine_id, message_id, seq, message_count, tokens)
                     VALUES ($1, $2, $3, $4, $5, $6)
                     ON CONFLICT (session_id, engine_id) DO UPDATE SET message_id = EXCLUDED.message_id,
                        seq = EXCLUDED.seq, message_count = EXCLUDED.message_count, tokens = EXCLUDED.tokens",
                    &[
                        &session_id,
                        &engine_id,
                        &k.message_id,
                        &(k.seq as i64),
                        &(k.message_count as i64),
                        &(k.tokens as i64),
                    ],
                )
                .await?
            }
        };
        self.commit(tx).await
    }

    async fn branch_after(
        &self,
        session_id: &str,
        cursor: &pb::HistoryCursor,
    ) -> Result<Option<Vec<pb::TranscriptEntry>>, StoreError> {
        let branch = self.branch(session_id).await?;
        if cursor.message_id.is_empty() {
            // An empty cursor holds nothing of the branch but what its seq says.
            return Ok(Some(branch.into_iter().filter(|e| e.seq > cursor.seq).collect()));
        }
        // As SQLite walks it: from the leaf back, stopping at the cursor's
        // message (by message id or entry id) or at a seq it already has.
        let mut out = Vec::new();
        for e in branch.into_iter().rev() {
            if e.id == cursor.message_id || matches!(&e.entry, Some(Entry::Message(m)) if m.id == cursor.message_id) {
                out.reverse();
                return Ok(Some(out));
            }
            if e.seq <= cursor.seq {
                return Ok(None);
            }
            out.push(e);
        }
        Ok(None)
    }

    async fn refuse_commit(
        &self,
        session_id: &str,
        advancement_key: &str,
        error: &str,
        next_attempt_ms: i64,
    ) -> Result<(), StoreError> {
        let mut c = self.client().await?;
        let tx = c.transaction().await?;
        self.fence(&tx, session_id).await?;
        exec(
            &tx,
            "UPDATE outbox SET attempts = attempts + 1, last_error = $3, next_attempt_ms = $4
             WHERE session_id = $1 AND advancement_key = $2",
            &[&session_id, &advancement_key, &error, &next_attempt_ms],
        )
        .await?;
        self.commit(tx).await
    }

    async fn list_outbox(&self, agent: Option<&str>, limit: u32) -> Result<(Vec<OutboxRow>, u32), StoreError> {
        let c = self.client().await?;
        let filter = "$1::TEXT IS NULL OR s.agent_id = $1";
        let rows = q(
            &c,
            &format!("SELECT {OUTBOX_COLS} WHERE {filter} ORDER BY o.ord LIMIT $2"),
            &[&agent, &i64::from(limit)],
        )
        .await?;
        let total: i64 = q_one(
            &c,
            &format!("SELECT COUNT(*) FROM outbox o JOIN sessions s USING (session_id) WHERE {filter}"),
            &[&agent],
        )
        .await?
        .get(0);
        let rows: Vec<OutboxRow> = rows.iter().map(read_outbox).collect();
        let more = (total as u32).saturating_sub(rows.len() as u32);
        Ok((rows, more))
    }

    async fn outbox_of_key(&self, agent: &str, key: &str) -> Result<Vec<OutboxRow>, StoreError> {
        let c = self.client().await?;
        let sql = format!("SELECT {OUTBOX_COLS} WHERE s.agent_id = $1 AND s.session_key = $2 ORDER BY o.ord");
        Ok(q(&c, &sql, &[&agent, &key]).await?.iter().map(read_outbox).collect())
    }

    async fn retry_outbox(&self, agent: &str, key: &str) -> Result<u32, StoreError> {
        let c = self.client().await?;
        let n = exec(
            &c,
            "UPDATE outbox SET next_attempt_ms = 0 WHERE session_id IN
                   (SELECT session_id FROM sessions WHERE agent_id = $1 AND session_key = $2)",
            &[&agent, &key],
        )
        .await?;
        Ok(n as u32)
    }

    async fn drop_outbox(&self, agent: &str, key: &str) -> Result<Vec<OutboxRow>, StoreError> {
        let mut c = self.client().await?;
        let tx = c.transaction().await?;
        let sql =
            format!("SELECT {OUTBOX_COLS} WHERE s.agent_id = $1 AND s.session_key = $2 ORDER BY o.ord FOR UPDATE OF o");
        let rows: Vec<OutboxRow> = q(&tx, &sql, &[&agent, &key]).await?.iter().map(read_outbox).collect();
        let at = now_ms();
        for r in &rows {
            self.fence(&tx, &r.session_id).await?;
            let attempts = r.attempts as i32;
            exec(&tx,
                "INSERT INTO outbox_drops (session_id, agent_id, session_key, advancement_key, engine_id, attempts, last_error, dropped_at_ms)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
                &[&r.session_id, &r.agent_id, &r.session_key, &r.advancement_key, &r.engine_id, &attempts, &r.last_error, &at],
            )
            .await?;
            exec(
                &tx,
                "DELETE FROM outbox WHERE session_id = $1 AND advancement_key = $2",
                &[&r.session_id, &r.advancement_key],
            )
            .await?;
        }
        self.commit(tx).await?;
        Ok(rows)
    }

    async fn outbox_counts(&self) -> Result<(u32, u32), StoreError> {
        let c = self.client().await?;
        let r = q_one(&c, "SELECT COUNT(*), COUNT(*) FILTER (WHERE attempts > 0) FROM outbox", &[]).await?;
        Ok((r.get::<_, i64>(0) as u32, r.get::<_, i64>(1) as u32))
    }

    async fn note_engine_session(&self, session_id: &str, engine_id: &str) -> Result<(), StoreError> {
        let c = self.client().await?;
        exec(
            &c,
            "INSERT INTO engine_sessions (session_id, engine_id) VALUES ($1, $2) ON CONFLICT DO NOTHING",
            &[&session_id, &engine_id],
        )
        .await?;
        Ok(())
    }

    async fn pending_forgets(&self, now_ms: i64, engines: &[String]) -> Result<Vec<Forget>, StoreError> {
        let c = self.client().await?;
        let rows = q(
            &c,
            "SELECT session_id, engine_id, agent_id, session_key, attempts FROM forgets
                 WHERE next_attempt_ms <= $1 AND engine_id = ANY($2) ORDER BY ord LIMIT 256",
            &[&now_ms, &engines],
        )
        .await?;
        Ok(rows
            .iter()
            .map(|r| Forget {
                session_id: r.get(0),
                engine_id: r.get(1),
                agent_id: r.get(2),
                session_key: r.get(3),
                attempts: r.get::<_, i32>(4) as u32,
            })
            .collect())
    }

    async fn settle_forget(
        &self,
        session_id: &str,
        engine_id: &str,
        retry_at: Option<(i64, &str)>,
    ) -> Result<(), StoreError> {
        let c = self.client().await?;
        match retry_at {
            None => {
                exec(&c, "DELETE FROM forgets WHERE session_id = $1 AND engine_id = $2", &[&session_id, &engine_id])
                    .await?
            }
            Some((at, why)) => {
                exec(
                    &c,
                    "UPDATE forgets SET attempts = attempts + 1, last_error = $3, next_attempt_ms = $4
                     WHERE session_id = $1 AND engine_id = $2",
                    &[&session_id, &engine_id, &why, &at],
                )
                .await?
            }
        };
        Ok(())
    }

    async fn add_subagent(&self, a: Subagent) -> Result<(), StoreError> {
        let c = self.client().await?;
        exec(&c,
            "INSERT INTO subagents (agent_id, child_key, parent_key, rollback_token, expires_at_ms) VALUES ($1, $2, $3, $4, $5)
             ON CONFLICT (agent_id, child_key) DO UPDATE SET parent_key = EXCLUDED.parent_key,
                rollback_token = EXCLUDED.rollback_token, expires_at_ms = EXCLUDED.expires_at_ms",
            &[&a.agent_id, &a.child_key, &a.parent_key, &a.rollback_token, &a.expires_at_ms],
        )
        .await?;
        Ok(())
    }

    async fn take_subagent(&self, agent: &str, child_key: &str) -> Result<Option<Subagent>, StoreError> {
        let c = self.client().await?;
        let row = q_opt(
            &c,
            "DELETE FROM subagents WHERE agent_id = $1 AND child_key = $2
                 RETURNING agent_id, child_key, parent_key, rollback_token, expires_at_ms",
            &[&agent, &child_key],
        )
        .await?;
        Ok(row.as_ref().map(read_subagent))
    }

    async fn expired_subagents(&self, now_ms: i64) -> Result<Vec<Subagent>, StoreError> {
        let c = self.client().await?;
        let rows = q(
            &c,
            "SELECT agent_id, child_key, parent_key, rollback_token, expires_at_ms FROM subagents
                 WHERE expires_at_ms IS NOT NULL AND expires_at_ms <= $1",
            &[&now_ms],
        )
        .await?;
        Ok(rows.iter().map(read_subagent).collect())
    }

    fn shared(&self) -> bool {
        true
    }

    async fn claim_session(&self, session_id: &str, ttl: Duration, interrupt: bool) -> Result<Claimed, StoreError> {
        let c = self.client().await?;
        let Some(row) = q_opt(&c, CLAIM, &[&session_id, &self.owner, &millis(ttl)]).await? else {
            let row = if interrupt {
                let sql = "UPDATE session_leases SET interrupt = true
                            WHERE session_id = $1 AND owner IS NOT NULL RETURNING owner";
                q_opt(&c, sql, &[&session_id]).await?
            } else {
                q_opt(&c, "SELECT owner FROM session_leases WHERE session_id = $1", &[&session_id]).await?
            };
            let owner = row.and_then(|r| r.get::<_, Option<String>>(0)).unwrap_or_default();
            return Ok(Claimed::Busy { owner });
        };
        let (token, left_open): (i64, bool) = (row.get(0), row.get(1));
        self.held.lock().unwrap_or_else(|e| e.into_inner()).insert(session_id.into(), token);
        let claim = Claim { session_id: session_id.into(), token };
        if left_open {
            // Whoever held it before left a turn open: it ends as an
            // abort, fenced by this claim (a newer one would refuse it).
            drop(c);
            if let Err(e) = self.close_turn(session_id, TurnClose::Rewind).await {
                self.release_claim(&claim).await.ok();
                return Err(e);
            }
        }
        Ok(Claimed::Held(claim))
    }

    async fn renew_claim(&self, claim: &Claim, ttl: Duration) -> Result<Renewal, StoreError> {
        let c = self.renewals.get().await?;
        let row = q_opt(
            &c,
            "UPDATE session_leases SET expires_at = clock_timestamp() + $3 * interval '1 millisecond'
                 WHERE session_id = $1 AND token = $2 RETURNING interrupt",
            &[&claim.session_id, &claim.token, &millis(ttl)],
        )
        .await?;
        Ok(match row.map(|r| r.get::<_, bool>(0)) {
            None => Renewal::Lost,
            Some(true) => Renewal::Interrupted,
            Some(false) => Renewal::Held,
        })
    }

    async fn release_claim(&self, claim: &Claim) -> Result<(), StoreError> {
        {
            let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
            if held.get(&claim.session_id) == Some(&claim.token) {
                held.remove(&claim.session_id);
            }
        }
        let c = self.client().await?;
        exec(
            &c,
            "UPDATE session_leases SET owner = NULL, interrupt = false, expires_at = clock_timestamp()
             WHERE session_id = $1 AND token = $2",
            &[&claim.session_id, &claim.token],
        )
        .await?;
        Ok(())
    }

    async fn interrupt_holder(&self, session_id: &str) -> Result<bool, StoreError> {
        let c = self.client().await?;
        let n = exec(
            &c,
            "UPDATE session_leases SET interrupt = true
                 WHERE session_id = $1 AND owner IS NOT NULL AND expires_at >= clock_timestamp()",
            &[&session_id],
        )
        .await?;
        Ok(n > 0)
    }

    async fn abandoned_turns(&self) -> Result<Vec<String>, StoreError> {
        let c = self.client().await?;
        let rows = q(
            &c,
            "SELECT o.session_id FROM open_turns o LEFT JOIN session_leases l USING (session_id)
                 WHERE l.owner IS NULL OR l.expires_at < clock_timestamp() ORDER BY random() LIMIT 256",
            &[],
        )
        .await?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }
}

async fn queue_commit(tx: &Transaction<'_>, session_id: &str, draft: CommitDraft) -> Result<(), StoreError> {
    let first: String = q_opt(tx, "SELECT first_entry_id FROM open_turns WHERE session_id = $1", &[&session_id])
        .await?
        .ok_or_else(|| StoreError::Backend("a commit is queued for a turn that is not open".into()))?
        .get(0);
    let range = branch_back_to(tx, session_id, &first)
        .await?
        .ok_or_else(|| StoreError::Backend(format!("the open turn's first entry {first} is not on the branch")))?;
    let engine = draft.engine_id.clone();
    let req = commit_request(draft, range);
    exec(tx,
        "INSERT INTO outbox (session_id, advancement_key, engine_id, payload, created_at_ms) VALUES ($1, $2, $3, $4, $5)",
        &[&session_id, &req.advancement_key, &engine, &req.encode_to_vec(), &now_ms()],
    )
    .await?;
    Ok(())
}
