//! SQLite: sessions (by agent and key) and subagent records.

use async_trait::async_trait;
use rusqlite::{Connection, OptionalExtension, params};

use super::SqliteStore;
use crate::store::shared::{KIND_COMPACTION, SESSION_COLS, SUBAGENT_COLS, new_id, now_ms};
use crate::store::{Session, SessionStats, Sessions, StoreError, Subagent, Subagents, TurnSession};

// The row readers are per backend (rusqlite's `get` is fallible,
// tokio-postgres's is not); the column lists they read are shared.

fn read_session(r: &rusqlite::Row<'_>) -> rusqlite::Result<Session> {
    Ok(Session {
        session_id: r.get(0)?,
        agent_id: r.get(1)?,
        session_key: r.get(2)?,
        state: r.get(3)?,
        created_at_ms: r.get(4)?,
    })
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

fn active(c: &Connection, agent: &str, key: &str) -> rusqlite::Result<Option<Session>> {
    c.prepare_cached(&format!(
        "SELECT {SESSION_COLS} FROM sessions WHERE agent_id = ?1 AND session_key = ?2 AND state = 'active'"
    ))?
    .query_row(params![agent, key], read_session)
    .optional()
}

fn subagent(c: &Connection, agent: &str, key: &str) -> rusqlite::Result<bool> {
    c.prepare_cached("SELECT 1 FROM subagents WHERE agent_id = ?1 AND child_key = ?2")?.exists(params![agent, key])
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

#[async_trait]
impl Sessions for SqliteStore {
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

    async fn turn_session(&self, agent: &str, key: &str) -> Result<TurnSession, StoreError> {
        let (agent, key) = (agent.to_owned(), key.to_owned());
        let (a, k) = (agent.clone(), key.clone());
        let found = self
            .db
            .read(move |c| {
                let Some(session) = active(c, &a, &k)? else { return Ok(None) };
                Ok(Some(TurnSession { session, subagent: subagent(c, &a, &k)? }))
            })
            .await?;
        if let Some(found) = found {
            return Ok(found);
        }
        self.db
            .write(move |tx| {
                let session = match active(tx, &agent, &key)? {
                    Some(s) => s,
                    None => create(tx, &agent, &key)?,
                };
                Ok(TurnSession { session, subagent: subagent(tx, &agent, &key)? })
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
                // children stay sessions of their own (the core ends their
                // records as "released").
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

    async fn count_sessions(&self) -> Result<u32, StoreError> {
        self.db
            .read(|c| {
                Ok(c.prepare_cached("SELECT COUNT(*) FROM sessions WHERE state = 'active'")?
                    .query_row([], |r| r.get(0))?)
            })
            .await
    }
}

#[async_trait]
impl Subagents for SqliteStore {
    async fn add_subagent(&self, a: Subagent) -> Result<(), StoreError> {
        self.db.write(move |c| {
            c.prepare_cached("INSERT OR REPLACE INTO subagents (agent_id, child_key, parent_key, rollback_token, expires_at_ms) VALUES (?1, ?2, ?3, ?4, ?5)")?.execute(params![a.agent_id, a.child_key, a.parent_key, a.rollback_token, a.expires_at_ms])?;
            Ok(())
        })
        .await
    }

    async fn take_subagent(&self, agent: &str, child_key: &str) -> Result<Option<Subagent>, StoreError> {
        let (agent, key) = (agent.to_owned(), child_key.to_owned());
        self.db
            .write(move |tx| {
                let s = tx
                    .query_row(
                        &format!("SELECT {SUBAGENT_COLS} FROM subagents WHERE agent_id = ?1 AND child_key = ?2"),
                        params![agent, key],
                        read_subagent,
                    )
                    .optional()?;
                tx.prepare_cached("DELETE FROM subagents WHERE agent_id = ?1 AND child_key = ?2")?
                    .execute(params![agent, key])?;
                Ok(s)
            })
            .await
    }

    async fn is_subagent(&self, agent: &str, child_key: &str) -> Result<bool, StoreError> {
        let (agent, key) = (agent.to_owned(), child_key.to_owned());
        self.db.read(move |c| Ok(subagent(c, &agent, &key)?)).await
    }

    async fn expired_subagents(&self, now_ms: i64) -> Result<Vec<Subagent>, StoreError> {
        self.db
            .read(move |c| {
                let mut stmt = c.prepare(&format!(
                    "SELECT {SUBAGENT_COLS} FROM subagents WHERE expires_at_ms IS NOT NULL AND expires_at_ms <= ?1"
                ))?;
                let rows = stmt.query_map([now_ms], read_subagent)?;
                Ok(rows.collect::<rusqlite::Result<_>>()?)
            })
            .await
    }

    async fn children_of(&self, agent: &str, parent_key: &str) -> Result<Vec<Subagent>, StoreError> {
        let (agent, parent) = (agent.to_owned(), parent_key.to_owned());
        self.db
            .read(move |c| {
                let mut stmt = c.prepare(&format!(
                    "SELECT {SUBAGENT_COLS} FROM subagents WHERE agent_id = ?1 AND parent_key = ?2"
                ))?;
                let rows = stmt.query_map(params![agent, parent], read_subagent)?;
                Ok(rows.collect::<rusqlite::Result<_>>()?)
            })
            .await
    }
}
