//! The engine's own state: one SQLite file (WAL) under `--state-dir`, rows
//! keyed by session. The functions here are blocking; the engine calls them
//! through [`Store::read`] and [`Store::write`], which run them on the
//! store's one thread.
//!
//! That thread (`ctxgate_runtime::sqlite::Worker`) owns the connection
//! and group-commits writes: the writes queued while it was busy share the
//! next transaction and its one fsync, which with many sessions committing
//! turns at once is most of what a commit costs. Each write runs in its own
//! savepoint, so a write that fails is rolled back alone; no write answers
//! before its batch's COMMIT returned, so a COMMITTED answer still means
//! durable. Reads run between batches and so never see a write that might
//! still roll back.

use std::path::Path;
use std::sync::Arc;

use ctxgate_engine_sdk::pb::{AgentMessage, Role, content_part::Part};
use ctxgate_engine_sdk::proto::extractive::message_text;
use ctxgate_engine_sdk::{EngineError, estimate};
use ctxgate_runtime::sqlite;
use prost::Message as _;
use rusqlite::{Connection, OptionalExtension, params};

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS sessions (
    session_id  TEXT PRIMARY KEY,
    session_key TEXT,
    agent_id    TEXT
);
CREATE TABLE IF NOT EXISTS messages (
    session_id TEXT NOT NULL,
    seq        INTEGER NOT NULL,
    id         TEXT NOT NULL,
    tokens     INTEGER NOT NULL,
    body       BLOB NOT NULL,
    -- Read from the body, so the checks after each turn need not decode it.
    role       INTEGER NOT NULL DEFAULT 0,
    tool_bytes INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (session_id, id)
);
CREATE UNIQUE INDEX IF NOT EXISTS messages_by_seq ON messages (session_id, seq);
CREATE TABLE IF NOT EXISTS summaries (
    session_id    TEXT PRIMARY KEY,
    summary       TEXT NOT NULL,
    covered_seq   INTEGER NOT NULL,
    first_kept_id TEXT
);
CREATE TABLE IF NOT EXISTS commits (
    session_id      TEXT NOT NULL,
    advancement_key TEXT NOT NULL,
    PRIMARY KEY (session_id, advancement_key)
);
CREATE TABLE IF NOT EXISTS spawns (
    token         TEXT PRIMARY KEY,
    child_session TEXT NOT NULL,
    expires_at_ms INTEGER
);
-- Every message's text, for history_search: summarised or not, a message
-- stays findable until its session is forgotten. session_id is indexed so
-- a search matches the session's rows first (`in_session`) instead of
-- ranking every session's matches and filtering after.
CREATE VIRTUAL TABLE IF NOT EXISTS message_text USING fts5(
    text, session_id, seq UNINDEXED, role UNINDEXED, tokenize = 'unicode61'
);
";

/// `PRAGMA user_version`: 1 once the full-text index holds every message,
/// 2 once every message row has its `role` and `tool_bytes`, 3 once the
/// index has `session_id` indexed. A database from before is brought up
/// once, at open.
const VERSION: i64 = 3;

/// A session's rolling summary: everything up to `covered_seq` is in it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Summary {
    pub text: String,
    pub covered_seq: i64,
    pub first_kept_id: Option<String>,
}

/// A stored message with its position.
#[derive(Debug, Clone)]
pub struct Stored {
    pub seq: i64,
    pub message: AgentMessage,
}

/// A handle to the store's thread (the SDK's group-commit worker).
#[derive(Clone, Debug)]
pub struct Store {
    worker: Arc<sqlite::Worker<Failed>>,
}

fn internal(e: impl std::fmt::Display) -> EngineError {
    EngineError::internal(e)
}

/// Why a store call failed, as text: a failed batch's error goes to each of
/// its writes.
#[derive(Clone, Debug)]
struct Failed(String);

impl From<rusqlite::Error> for Failed {
    fn from(e: rusqlite::Error) -> Self {
        Self(e.to_string())
    }
}

impl sqlite::Failure for Failed {
    fn worker(message: &str) -> Self {
        Self(message.into())
    }
}

