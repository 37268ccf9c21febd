//! PostgreSQL: the durable-turn outbox (queued commits per session and
//! engine; a pass claims the due heads of queues with `FOR UPDATE SKIP
//! LOCKED`, so several gateways' passes split them) and the engine records
//! (durable engines, which engine saw which session, the ForgetSession
//! calls owed).

use std::time::Duration;

use async_trait::async_trait;
use tokio_postgres::Row;

use super::{PostgresStore, exec, millis, q, q_one, q_opt};
use crate::store::shared::{OUTBOX_COLS, decode_commit, now_ms};
use crate::store::{
    Advance, DueQueue, EngineRecords, Forget, Outbox, OutboxCounts, OutboxDrop, OutboxPage, OutboxRow, PendingCommit,
    StoreError,
};

const FORGET_COLS: &str = "session_id, engine_id, agent_id, session_key, attempts, last_error, next_attempt_ms";
const DROP_COLS: &str =
    "session_id, agent_id, session_key, advancement_key, engine_id, attempts, last_error, dropped_at_ms";

fn read_forget(r: &Row) -> Forget {
    Forget {
        session_id: r.get(0),
        engine_id: r.get(1),
        agent_id: r.get(2),
        session_key: r.get(3),
        attempts: r.get::<_, i32>(4).max(0) as u32,
        last_error: r.get(5),
        next_attempt_ms: r.get(6),
    }
}

fn read_drop(r: &Row) -> OutboxDrop {
    OutboxDrop {
        session_id: r.get(0),
        agent_id: r.get(1),
        session_key: r.get(2),
        advancement_key: r.get(3),
        engine_id: r.get(4),
        attempts: r.get::<_, i32>(5).max(0) as u32,
        last_error: r.get(6),
        dropped_at_ms: r.get(7),
    }
}

/// The audit row of a dropped commit or forget.
async fn record_drop(tx: &deadpool_postgres::Transaction<'_>, d: &OutboxDrop) -> Result<(), StoreError> {
    let sql = format!("INSERT INTO outbox_drops ({DROP_COLS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)");
    let attempts = i32::try_from(d.attempts).unwrap_or(i32::MAX);
    let args: [&(dyn tokio_postgres::types::ToSql + Sync); 8] = [
        &d.session_id,
        &d.agent_id,
        &d.session_key,
        &d.advancement_key,
        &d.engine_id,
        &attempts,
        &d.last_error,
        &d.dropped_at_ms,
    ];
    exec(tx, &sql, &args).await?;
    Ok(())
}

/// How long an outbox pass keeps the rows it claimed from other gateways'
/// passes (then they are anyone's again, should this gateway have died).
const PASS_PICK: Duration = Duration::from_secs(5);

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

#[async_trait]
impl Outbox for PostgresStore {
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
                let request = decode_commit(r.get(1))?;
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

    async fn due_commits(&self, now_ms: i64, engines: &[String]) -> Result<Vec<DueQueue>, StoreError> {
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
        Ok(due.into_iter().map(|(_, session_id, engine_id)| DueQueue { session_id, engine_id }).collect())
    }

    async fn complete_commit(
        &self,
        session_id: &str,
        advancement_key: &str,
        advance: Option<Advance>,
    ) -> Result<(), StoreError> {
        let mut c = self.client().await?;
        let tx = c.transaction().await?;
        const DONE: &str = "DELETE FROM outbox WHERE session_id = $1 AND advancement_key = $2";
        const ADVANCE: &str = "UPDATE cursors
            SET message_id = $3, seq = $4, message_count = message_count + $5, tokens = tokens + $6
          WHERE session_id = $1 AND engine_id = $2 AND seq < $4";
        let done = async { exec(&tx, DONE, &[&session_id, &advancement_key]).await };
        let advanced = async {
            let Some(a) = &advance else { return Ok(0) };
            exec(
                &tx,
                ADVANCE,
                &[
                    &session_id,
                    &a.engine_id,
                    &a.last_message_id,
                    &(a.seq as i64),
                    &(a.messages as i64),
                    &(a.tokens as i64),
                ],
            )
            .await
        };
        let statements = [Some(DONE), advance.is_some().then_some(ADVANCE)].into_iter().flatten();
        self.fenced_write(&tx, session_id, statements, async { tokio::try_join!(biased; done, advanced) }).await?;
        self.commit(tx).await
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
        const REFUSE: &str = "UPDATE outbox SET attempts = attempts + 1, last_error = $3, next_attempt_ms = $4
                               WHERE session_id = $1 AND advancement_key = $2";
        let refused = async { exec(&tx, REFUSE, &[&session_id, &advancement_key, &error, &next_attempt_ms]).await };
        self.fenced_write(&tx, session_id, [REFUSE], refused).await?;
        self.commit(tx).await
    }

