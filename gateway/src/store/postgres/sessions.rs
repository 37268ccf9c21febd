//! PostgreSQL: sessions (by agent and key; one active per key whichever
//! gateway creates it) and subagent records.

use async_trait::async_trait;
use deadpool_postgres::GenericClient;
use tokio_postgres::Row;

use super::{PostgresStore, exec, q, q_one, q_opt};
use crate::store::shared::{KIND_COMPACTION, SESSION_COLS, SUBAGENT_COLS, new_id, now_ms};
use crate::store::{Session, SessionStats, Sessions, StoreError, Subagent, Subagents, TurnSession};

// The row readers are per backend (tokio-postgres's `get` panics on a
// type mismatch, rusqlite's returns an error); the column lists they read
// are shared.

fn read_session(r: &Row) -> Session {
    Session {
        session_id: r.get(0),
        agent_id: r.get(1),
        session_key: r.get(2),
        state: r.get(3),
        created_at_ms: r.get(4),
    }
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

async fn active(c: &impl GenericClient, agent: &str, key: &str) -> Result<Option<Session>, StoreError> {
    let sql =
        format!("SELECT {SESSION_COLS} FROM sessions WHERE agent_id = $1 AND session_key = $2 AND state = 'active'");
    Ok(q_opt(c, &sql, &[&agent, &key]).await?.as_ref().map(read_session))
}

async fn subagent(c: &impl GenericClient, agent: &str, key: &str) -> Result<bool, StoreError> {
    let row = q_opt(c, "SELECT 1 FROM subagents WHERE agent_id = $1 AND child_key = $2", &[&agent, &key]).await?;
    Ok(row.is_some())
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

#[async_trait]
impl Sessions for PostgresStore {
    async fn session(&self, agent: &str, key: &str, create_missing: bool) -> Result<Option<Session>, StoreError> {
        let c = self.client().await?;
        match active(&c, agent, key).await? {
            Some(s) => Ok(Some(s)),
            None if create_missing => Ok(Some(create(&c, agent, key).await?)),
            None => Ok(None),
        }
    }

    async fn turn_session(&self, agent: &str, key: &str) -> Result<TurnSession, StoreError> {
        let c = self.client().await?;
        let sql = format!(
            "SELECT {SESSION_COLS}, EXISTS (SELECT 1 FROM subagents WHERE agent_id = $1 AND child_key = $2)
             FROM sessions WHERE agent_id = $1 AND session_key = $2 AND state = 'active'"
        );
        if let Some(r) = q_opt(&c, &sql, &[&agent, &key]).await? {
            return Ok(TurnSession { session: read_session(&r), subagent: r.get(5) });
        }
        // On the same connection: a second one from the pool while this one
        // is held could wait on a pool emptied by as many first turns.
        let session = create(&c, agent, key).await?;
        Ok(TurnSession { session, subagent: subagent(&c, agent, key).await? })
    }

    async fn replace_session(&self, agent: &str, key: &str, archive: bool) -> Result<Session, StoreError> {
        let mut c = self.client().await?;
        let tx = c.transaction().await?;
        let state = if archive { "archived" } else { "inactive" };
        let active = q(
            &tx,
            "SELECT session_id FROM sessions WHERE agent_id = $1 AND session_key = $2 AND state = 'active' FOR UPDATE",
            &[&agent, &key],
        )
        .await?;
        for r in &active {
            self.fence(&tx, r.get(0)).await?;
        }
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
        // What a deleted session said leaves memory with it (another
        // gateway's cached tail goes at its next read, which finds no leaf).
        if let Ok(mut t) = self.tails.lock() {
            t.forget(&ids);
        }
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

    async fn count_sessions(&self) -> Result<u32, StoreError> {
        let c = self.client().await?;
        let n: i64 = q_one(&c, "SELECT COUNT(*) FROM sessions WHERE state = 'active'", &[]).await?.get(0);
        Ok(n as u32)
    }
}

#[async_trait]
impl Subagents for PostgresStore {
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
        let sql = format!("DELETE FROM subagents WHERE agent_id = $1 AND child_key = $2 RETURNING {SUBAGENT_COLS}");
        let row = q_opt(&c, &sql, &[&agent, &child_key]).await?;
        Ok(row.as_ref().map(read_subagent))
    }

    async fn is_subagent(&self, agent: &str, child_key: &str) -> Result<bool, StoreError> {
        subagent(&self.client().await?, agent, child_key).await
    }

    async fn expired_subagents(&self, now_ms: i64) -> Result<Vec<Subagent>, StoreError> {
        let c = self.client().await?;
        let sql =
            format!("SELECT {SUBAGENT_COLS} FROM subagents WHERE expires_at_ms IS NOT NULL AND expires_at_ms <= $1");
        let rows = q(&c, &sql, &[&now_ms]).await?;
        Ok(rows.iter().map(read_subagent).collect())
    }

    async fn children_of(&self, agent: &str, parent_key: &str) -> Result<Vec<Subagent>, StoreError> {
        let c = self.client().await?;
        let sql = format!("SELECT {SUBAGENT_COLS} FROM subagents WHERE agent_id = $1 AND parent_key = $2");
        let rows = q(&c, &sql, &[&agent, &parent_key]).await?;
        Ok(rows.iter().map(read_subagent).collect())
    }
}