impl Store {
    /// Opens (or creates) `<dir>/window.sqlite` and starts its thread.
    pub fn open(dir: &Path) -> Result<Self, EngineError> {
        std::fs::create_dir_all(dir).map_err(internal)?;
        let mut conn = Connection::open(dir.join("window.sqlite")).map_err(internal)?;
        conn.pragma_update(None, "journal_mode", "WAL").map_err(internal)?;
        // FULL: a COMMITTED answer survives a power cut. The gateway drops
        // its queued copy on that answer, so NORMAL (durable only against
        // a crash of the process) could lose an accepted turn for good.
        conn.pragma_update(None, "synchronous", "FULL").map_err(internal)?;
        // Temp data in memory: an image FROM scratch has no /tmp, and SQLite
        // without a temp directory fails with "disk I/O error".
        conn.pragma_update(None, "temp_store", "MEMORY").map_err(internal)?;
        conn.busy_timeout(std::time::Duration::from_secs(5)).map_err(internal)?;
        conn.execute_batch(SCHEMA).map_err(internal)?;
        migrate(&mut conn).map_err(internal)?;
        // Every statement of a turn stays prepared, and is not planned
        // again on each new binding (without the query planner stability
        // guarantee SQLite re-plans a statement whose parameter meets an
        // indexed column whenever the parameter changes): parsing them
        // again was an eighth of the engine's CPU per turn.
        conn.set_prepared_statement_cache_capacity(64);
        conn.set_db_config(rusqlite::config::DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG, true).map_err(internal)?;
        let worker = sqlite::Worker::start("window-store", conn, (), |_| ()).map_err(internal)?;
        Ok(Self { worker: Arc::new(worker) })
    }

    /// Runs `f` alone on the store's thread, between batches: for reads,
    /// and for what cannot run inside a transaction (a checkpoint).
    pub async fn read<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Connection) -> rusqlite::Result<T> + Send + 'static,
    ) -> Result<T, EngineError> {
        self.worker.read(move |c| Ok(f(c)?)).await.map_err(|e| internal(e.0))
    }

    /// Runs `f` in the next batch, in a savepoint of its own (all of `f` or
    /// none of it is kept), and answers once the batch committed.
    pub async fn write<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    ) -> Result<T, EngineError> {
        self.worker.write(move |c| Ok(f(c)?)).await.map_err(|e| internal(e.0))
    }
}

/// Notes the session (and its key and agent, when known).
pub fn touch_session(c: &Connection, session_id: &str, key: Option<&str>, agent: Option<&str>) -> rusqlite::Result<()> {
    c.prepare_cached(
        "INSERT INTO sessions (session_id, session_key, agent_id) VALUES (?1, ?2, ?3)
         ON CONFLICT (session_id) DO UPDATE SET
           session_key = COALESCE(excluded.session_key, session_key),
           agent_id = COALESCE(excluded.agent_id, agent_id)",
    )?
    .execute(params![session_id, key, agent])?;
    Ok(())
}

pub fn session_known(c: &Connection, session_id: &str) -> rusqlite::Result<bool> {
    c.prepare_cached("SELECT 1 FROM sessions WHERE session_id = ?1")?
        .query_row([session_id], |_| Ok(()))
        .optional()
        .map(|r| r.is_some())
}

/// Brings a database from an older version up to [`VERSION`], in one
/// transaction.
fn migrate(c: &mut Connection) -> rusqlite::Result<()> {
    let version: i64 = c.query_row("PRAGMA user_version", [], |r| r.get(0))?;
    if version >= VERSION {
        return Ok(());
    }
    let tx = c.transaction()?;
    if version < 2 {
        fill_role_and_tool_bytes(&tx)?;
    }
    if version < 3 {
        // The index's columns changed: made anew, from every message.
        tx.execute("DROP TABLE IF EXISTS message_text", [])?;
        tx.execute_batch(SCHEMA)?;
        index_all(&tx)?;
    }
    tx.pragma_update(None, "user_version", VERSION)?;
    tx.commit()
}