    async fn fail_commit(&self, session_id: &str, advancement_key: &str) -> Result<u32, StoreError> {
        let mut c = self.client().await?;
        let tx = c.transaction().await?;
        const FAIL: &str = "UPDATE outbox SET failures = failures + 1 WHERE session_id = $1 AND advancement_key = $2
                            RETURNING failures";
        let failed = async { q_opt(&tx, FAIL, &[&session_id, &advancement_key]).await };
        let n = self.fenced_write(&tx, session_id, [FAIL], failed).await?.map_or(0, |r| r.get::<_, i32>(0));
        self.commit(tx).await?;
        Ok(n.max(0) as u32)
    }

    async fn list_outbox(&self, agent: Option<&str>, limit: u32) -> Result<OutboxPage, StoreError> {
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
        Ok(OutboxPage { rows, more })
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
            record_drop(&tx, &OutboxDrop::of_commit(r, at)).await?;
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

    async fn list_drops(&self, limit: u32) -> Result<(Vec<OutboxDrop>, u32), StoreError> {
        let c = self.client().await?;
        let sql = format!("SELECT {DROP_COLS} FROM outbox_drops ORDER BY dropped_at_ms DESC LIMIT $1");
        let rows: Vec<OutboxDrop> = q(&c, &sql, &[&i64::from(limit)]).await?.iter().map(read_drop).collect();
        let total: i64 = q_one(&c, "SELECT COUNT(*) FROM outbox_drops", &[]).await?.get(0);
        let more = (total.max(0) as u32).saturating_sub(rows.len() as u32);
        Ok((rows, more))
    }

    async fn prune_drops(&self, before_ms: i64) -> Result<u32, StoreError> {
        let c = self.client().await?;
        Ok(exec(&c, "DELETE FROM outbox_drops WHERE dropped_at_ms < $1", &[&before_ms]).await? as u32)
    }

    async fn outbox_counts(&self) -> Result<OutboxCounts, StoreError> {
        let c = self.client().await?;
        let r = q_one(&c, "SELECT COUNT(*), COUNT(*) FILTER (WHERE attempts > 0) FROM outbox", &[]).await?;
        Ok(OutboxCounts { queued: r.get::<_, i64>(0) as u32, blocked: r.get::<_, i64>(1) as u32 })
    }
}

#[async_trait]
impl EngineRecords for PostgresStore {
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
        let sql = format!(
            "SELECT {FORGET_COLS} FROM forgets WHERE next_attempt_ms <= $1 AND engine_id = ANY($2) ORDER BY ord LIMIT 256"
        );
        Ok(q(&c, &sql, &[&now_ms, &engines]).await?.iter().map(read_forget).collect())
    }

    async fn list_forgets(&self, limit: u32) -> Result<(Vec<Forget>, u32), StoreError> {
        let c = self.client().await?;
        let sql = format!("SELECT {FORGET_COLS} FROM forgets ORDER BY ord LIMIT $1");
        let rows: Vec<Forget> = q(&c, &sql, &[&i64::from(limit)]).await?.iter().map(read_forget).collect();
        let total: i64 = q_one(&c, "SELECT COUNT(*) FROM forgets", &[]).await?.get(0);
        let more = (total.max(0) as u32).saturating_sub(rows.len() as u32);
        Ok((rows, more))
    }

    async fn drop_forgets(&self, engine_id: &str) -> Result<Vec<Forget>, StoreError> {
        let mut c = self.client().await?;
        let tx = c.transaction().await?;
        // RETURNING has no order: `ord` (the last column) restores it.
        let sql = format!("DELETE FROM forgets WHERE engine_id = $1 RETURNING {FORGET_COLS}, ord");
        let mut rows: Vec<(i64, Forget)> =
            q(&tx, &sql, &[&engine_id]).await?.iter().map(|r| (r.get(7), read_forget(r))).collect();
        rows.sort_by_key(|(ord, _)| *ord);
        let at = now_ms();
        for (_, f) in &rows {
            record_drop(&tx, &OutboxDrop::of_forget(f, at)).await?;
        }
        self.commit(tx).await?;
        Ok(rows.into_iter().map(|(_, f)| f).collect())
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
}
