//! SQLite: the durable-turn outbox (queued commits per session and engine,
//! refusals with backoff, the operator's listing, retry and drop) and the
//! engine records (durable engines, which engine saw which session, the
//! ForgetSession calls owed).

use async_trait::async_trait;
use rusqlite::{OptionalExtension, params};

use super::SqliteStore;
use crate::store::shared::{OUTBOX_COLS, decode_commit, now_ms};
use crate::store::{
    Advance, DueQueue, EngineRecords, Forget, Outbox, OutboxCounts, OutboxDrop, OutboxPage, OutboxRow, PendingCommit,
    StoreError,
};

/// `?N, ?N+1, …` for `n` values starting at `?first` (`NULL` for none, which
/// matches nothing in `IN (…)`).
const FORGET_COLS: &str = "session_id, engine_id, agent_id, session_key, attempts, last_error, next_attempt_ms";
const DROP_COLS: &str =
    "session_id, agent_id, session_key, advancement_key, engine_id, attempts, last_error, dropped_at_ms";

fn read_forget(r: &rusqlite::Row<'_>) -> rusqlite::Result<Forget> {
    Ok(Forget {
        session_id: r.get(0)?,
        engine_id: r.get(1)?,
        agent_id: r.get(2)?,
        session_key: r.get(3)?,
        attempts: r.get(4)?,
        last_error: r.get(5)?,
        next_attempt_ms: r.get(6)?,
    })
}

fn read_drop(r: &rusqlite::Row<'_>) -> rusqlite::Result<OutboxDrop> {
    Ok(OutboxDrop {
        session_id: r.get(0)?,
        agent_id: r.get(1)?,
        session_key: r.get(2)?,
        advancement_key: r.get(3)?,
        engine_id: r.get(4)?,
        attempts: r.get(5)?,
        last_error: r.get(6)?,
        dropped_at_ms: r.get(7)?,
    })
}

/// The audit row of a dropped commit or forget.
fn record_drop(tx: &rusqlite::Connection, d: &OutboxDrop) -> rusqlite::Result<()> {
    tx.prepare_cached(&format!("INSERT INTO outbox_drops ({DROP_COLS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)"))?
        .execute(params![
            d.session_id,
            d.agent_id,
            d.session_key,
            d.advancement_key,
            d.engine_id,
            d.attempts,
            d.last_error,
            d.dropped_at_ms
        ])?;
    Ok(())
}

fn placeholders(n: usize, first: usize) -> String {
    if n == 0 {
        return "NULL".into();
    }
    (first..first + n).map(|i| format!("?{i}")).collect::<Vec<_>>().join(", ")
}