/// Indexes every stored message, for a database from before the full-text
/// index.
fn index_all(tx: &Connection) -> rusqlite::Result<()> {
    tx.execute("DELETE FROM message_text", [])?;
    let mut rows = tx.prepare("SELECT session_id, seq, body FROM messages")?;
    let mut add = tx.prepare("INSERT INTO message_text (text, session_id, seq, role) VALUES (?1, ?2, ?3, ?4)")?;
    let mut all = rows.query([])?;
    while let Some(r) = all.next()? {
        let (session_id, seq, body): (String, i64, Vec<u8>) = (r.get(0)?, r.get(1)?, r.get(2)?);
        if let Ok(m) = AgentMessage::decode(body.as_slice()) {
            add.execute(params![message_text(&m), session_id, seq, m.role])?;
        }
    }
    Ok(())
}

/// Adds `role` and `tool_bytes` to a table from before them, read from
/// each body.
fn fill_role_and_tool_bytes(tx: &Connection) -> rusqlite::Result<()> {
    if !tx.prepare("SELECT 1 FROM pragma_table_info('messages') WHERE name = 'role'")?.exists([])? {
        tx.execute_batch(
            "ALTER TABLE messages ADD COLUMN role INTEGER NOT NULL DEFAULT 0;
             ALTER TABLE messages ADD COLUMN tool_bytes INTEGER NOT NULL DEFAULT 0;",
        )?;
    }
    let mut rows = tx.prepare("SELECT rowid, body FROM messages")?;
    let mut set = tx.prepare("UPDATE messages SET role = ?2, tool_bytes = ?3 WHERE rowid = ?1")?;
    let mut all = rows.query([])?;
    while let Some(r) = all.next()? {
        let (rowid, body): (i64, Vec<u8>) = (r.get(0)?, r.get(1)?);
        if let Ok(m) = AgentMessage::decode(body.as_slice()) {
            set.execute(params![rowid, m.role, tool_bytes(&m)])?;
        }
    }
    Ok(())
}

/// The size of the message's largest tool result text (0 without one): what
/// Maintain compares with its limit.
fn tool_bytes(m: &AgentMessage) -> i64 {
    m.content
        .iter()
        .filter_map(|p| match &p.part {
            Some(Part::ToolResult(r)) => Some(r.text.len() as i64),
            _ => None,
        })
        .max()
        .unwrap_or(0)
}

/// Adds a stored message to the full-text index.
fn index(c: &Connection, session_id: &str, seq: i64, m: &AgentMessage) -> rusqlite::Result<()> {
    c.prepare_cached("INSERT INTO message_text (text, session_id, seq, role) VALUES (?1, ?2, ?3, ?4)")?
        .execute(params![message_text(m), session_id, seq, m.role])?;
    Ok(())
}

/// Appends the messages whose id the session does not hold yet; returns how
/// many were new. Call inside a transaction for atomicity.
pub fn insert_messages(c: &Connection, session_id: &str, messages: &[AgentMessage]) -> rusqlite::Result<u64> {
    let mut next: i64 = c
        .prepare_cached("SELECT COALESCE(MAX(seq), 0) FROM messages WHERE session_id = ?1")?
        .query_row([session_id], |r| r.get(0))?;
    let mut stmt = c.prepare_cached(
        "INSERT INTO messages (session_id, seq, id, tokens, body, role, tool_bytes)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7) ON CONFLICT (session_id, id) DO NOTHING",
    )?;
    let mut added = 0;
    for m in messages {
        let tokens = estimate::message_tokens(m) as i64;
        let row = params![session_id, next + 1, m.id, tokens, m.encode_to_vec(), m.role, tool_bytes(m)];
        let changed = stmt.execute(row)?;
        if changed > 0 {
            next += 1;
            added += 1;
            index(c, session_id, next, m)?;
        }
    }
    Ok(added)
}

