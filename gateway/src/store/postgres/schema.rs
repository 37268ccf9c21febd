//! The PostgreSQL schema: numbered migrations in `ctxgate_schema`, applied
//! at start under an advisory lock (gateways starting together migrate
//! once); a database from a newer ctxgate is refused.

use super::redacted;
use crate::store::{OpenError, StoreError};

/// Migrations in order; `ctxgate_schema.version` is how many ran.
const MIGRATIONS: &[&str] = &[SCHEMA_V1, SCHEMA_V2];

/// Failures of the engine on a queued commit, in a row (a poison row is
/// held after a few: `store.holdCommitAfterFailures`).
const SCHEMA_V2: &str = "ALTER TABLE outbox ADD COLUMN failures INTEGER NOT NULL DEFAULT 0;";
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

/// Applies the migrations the database lacks, under an advisory lock.
pub(super) async fn migrate(client: &mut deadpool_postgres::Object, url: &str) -> Result<(), OpenError> {
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
