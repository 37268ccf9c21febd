//! PostgreSQL: session leases (`session_leases`) and fencing. A turn claims
//! its session (owner, expiry on the server's clock, a token that grows
//! with every claim) and renews it while it runs; every write of a session
//! this gateway holds runs the fencing check (`fence`: token and owner) in
//! its transaction, so a gateway whose lease was taken over writes nothing.
//! A claim that finds a turn left open by an earlier holder rewinds it,
//! fenced by the new token.

use std::time::Duration;

use async_trait::async_trait;
use deadpool_postgres::Transaction;

use super::{PostgresStore, exec, millis, q, q_opt};
use crate::store::{Claim, Claimed, Claims, Renewal, StoreError, Transcript, TurnClose};

impl PostgresStore {
    pub(super) fn held_token(&self, session_id: &str) -> Option<i64> {
        self.held.lock().unwrap_or_else(|e| e.into_inner()).get(session_id).copied()
    }

    /// The fencing check of a write to `session_id`: if this gateway holds
    /// the session, its token must still be the lease's. The share lock
    /// makes a takeover wait for this transaction (or this one see it).
    pub(super) async fn fence(&self, tx: &Transaction<'_>, session_id: &str) -> Result<(), StoreError> {
        self.fence_held(tx, session_id, self.held_token(session_id)).await
    }

    /// [`fence`](Self::fence) with the token as read before: a pipeline
    /// reads it once, for the statements it prepares and the check alike.
    async fn fence_held(&self, tx: &Transaction<'_>, session_id: &str, held: Option<i64>) -> Result<(), StoreError> {
        let Some(token) = held else { return Ok(()) };
        let row = q_opt(tx, FENCE, &[&session_id, &self.owner]).await?;
        still_held(session_id, token, row.map(|r| r.get::<_, i64>(0)))
    }

    /// `write` (`statements` of `tx` that need no answer in between) sent
    /// behind the fencing check of `session_id` ([`fence`](Self::fence)),
    /// in one round trip: a refused write goes back with its transaction
    /// (though the server runs what was sent behind the check first).
    pub(super) async fn fenced_write<'a, T>(
        &self,
        tx: &Transaction<'_>,
        session_id: &str,
        statements: impl IntoIterator<Item = &'a str>,
        write: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let held = self.held_token(session_id);
        super::prepare_pipeline(tx, held.map(|_| FENCE).into_iter().chain(statements)).await?;
        let ((), out) = tokio::try_join!(biased; self.fence_held(tx, session_id, held), write)?;
        Ok(out)
    }
}

/// The fencing check's statement ([`PostgresStore::fence`]).
const FENCE: &str = "SELECT token FROM session_leases WHERE session_id = $1 AND owner = $2 FOR SHARE";

/// The fencing verdict: the lease's token (`found`, read under a share
/// lock where this gateway is the owner) must still be the one this
/// gateway was handed.
pub(super) fn still_held(session_id: &str, held: i64, found: Option<i64>) -> Result<(), StoreError> {
    if found == Some(held) { Ok(()) } else { Err(StoreError::Fenced(session_id.into())) }
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

#[async_trait]
impl Claims for PostgresStore {
    fn shared(&self) -> bool {
        true
    }

    async fn claim_session(&self, session_id: &str, ttl: Duration, interrupt: bool) -> Result<Claimed, StoreError> {
        let c = self.claims.get().await?;
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
                 WHERE session_id = $1 AND token = $2 AND owner = $4 RETURNING interrupt",
            &[&claim.session_id, &claim.token, &millis(ttl), &self.owner],
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
        let c = self.renewals.get().await?;
        exec(
            &c,
            "UPDATE session_leases SET owner = NULL, interrupt = false, expires_at = clock_timestamp()
             WHERE session_id = $1 AND token = $2 AND owner = $3",
            &[&claim.session_id, &claim.token, &self.owner],
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