/// Replaces a stored message's body (same id).
pub fn replace_message(c: &Connection, session_id: &str, m: &AgentMessage) -> rusqlite::Result<()> {
    c.prepare_cached(
        "UPDATE messages SET body = ?3, tokens = ?4, role = ?5, tool_bytes = ?6 WHERE session_id = ?1 AND id = ?2",
    )?
    .execute(params![
        session_id,
        m.id,
        m.encode_to_vec(),
        estimate::message_tokens(m) as i64,
        m.role,
        tool_bytes(m)
    ])?;
    let seq: Option<i64> = c
        .prepare_cached("SELECT seq FROM messages WHERE session_id = ?1 AND id = ?2")?
        .query_row(params![session_id, m.id], |r| r.get(0))
        .optional()?;
    if let Some(seq) = seq {
        c.prepare_cached("DELETE FROM message_text WHERE message_text MATCH ?1 AND session_id = ?2 AND seq = ?3")?
            .execute(params![in_session(session_id), session_id, seq])?;
        index(c, session_id, seq, m)?;
    }
    Ok(())
}

/// A full-text hit: the message's position, role, and a snippet of its text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hit {
    pub seq: i64,
    pub role: i32,
    pub snippet: String,
}

/// The full-text rows of one session, as an FTS5 expression: the index
/// finds them without reading any other session's.
fn in_session(session_id: &str) -> String {
    format!("session_id : \"{}\"", session_id.replace('"', "\"\""))
}

const SEARCH: &str = "SELECT seq, role, snippet(message_text, 0, '[', ']', '…', 24) FROM message_text
     WHERE message_text MATCH ?1 AND session_id = ?2 ORDER BY rank LIMIT ?3";

/// The session's messages matching an FTS5 `query` (in their text), best first.
pub fn search(c: &Connection, session_id: &str, query: &str, limit: usize) -> rusqlite::Result<Vec<Hit>> {
    let mut stmt = c.prepare_cached(SEARCH)?;
    let matching = format!("{} AND text : ({query})", in_session(session_id));
    let rows = stmt.query_map(params![matching, session_id, limit as i64], |r| {
        Ok(Hit { seq: r.get(0)?, role: r.get(1)?, snippet: r.get(2)? })
    })?;
    rows.collect()
}

/// The session's messages with `from <= seq <= to`, oldest first, at most `limit`.
pub fn messages_between(
    c: &Connection,
    session_id: &str,
    from: i64,
    to: i64,
    limit: usize,
) -> rusqlite::Result<Vec<Stored>> {
    let mut stmt = c.prepare_cached(
        "SELECT seq, body FROM messages WHERE session_id = ?1 AND seq >= ?2 AND seq <= ?3 ORDER BY seq LIMIT ?4",
    )?;
    let rows = stmt.query_map(params![session_id, from, to, limit as i64], read_stored)?;
    rows.collect()
}

/// A `(seq, body)` row as the message it stores.
fn read_stored(r: &rusqlite::Row<'_>) -> rusqlite::Result<Stored> {
    let seq: i64 = r.get(0)?;
    let body: Vec<u8> = r.get(1)?;
    let message = AgentMessage::decode(body.as_slice())
        .map_err(|e| rusqlite::Error::FromSqlConversionFailure(1, rusqlite::types::Type::Blob, Box::new(e)))?;
    Ok(Stored { seq, message })
}

/// Messages after `after_seq`, oldest first.
pub fn messages_after(c: &Connection, session_id: &str, after_seq: i64) -> rusqlite::Result<Vec<Stored>> {
    let mut stmt =
        c.prepare_cached("SELECT seq, body FROM messages WHERE session_id = ?1 AND seq > ?2 ORDER BY seq")?;
    let rows = stmt.query_map(params![session_id, after_seq], read_stored)?;
    rows.collect()
}

const NEWEST_FIRST: &str = "SELECT seq, body FROM messages WHERE session_id = ?1 AND seq > ?2 ORDER BY seq DESC";