/// Queued commits with their sessions matching `filter` (over `o`, the
/// outbox, and `s`, the session), oldest first.
fn query_outbox(
    c: &rusqlite::Connection,
    filter: &str,
    args: impl rusqlite::Params,
    limit: u32,
) -> Result<Vec<OutboxRow>, StoreError> {
    let mut stmt = c.prepare(&format!("SELECT {OUTBOX_COLS} WHERE {filter} ORDER BY o.rowid LIMIT {limit}"))?;
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

#[async_trait]
impl Outbox for SqliteStore {
    async fn pending_commits(&self, session_id: &str, engine_id: &str) -> Result<Vec<PendingCommit>, StoreError> {
        let (session_id, engine_id) = (session_id.to_owned(), engine_id.to_owned());
        self.db
            .read(move |c| {
                let mut stmt = c.prepare_cached(
                    "SELECT engine_id, payload, attempts, last_error, next_attempt_ms FROM outbox
                 WHERE session_id = ?1 AND engine_id = ?2 ORDER BY rowid",
                )?;
                let rows = stmt.query_map([&session_id, &engine_id], |r| {
                    Ok((r.get(0)?, r.get::<_, Vec<u8>>(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
                })?;
                rows.map(|row| {
                    let (engine_id, body, attempts, last_error, next_attempt_ms) = row?;
                    Ok(PendingCommit {
                        engine_id,
                        request: decode_commit(&body)?,
                        attempts,
                        last_error,
                        next_attempt_ms,
                    })
                })
                .collect()
            })
            .await
    }

    async fn due_commits(&self, now_ms: i64, engines: &[String]) -> Result<Vec<DueQueue>, StoreError> {
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
                let rows = stmt.query_map(rusqlite::params_from_iter(args), |r| {
                    Ok(DueQueue { session_id: r.get(0)?, engine_id: r.get(1)? })
                })?;
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

    async fn fail_commit(&self, session_id: &str, advancement_key: &str) -> Result<u32, StoreError> {
        let (s, k) = (session_id.to_owned(), advancement_key.to_owned());
        self.db
            .write(move |c| {
                let n: Option<i64> = c
                    .prepare_cached(
                        "UPDATE outbox SET failures = failures + 1 WHERE session_id = ?1 AND advancement_key = ?2
                         RETURNING failures",
                    )?
                    .query_row(params![s, k], |r| r.get(0))
                    .optional()?;
                Ok(n.unwrap_or(0).clamp(0, u32::MAX as i64) as u32)
            })
            .await
    }

    async fn list_outbox(&self, agent: Option<&str>, limit: u32) -> Result<OutboxPage, StoreError> {
        let agent = agent.map(str::to_owned);
        self.db.read(move |c| {
            let rows = query_outbox(c, "?1 IS NULL OR s.agent_id = ?1", params![agent], limit)?;
            let total: u32 = c.prepare_cached("SELECT COUNT(*) FROM outbox o JOIN sessions s USING (session_id) WHERE ?1 IS NULL OR s.agent_id = ?1")?.query_row(params![agent],
                |r| r.get(0))?;
            let more = total.saturating_sub(rows.len() as u32);
            Ok(OutboxPage { rows, more })
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
        self.db
            .write(move |tx| {
                let rows = query_outbox(tx, "s.agent_id = ?1 AND s.session_key = ?2", params![agent, key], u32::MAX)?;
                let at = now_ms();
                for r in &rows {
                    record_drop(tx, &OutboxDrop::of_commit(r, at))?;
                    tx.prepare_cached("DELETE FROM outbox WHERE session_id = ?1 AND advancement_key = ?2")?
                        .execute(params![r.session_id, r.advancement_key])?;
                }
                Ok(rows)
            })
            .await
    }

    async fn list_drops(&self, limit: u32) -> Result<(Vec<OutboxDrop>, u32), StoreError> {
        self.db
            .read(move |c| {
                let mut stmt = c.prepare_cached(&format!(
                    "SELECT {DROP_COLS} FROM outbox_drops ORDER BY dropped_at_ms DESC, rowid DESC LIMIT ?1"
                ))?;
                let rows: Vec<OutboxDrop> = stmt.query_map([limit], read_drop)?.collect::<rusqlite::Result<_>>()?;
                let total: u32 = c.prepare_cached("SELECT COUNT(*) FROM outbox_drops")?.query_row([], |r| r.get(0))?;
                let more = total.saturating_sub(rows.len() as u32);
                Ok((rows, more))
            })
            .await
    }

    async fn prune_drops(&self, before_ms: i64) -> Result<u32, StoreError> {
        self.db
            .write(move |c| {
                let n = c.prepare_cached("DELETE FROM outbox_drops WHERE dropped_at_ms < ?1")?.execute([before_ms])?;
                Ok(n as u32)
            })
            .await
    }

    async fn outbox_counts(&self) -> Result<OutboxCounts, StoreError> {
        self.db
            .read(|c| {
                Ok(c.prepare_cached("SELECT COUNT(*), COUNT(*) FILTER (WHERE attempts > 0) FROM outbox")?
                    .query_row([], |r| Ok(OutboxCounts { queued: r.get(0)?, blocked: r.get(1)? }))?)
            })
            .await
    }
}

#[async_trait]
impl EngineRecords for SqliteStore {
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
                    "SELECT {FORGET_COLS} FROM forgets
                 WHERE next_attempt_ms <= ?1 AND engine_id IN ({}) ORDER BY rowid LIMIT 256",
                    placeholders(engines.len(), 2)
                ))?;
                let args =
                    std::iter::once(rusqlite::types::Value::from(now_ms)).chain(engines.into_iter().map(Into::into));
                let rows = stmt.query_map(rusqlite::params_from_iter(args), read_forget)?;
                Ok(rows.collect::<rusqlite::Result<_>>()?)
            })
            .await
    }

    async fn list_forgets(&self, limit: u32) -> Result<(Vec<Forget>, u32), StoreError> {
        self.db
            .read(move |c| {
                let mut stmt =
                    c.prepare_cached(&format!("SELECT {FORGET_COLS} FROM forgets ORDER BY rowid LIMIT ?1"))?;
                let rows: Vec<Forget> = stmt.query_map([limit], read_forget)?.collect::<rusqlite::Result<_>>()?;
                let total: u32 = c.prepare_cached("SELECT COUNT(*) FROM forgets")?.query_row([], |r| r.get(0))?;
                let more = total.saturating_sub(rows.len() as u32);
                Ok((rows, more))
            })
            .await
    }

    async fn drop_forgets(&self, engine_id: &str) -> Result<Vec<Forget>, StoreError> {
        let engine = engine_id.to_owned();
        self.db
            .write(move |tx| {
                let rows: Vec<Forget> = tx
                    .prepare_cached(&format!("SELECT {FORGET_COLS} FROM forgets WHERE engine_id = ?1 ORDER BY rowid"))?
                    .query_map([&engine], read_forget)?
                    .collect::<rusqlite::Result<_>>()?;
                let at = now_ms();
                for f in &rows {
                    record_drop(tx, &OutboxDrop::of_forget(f, at))?;
                }
                tx.prepare_cached("DELETE FROM forgets WHERE engine_id = ?1")?.execute([&engine])?;
                Ok(rows)
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
}