/// The newest messages after `after_seq`, oldest first: read back from the
/// newest until they hold more than `room` tokens and start with a turn's
/// first message (a user message), or down to `after_seq`. A turn that
/// starts before them cannot fit `room`, so an Assemble reads what its
/// budget can keep and one turn more, however long the session.
pub fn newest_turns_after(
    c: &Connection,
    session_id: &str,
    after_seq: i64,
    room: u64,
) -> rusqlite::Result<Vec<Stored>> {
    let mut stmt = c.prepare_cached(NEWEST_FIRST)?;
    let mut rows = stmt.query(params![session_id, after_seq])?;
    let (mut newest, mut tokens) = (Vec::new(), 0u64);
    while let Some(row) = rows.next()? {
        let stored = read_stored(row)?;
        tokens = tokens.saturating_add(estimate::message_tokens(&stored.message));
        let starts_turn = stored.message.role == Role::User as i32;
        newest.push(stored);
        if tokens > room && starts_turn {
            break;
        }
    }
    newest.reverse();
    Ok(newest)
}

/// How many user messages come after `after_seq`: each starts a turn, so
/// the turns after it number at most one more. A row without its role
/// (role 0, which no valid message has: written by an engine from before
/// the column) counts as one, so the figure never falls short.
pub fn user_messages_after(c: &Connection, session_id: &str, after_seq: i64) -> rusqlite::Result<u64> {
    c.prepare_cached("SELECT COUNT(*) FROM messages WHERE session_id = ?1 AND seq > ?2 AND role IN (?3, 0)")?
        .query_row(params![session_id, after_seq, Role::User as i32], |r| r.get::<_, i64>(0))
        .map(|n| n.max(0) as u64)
}

/// Whether a message after `after_seq` may have a tool result over `limit`
/// bytes (a row without its role, as above, may).
pub fn oversized_after(c: &Connection, session_id: &str, after_seq: i64, limit: usize) -> rusqlite::Result<bool> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    c.prepare_cached(
        "SELECT 1 FROM messages WHERE session_id = ?1 AND seq > ?2 AND (tool_bytes > ?3 OR role = 0) LIMIT 1",
    )?
    .query_row(params![session_id, after_seq, limit], |_| Ok(()))
    .optional()
    .map(|r| r.is_some())
}

/// Whether Maintain has anything to look at: a message the summary does
/// not cover yet that may hold a tool result over `limit` bytes.
pub fn maintenance_due(c: &Connection, session_id: &str, limit: usize) -> rusqlite::Result<bool> {
    oversized_after(c, session_id, summary(c, session_id)?.covered_seq, limit)
}

/// What the engine holds of a session: how many messages (seqs are dense
/// from 1) and the newest one's id and seq.
pub fn held(c: &Connection, session_id: &str) -> rusqlite::Result<(u64, Option<(String, i64)>)> {
    let last: Option<(i64, String)> = c
        .prepare_cached("SELECT seq, id FROM messages WHERE session_id = ?1 ORDER BY seq DESC LIMIT 1")?
        .query_row([session_id], |r| Ok((r.get(0)?, r.get(1)?)))
        .optional()?;
    Ok(last.map_or((0, None), |(seq, id)| (seq as u64, Some((id, seq)))))
}

pub fn has_message(c: &Connection, session_id: &str, id: &str) -> rusqlite::Result<bool> {
    c.prepare_cached("SELECT 1 FROM messages WHERE session_id = ?1 AND id = ?2")?
        .query_row([session_id, id], |_| Ok(()))
        .optional()
        .map(|r| r.is_some())
}

pub fn summary(c: &Connection, session_id: &str) -> rusqlite::Result<Summary> {
    c.prepare_cached("SELECT summary, covered_seq, first_kept_id FROM summaries WHERE session_id = ?1")?
        .query_row([session_id], |r| Ok(Summary { text: r.get(0)?, covered_seq: r.get(1)?, first_kept_id: r.get(2)? }))
        .optional()
        .map(Option::unwrap_or_default)
}

pub fn set_summary(c: &Connection, session_id: &str, s: &Summary) -> rusqlite::Result<()> {
    c.prepare_cached(
        "INSERT INTO summaries (session_id, summary, covered_seq, first_kept_id) VALUES (?1, ?2, ?3, ?4)
         ON CONFLICT (session_id) DO UPDATE SET summary = excluded.summary,
           covered_seq = excluded.covered_seq, first_kept_id = excluded.first_kept_id",
    )?
    .execute(params![session_id, s.text, s.covered_seq, s.first_kept_id])?;
    Ok(())
}

/// Records a commit key; false if it was already there.
pub fn record_commit(c: &Connection, session_id: &str, key: &str) -> rusqlite::Result<bool> {
    let n = c
        .prepare_cached("INSERT INTO commits (session_id, advancement_key) VALUES (?1, ?2) ON CONFLICT DO NOTHING")?
        .execute(params![session_id, key])?;
    Ok(n > 0)
}

/// Forgets everything about a session.
pub fn delete_session(c: &Connection, session_id: &str) -> rusqlite::Result<()> {
    for table in ["messages", "summaries", "commits", "sessions"] {
        c.execute(&format!("DELETE FROM {table} WHERE session_id = ?1"), [session_id])?;
    }
    c.execute(
        "DELETE FROM message_text WHERE message_text MATCH ?1 AND session_id = ?2",
        params![in_session(session_id), session_id],
    )?;
    Ok(())
}

pub fn add_spawn(c: &Connection, token: &str, child: &str, expires_at_ms: Option<i64>) -> rusqlite::Result<()> {
    c.prepare_cached("INSERT INTO spawns (token, child_session, expires_at_ms) VALUES (?1, ?2, ?3)")?
        .execute(params![token, child, expires_at_ms])?;
    Ok(())
}

/// Removes a spawn record; returns its child session if it existed.
pub fn take_spawn(c: &Connection, token: &str) -> rusqlite::Result<Option<String>> {
    let child = c
        .prepare_cached("SELECT child_session FROM spawns WHERE token = ?1")?
        .query_row([token], |r| r.get(0))
        .optional()?;
    c.prepare_cached("DELETE FROM spawns WHERE token = ?1")?.execute([token])?;
    Ok(child)
}

pub fn drop_spawns_of(c: &Connection, child: &str) -> rusqlite::Result<()> {
    c.prepare_cached("DELETE FROM spawns WHERE child_session = ?1")?.execute([child])?;
    Ok(())
}

/// The session id last seen with `key`.
pub fn session_by_key(c: &Connection, key: &str) -> rusqlite::Result<Option<String>> {
    c.prepare_cached("SELECT session_id FROM sessions WHERE session_key = ?1 ORDER BY rowid DESC LIMIT 1")?
        .query_row([key], |r| r.get(0))
        .optional()
}

/// Every session recorded under `key`, newest first.
pub fn sessions_by_key(c: &Connection, key: &str) -> rusqlite::Result<Vec<String>> {
    let mut stmt = c.prepare_cached("SELECT session_id FROM sessions WHERE session_key = ?1 ORDER BY rowid DESC")?;
    stmt.query_map([key], |r| r.get(0))?.collect()
}

/// Ids of the session's messages that the summary covers.
pub fn covered_ids(
    c: &Connection,
    session_id: &str,
    covered_seq: i64,
) -> rusqlite::Result<std::collections::HashSet<String>> {
    let mut stmt = c.prepare_cached("SELECT id FROM messages WHERE session_id = ?1 AND seq <= ?2")?;
    let rows = stmt.query_map(params![session_id, covered_seq], |r| r.get(0))?;
    rows.collect()
}

#[cfg(test)]
mod tests {
    use ctxgate_engine_sdk::pb::{ContentPart, ToolResult};

    use super::*;

    fn message(id: &str, role: Role, tool_text: Option<usize>) -> AgentMessage {
        let part = match tool_text {
            Some(n) => Part::ToolResult(ToolResult { text: "x".repeat(n), ..Default::default() }),
            None => Part::Text("hello".into()),
        };
        AgentMessage {
            id: id.into(),
            role: role as i32,
            content: vec![ContentPart { part: Some(part) }],
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn a_database_from_before_role_and_tool_bytes_gets_them_at_open() {
        let dir = tempfile::tempdir().unwrap();
        {
            // Version 1: the messages table without the two columns.
            let c = Connection::open(dir.path().join("window.sqlite")).unwrap();
            c.execute_batch(&SCHEMA.replace(
                "    role       INTEGER NOT NULL DEFAULT 0,\n    tool_bytes INTEGER NOT NULL DEFAULT 0,\n",
                "",
            ))
            .unwrap();
            let old = [
                message("u1", Role::User, None),
                message("a1", Role::Assistant, None),
                message("t1", Role::Tool, Some(5000)),
                message("u2", Role::User, None),
            ];
            for (i, m) in old.iter().enumerate() {
                c.execute(
                    "INSERT INTO messages (session_id, seq, id, tokens, body) VALUES ('s', ?1, ?2, 1, ?3)",
                    params![i as i64 + 1, m.id, m.encode_to_vec()],
                )
                .unwrap();
            }
            c.pragma_update(None, "user_version", 1).unwrap();
            assert!(
                !c.prepare("SELECT 1 FROM pragma_table_info('messages') WHERE name = 'role'")
                    .unwrap()
                    .exists([])
                    .unwrap()
            );
        }
        let store = Store::open(dir.path()).unwrap();
        let (users, oversized, rows) = store
            .read(|c| {
                let rows: Vec<(String, i32, i64)> = c
                    .prepare("SELECT id, role, tool_bytes FROM messages ORDER BY seq")?
                    .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?
                    .collect::<Result<_, _>>()?;
                Ok((user_messages_after(c, "s", 0)?, oversized_after(c, "s", 0, 4096)?, rows))
            })
            .await
            .unwrap();
        assert_eq!(users, 2);
        assert!(oversized);
        assert_eq!(rows[2], ("t1".into(), Role::Tool as i32, 5000));
        assert_eq!(rows[0], ("u1".into(), Role::User as i32, 0));
        // New rows carry them too; an elided message drops its size.
        store.write(|c| insert_messages(c, "s", &[message("u3", Role::User, None)])).await.unwrap();
        store.write(|c| replace_message(c, "s", &message("t1", Role::Tool, Some(10)))).await.unwrap();
        let (users, oversized) =
            store.read(|c| Ok((user_messages_after(c, "s", 0)?, oversized_after(c, "s", 0, 4096)?))).await.unwrap();
        assert_eq!((users, oversized), (3, false));
        // A row an engine from before the columns wrote after the
        // migration (role and tool_bytes left at 0) counts against both
        // checks, so neither skips work it may need.
        store
            .write(|c| {
                let m = message("old-binary", Role::Assistant, Some(9000));
                c.execute(
                    "INSERT INTO messages (session_id, seq, id, tokens, body) VALUES ('s', 99, 'old-binary', 1, ?1)",
                    [m.encode_to_vec()],
                )
            })
            .await
            .unwrap();
        let (users, oversized) =
            store.read(|c| Ok((user_messages_after(c, "s", 0)?, oversized_after(c, "s", 0, 4096)?))).await.unwrap();
        assert_eq!((users, oversized), (4, true));
        assert_eq!(
            store.read(|c| c.query_row("PRAGMA user_version", [], |r| r.get::<_, i64>(0))).await.unwrap(),
            VERSION
        );
    }

    /// A search reads its session's rows, not every session's: the rows
    /// its statement steps through are as many with 3,000 matches in
    /// another session as with none.
    #[tokio::test]
    async fn a_search_costs_what_its_session_holds_not_what_every_session_holds() {
        let said = |id: &str, text: &str| AgentMessage {
            id: id.into(),
            role: Role::User as i32,
            content: vec![ContentPart { part: Some(Part::Text(text.into())) }],
            ..Default::default()
        };
        let mine: Vec<_> = (0..3).map(|i| said(&format!("m{i}"), &format!("an apple, the {i}th"))).collect();
        let others: Vec<_> = (0..3_000).map(|i| said(&format!("o{i}"), "apple pie again")).collect();
        let steps = |store: Store| async move {
            store
                .read(|c| {
                    let mut stmt = c.prepare(SEARCH)?;
                    let matching = format!("{} AND text : (\"apple\")", in_session("mine"));
                    let hits = stmt.query_map(params![matching, "mine", 10], |_| Ok(()))?.count();
                    Ok((hits, stmt.get_status(rusqlite::StatementStatus::VmStep)))
                })
                .await
                .unwrap()
        };
        let (alone, crowded) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let store = Store::open(alone.path()).unwrap();
        let m = mine.clone();
        store.write(move |c| insert_messages(c, "mine", &m).map(drop)).await.unwrap();
        let (hits, alone_steps) = steps(store).await;
        assert_eq!(hits, 3);
        let store = Store::open(crowded.path()).unwrap();
        store
            .write(move |c| {
                insert_messages(c, "other", &others)?;
                insert_messages(c, "mine", &mine).map(drop)
            })
            .await
            .unwrap();
        let (hits, crowded_steps) = steps(store).await;
        assert_eq!(hits, 3, "only the session's own");
        assert!(
            crowded_steps <= alone_steps * 2,
            "{crowded_steps} steps among 3,000 others' matches, {alone_steps} alone"
        );
    }
}

#[cfg(test)]
mod newest_turns {
    use ctxgate_engine_sdk::testkit::msg;

    use super::*;
    use crate::turns::{drop_orphan_results, fit_turns};

    /// Turns of a user message, a tool call and its result, and an answer.
    fn history(turns: usize) -> Vec<AgentMessage> {
        (0..turns)
            .flat_map(|i| {
                let said = format!("turn {i}: {}", "words ".repeat(i % 7 * 5));
                [
                    msg::user(&format!("u{i}"), &said),
                    msg::tool_call(&format!("c{i}"), &format!("k{i}"), "read"),
                    msg::tool_result(&format!("r{i}"), &format!("k{i}"), &"x".repeat(i % 5 * 40)),
                    msg::assistant(&format!("a{i}"), "done"),
                ]
            })
            .collect()
    }

    async fn stored(turns: usize) -> (tempfile::TempDir, Store) {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let h = history(turns);
        store.write(move |c| insert_messages(c, "s", &h).map(drop)).await.unwrap();
        (dir, store)
    }

    fn ids(messages: Vec<AgentMessage>) -> Vec<String> {
        messages.into_iter().map(|m| m.id).collect()
    }

    /// What the budget keeps is what it kept when everything was read.
    #[tokio::test]
    async fn the_turns_read_keep_what_reading_everything_kept() {
        let (_dir, store) = stored(300).await;
        for (after, room) in [(0, 0), (0, 1), (0, 60), (0, 700), (0, 5_000), (0, u64::MAX), (900, 400), (1_199, 50)] {
            let (newest, all) = store
                .read(move |c| Ok((newest_turns_after(c, "s", after, room)?, messages_after(c, "s", after)?)))
                .await
                .unwrap();
            let messages = |v: Vec<Stored>| v.into_iter().map(|s| s.message).collect::<Vec<_>>();
            let (newest, all) = (messages(newest), messages(all));
            assert!(newest.len() <= all.len());
            assert_eq!(
                ids(fit_turns(drop_orphan_results(newest), room)),
                ids(fit_turns(drop_orphan_results(all), room)),
                "after seq {after}, room {room}"
            );
        }
    }

    /// The rows read are as many in a session ten times as long.
    #[tokio::test]
    async fn the_rows_read_do_not_grow_with_the_session() {
        let steps = |store: Store| async move {
            store
                .read(|c| {
                    let read = newest_turns_after(c, "s", 0, 2_000)?.len();
                    // The cached statement the walk used: its steps so far.
                    let stmt = c.prepare_cached(NEWEST_FIRST)?;
                    Ok((read, stmt.get_status(rusqlite::StatementStatus::VmStep)))
                })
                .await
                .unwrap()
        };
        // 245 and 2,450 turns end alike (turn sizes repeat every 35 turns).
        let ((_a, short), (_b, long)) = (stored(245).await, stored(2_450).await);
        let ((read_short, steps_short), (read_long, steps_long)) = (steps(short).await, steps(long).await);
        assert!(read_short < 245 * 4, "the short session is longer than the room");
        assert_eq!(read_short, read_long);
        assert!(steps_long <= steps_short * 2, "{steps_long} steps in 9,800 messages, {steps_short} in 980");
    }
}
