//! PostgreSQL: the transcript tree (appends, the active branch and its
//! visible tail, rewrites, each read by one recursive query from the
//! leaf), turns (open, accepted with their queued commit, or rewound) and
//! DELTA engines' cursors. Every write is fenced by the session's lease.
//!
//! A walk's step looks its parent up through a `LATERAL … LIMIT 1`
//! subquery, not a join, so that it stays one index lookup a step. A
//! connection keeps a statement's generic plan until an ANALYZE replans
//! it, and written as a join the step was planned as a hash of its one row
//! and a scan of all of `entries` up to a thousand rows and more (measured:
//! PostgreSQL's CPU per turn doubled and the gateway's throughput halved).
//! The lookup alone scans only while the table is a few pages (about 160
//! short entries), where a scan costs little; a plan made then still
//! lasts until the next ANALYZE (`WALKS`' test, docs/benchmarks.md).
//!
//! Statements of a write that need no answer in between are joined
//! (`try_join!(biased; …)`): tokio-postgres pipelines requests polled
//! together, so they share one round trip. A pipeline's statements are
//! prepared before it is sent (`prepare_pipeline`), so they run in the
//! order written: the first of them takes the locks the rest rely on (the
//! head's, the fencing check's).

use std::ops::ControlFlow;
use std::sync::Arc;

use async_trait::async_trait;
use ctxgate_proto::pb::{self, AgentMessage, transcript_entry::Entry};
use deadpool_postgres::{GenericClient, Transaction};
use prost::Message as _;
use tokio_postgres::types::ToSql;

use super::{PostgresStore, exec, prepare_pipeline, q, q_opt};
use crate::store::shared::{
    AfterCursor, Placed, commit_request, decode_entry, ends_walk_to, kind_of, now_ms, order_page, place, plan_page,
    plan_rewrite, rewind_carries,
};
use crate::store::tails;
use crate::store::{
    Closed, CommitDraft, Cursors, Delta, NewEntry, PageOutcome, PageRequest, PendingCommit, RewriteOutcome, StoreError,
    Transcript, TurnClose,
};
use crate::transcript::Tail;

/// A session's (leaf, next seq) as a write found it, its row locked for
/// the write's transaction.
type Head = (Option<String>, i64);

const HEAD: &str = "SELECT leaf_id, next_seq FROM sessions WHERE session_id = $1 FOR UPDATE";

/// [`HEAD`] with the fencing check folded in ([`PostgresStore::fenced_head`]).
const FENCED_HEAD: &str = "SELECT leaf_id, next_seq,
       (SELECT token FROM session_leases WHERE session_id = $1 AND owner = $2 FOR SHARE)
  FROM sessions WHERE session_id = $1 FOR UPDATE";

async fn head(tx: &Transaction<'_>, session_id: &str) -> Result<Head, StoreError> {
    let row = q_opt(tx, HEAD, &[&session_id]).await?.ok_or_else(|| StoreError::NoSession(session_id.to_owned()))?;
    Ok((row.get(0), row.get(1)))
}

impl PostgresStore {
    /// The session's head for a write, with the fencing check
    /// ([`fence`](Self::fence): the same share lock on the lease row) in
    /// the head's statement — one round trip instead of two. It is the
    /// transaction's first statement, so a refused write stores nothing
    /// (what was pipelined after it is rolled back with it).
    async fn fenced_head(&self, tx: &Transaction<'_>, session_id: &str) -> Result<Head, StoreError> {
        self.head_held(tx, session_id, self.held_token(session_id)).await
    }

    /// [`fenced_head`](Self::fenced_head) with the token as read before,
    /// for a pipeline that prepared [`head_statement`] from that reading.
    async fn head_held(&self, tx: &Transaction<'_>, session_id: &str, held: Option<i64>) -> Result<Head, StoreError> {
        let Some(token) = held else { return head(tx, session_id).await };
        let row = q_opt(tx, FENCED_HEAD, &[&session_id, &self.owner])
            .await?
            .ok_or_else(|| StoreError::NoSession(session_id.to_owned()))?;
        super::claims::still_held(session_id, token, row.get(2))?;
        Ok((row.get(0), row.get(1)))
    }
}

/// The statement [`PostgresStore::head_held`] runs.
fn head_statement(held: Option<i64>) -> &'static str {
    if held.is_some() { FENCED_HEAD } else { HEAD }
}

const INSERT_ENTRIES: &str = "INSERT INTO entries (id, session_id, parent_id, seq, kind, body, first_kept)
     SELECT id, $1, parent_id, seq, kind, body, first_kept
       FROM unnest($2::text[], $3::text[], $4::bigint[], $5::bigint[], $6::bytea[], $7::text[])
         AS u(id, parent_id, seq, kind, body, first_kept)";
const SET_HEAD: &str = "UPDATE sessions SET leaf_id = $2, next_seq = $3 WHERE session_id = $1";
const OPEN: &str = "INSERT INTO open_turns (session_id, turn_id, first_entry_id, anchor_id) VALUES ($1, $2, $3, $4)";
const SEEN_BY: &str = "INSERT INTO engine_sessions (session_id, engine_id) VALUES ($1, $2) ON CONFLICT DO NOTHING";
const TAKE_OPEN: &str = "DELETE FROM open_turns WHERE session_id = $1 RETURNING anchor_id";
const CLOSE: &str = "DELETE FROM open_turns WHERE session_id = $1 RETURNING first_entry_id";
const OPEN_OF: &str = "SELECT first_entry_id, anchor_id FROM open_turns WHERE session_id = $1";

/// The recursive walks from a session's leaf, for a test that checks
/// their plans (see the module's note on `LATERAL`).
pub const WALKS: [&str; 4] = [BRANCH, BRANCH_BACK_TO, BRANCH_SIZES, VISIBLE_TAIL];

/// The active branch from the leaf back (bodies).
const BRANCH: &str = "WITH RECURSIVE chain(id, parent_id, body, depth) AS (
         SELECT e.id, e.parent_id, e.body, 0 FROM sessions s JOIN entries e ON e.id = s.leaf_id
          WHERE s.session_id = $1
         UNION ALL
         SELECT e.id, e.parent_id, e.body, chain.depth + 1
           FROM chain, LATERAL (SELECT id, parent_id, body FROM entries WHERE id = chain.parent_id LIMIT 1) e
       ) SELECT body FROM chain ORDER BY depth DESC";
/// From the leaf back to `$2`, which ends the walk (`done`).
const BRANCH_BACK_TO: &str = "WITH RECURSIVE walk(id, parent_id, body, depth, done) AS (
         SELECT e.id, e.parent_id, e.body, 0, e.id = $2 FROM sessions s JOIN entries e ON e.id = s.leaf_id
          WHERE s.session_id = $1
         UNION ALL
         SELECT e.id, e.parent_id, e.body, w.depth + 1, e.id = $2
           FROM walk w, LATERAL (SELECT id, parent_id, body FROM entries WHERE id = w.parent_id LIMIT 1) e
          WHERE NOT w.done
       ) SELECT body, done FROM walk ORDER BY depth";
/// The active branch from the leaf back: ids and encoded sizes, not bodies.
const BRANCH_SIZES: &str = "WITH RECURSIVE chain(id, parent_id, size, depth) AS (
         SELECT e.id, e.parent_id, octet_length(e.body), 0 FROM sessions s JOIN entries e ON e.id = s.leaf_id
          WHERE s.session_id = $1
         UNION ALL
         SELECT e.id, e.parent_id, octet_length(e.body), chain.depth + 1
           FROM chain, LATERAL (SELECT id, parent_id, body FROM entries WHERE id = chain.parent_id LIMIT 1) e
       ) SELECT id, size FROM chain ORDER BY depth DESC";
/// The visible tail from the leaf back ([`PostgresStore::visible_tail`]).
const VISIBLE_TAIL: &str = "WITH RECURSIVE walk(id, parent_id, body, depth, target, done, hit) AS (
         SELECT e.id, e.parent_id, e.body, 0, e.first_kept,
                e.id = $2 OR COALESCE(e.first_kept = '', false), e.id = $2
           FROM sessions s JOIN entries e ON e.id = s.leaf_id WHERE s.session_id = $1
         UNION ALL
         SELECT e.id, e.parent_id, e.body, w.depth + 1, COALESCE(w.target, e.first_kept),
                CASE WHEN w.target IS NULL THEN e.id = $2 OR COALESCE(e.first_kept = '', false)
                     ELSE e.id = w.target END,
                w.target IS NULL AND e.id = $2
           FROM walk w, LATERAL (SELECT id, parent_id, body, first_kept FROM entries WHERE id = w.parent_id LIMIT 1) e
          WHERE NOT w.done
       ) SELECT CASE WHEN hit THEN NULL ELSE body END, hit FROM walk ORDER BY depth DESC";

/// Inserts `entries`, however many, in one statement.
async fn insert_entries(
    tx: &Transaction<'_>,
    session_id: &str,
    entries: &[pb::TranscriptEntry],
) -> Result<(), StoreError> {
    if entries.is_empty() {
        return Ok(());
    }
    fn first_kept(e: &pb::TranscriptEntry) -> Option<&str> {
        match &e.entry {
            Some(Entry::Compaction(c)) => Some(c.first_kept_entry_id.as_str()),
            _ => None,
        }
    }
    let ids: Vec<&str> = entries.iter().map(|e| e.id.as_str()).collect();
    let parents: Vec<Option<&str>> = entries.iter().map(|e| e.parent_id.as_deref()).collect();
    let seqs: Vec<i64> = entries.iter().map(|e| e.seq as i64).collect();
    let kinds: Vec<i64> = entries.iter().map(kind_of).collect();
    let bodies: Vec<Vec<u8>> = entries.iter().map(|e| e.encode_to_vec()).collect();
    let kept: Vec<Option<&str>> = entries.iter().map(first_kept).collect();
    exec(tx, INSERT_ENTRIES, &[&session_id, &ids, &parents, &seqs, &kinds, &bodies, &kept]).await?;
    Ok(())
}

async fn set_head(tx: &Transaction<'_>, session_id: &str, leaf: Option<&str>, next: i64) -> Result<(), StoreError> {
    exec(tx, SET_HEAD, &[&session_id, &leaf, &next]).await?;
    Ok(())
}

async fn append_in(
    tx: &Transaction<'_>,
    session_id: &str,
    entries: Vec<NewEntry>,
) -> Result<Vec<pb::TranscriptEntry>, StoreError> {
    let at = head(tx, session_id).await?;
    append_at(tx, session_id, at, entries).await
}

/// Appends after the head the transaction read: the entries and the new
/// head in one round trip.
async fn append_at(
    tx: &Transaction<'_>,
    session_id: &str,
    (leaf, seq): Head,
    entries: Vec<NewEntry>,
) -> Result<Vec<pb::TranscriptEntry>, StoreError> {
    let Placed { entries, leaf, next_seq } = place(entries, leaf, seq);
    prepare_pipeline(tx, [INSERT_ENTRIES, SET_HEAD]).await?;
    tokio::try_join!(
        biased;
        insert_entries(tx, session_id, &entries),
        set_head(tx, session_id, leaf.as_deref(), next_seq),
    )?;
    Ok(entries)
}

/// The active branch, oldest first (one recursive query).
async fn branch_of(c: &impl GenericClient, session_id: &str) -> Result<Vec<pb::TranscriptEntry>, StoreError> {
    // One statement from the session's leaf; an empty answer is an empty
    // session or none at all (told apart only then).
    let rows = q(c, BRANCH, &[&session_id]).await?;
    if rows.is_empty() && q_opt(c, "SELECT 1 FROM sessions WHERE session_id = $1", &[&session_id]).await?.is_none() {
        return Err(StoreError::NoSession(session_id.to_owned()));
    }
    rows.iter().map(|r| decode_entry(r.get(0))).collect()
}

/// The branch from the leaf back to (and including) `stop`, newest first;
/// `None` when `stop` is not on it.
async fn branch_back_to(
    tx: &Transaction<'_>,
    session_id: &str,
    stop: &str,
) -> Result<Option<Vec<pb::TranscriptEntry>>, StoreError> {
    // From the leaf back, stopping at `stop`: what is new, not the session's age.
    let rows = q(tx, BRANCH_BACK_TO, &[&session_id, &stop]).await?;
    if !rows.last().is_some_and(|r| r.get::<_, bool>(1)) {
        return Ok(None);
    }
    rows.iter().map(|r| decode_entry(r.get(0))).collect::<Result<Vec<_>, _>>().map(Some)
}

/// Ends the session's open turn, if any: its anchor (the entry a rewind
/// goes back to).
async fn take_open_turn(tx: &Transaction<'_>, session_id: &str) -> Result<Option<String>, StoreError> {
    let row = q_opt(tx, TAKE_OPEN, &[&session_id]).await?;
    Ok(row.map(|r| r.get(0)))
}

/// Rewinds the session's open turn, if any; whether the head moved.
async fn rewind_in(tx: &Transaction<'_>, session_id: &str) -> Result<bool, StoreError> {
    match take_open_turn(tx, session_id).await? {
        Some(anchor) => rewind_to(tx, session_id, &anchor).await,
        None => Ok(false),
    }
}

/// Rewinds a turn taken out of `open_turns` to its `anchor`; whether the
/// head moved.
async fn rewind_to(tx: &Transaction<'_>, session_id: &str, anchor: &str) -> Result<bool, StoreError> {
    let Some(tail) = branch_back_to(tx, session_id, anchor).await? else {
        tracing::warn!(session = session_id, anchor, "an open turn's anchor is not on the branch; not rewound");
        return Ok(false);
    };
    let Some(carried) = rewind_carries(tail) else { return Ok(false) };
    let (_, seq) = head(tx, session_id).await?;
    set_head(tx, session_id, Some(anchor), seq).await?;
    append_in(tx, session_id, carried).await?;
    Ok(true)
}

/// Queues a closed durable turn's commit: the messages from the turn's
/// `first` entry to the leaf, and the leaf as the terminal anchor.
async fn queue_commit(
    tx: &Transaction<'_>,
    session_id: &str,
    first: &str,
    draft: CommitDraft,
) -> Result<PendingCommit, StoreError> {
    let range = branch_back_to(tx, session_id, first)
        .await?
        .ok_or_else(|| StoreError::Backend(format!("the open turn's first entry {first} is not on the branch")))?;
    let engine = draft.engine_id.clone();
    let req = commit_request(draft, range);
    exec(tx,
        "INSERT INTO outbox (session_id, advancement_key, engine_id, payload, created_at_ms) VALUES ($1, $2, $3, $4, $5)",
        &[&session_id, &req.advancement_key, &engine, &req.encode_to_vec(), &now_ms()],
    )
    .await?;
    Ok(PendingCommit::queued(engine, req))
}

#[async_trait]
impl Transcript for PostgresStore {
    async fn append(&self, session_id: &str, entries: Vec<NewEntry>) -> Result<Vec<pb::TranscriptEntry>, StoreError> {
        let mut c = self.client().await?;
        let tx = c.transaction().await?;
        let at = self.fenced_head(&tx, session_id).await?;
        let out = append_at(&tx, session_id, at, entries).await?;
        self.commit(tx).await?;
        Ok(out)
    }

    async fn branch(&self, session_id: &str) -> Result<Vec<pb::TranscriptEntry>, StoreError> {
        let c = self.client().await?;
        branch_of(&c, session_id).await
    }

    async fn branch_page(&self, session_id: &str, page: PageRequest) -> Result<PageOutcome, StoreError> {
        let c = self.client().await?;
        // The walk reads ids and sizes, not bodies.
        let rows = q(&c, BRANCH_SIZES, &[&session_id]).await?;
        if rows.is_empty() && q_opt(&c, "SELECT 1 FROM sessions WHERE session_id = $1", &[&session_id]).await?.is_none()
        {
            return Err(StoreError::NoSession(session_id.to_owned()));
        }
        let chain: Vec<(String, usize)> =
            rows.iter().map(|r| (r.get(0), usize::try_from(r.get::<_, i32>(1)).unwrap_or(0))).collect();
        let (ids, more) = match plan_page(&chain, &page) {
            Ok(planned) => planned,
            Err(miss) => return Ok(miss),
        };
        let rows = q(&c, "SELECT id, body FROM entries WHERE id = ANY($1)", &[&ids]).await?;
        let bodies = rows.iter().map(|r| (r.get::<_, String>(0), r.get::<_, Vec<u8>>(1))).collect();
        Ok(PageOutcome::Page { entries: order_page(&ids, bodies)?, more })
    }

    async fn visible_tail(&self, session_id: &str) -> Result<Arc<Tail>, StoreError> {
        // From the leaf back to the latest compaction's first kept entry (or
        // to that compaction, when it keeps nothing), as SQLite walks it: a
        // cost bounded by the context window, not by the session's age. A
        // tail this gateway read before ends the walk where its leaf is met
        // with no newer summary on the way (`hit`): only what was appended
        // since, by any gateway, crosses the wire.
        let cached = tails::take(&self.tails, session_id);
        let cached_leaf = cached.as_ref().and_then(|t| t.entries.last()).map_or("", |e| e.id.as_str());
        let c = self.client().await?;
        let rows = q(&c, VISIBLE_TAIL, &[&session_id, &cached_leaf]).await?;
        if rows.is_empty() && q_opt(&c, "SELECT 1 FROM sessions WHERE session_id = $1", &[&session_id]).await?.is_none()
        {
            return Err(StoreError::NoSession(session_id.to_owned()));
        }
        drop(c);
        let hit = rows.first().is_some_and(|r| r.get::<_, bool>(1));
        let newer =
            rows.iter().skip(usize::from(hit)).map(|r| decode_entry(r.get(0))).collect::<Result<Vec<_>, _>>()?;
        Ok(tails::keep(&self.tails, session_id, cached.filter(|_| hit), newer))
    }

    async fn rewrite(
        &self,
        session_id: &str,
        replacements: Vec<(String, AgentMessage)>,
    ) -> Result<RewriteOutcome, StoreError> {
        let branch = self.branch(session_id).await?;
        let mut c = self.client().await?;
        let tx = c.transaction().await?;
        let (leaf, seq) = self.fenced_head(&tx, session_id).await?;
        let plan = match plan_rewrite(&branch, replacements, leaf.as_deref(), seq) {
            Ok(plan) => plan,
            Err(kept) => return Ok(kept),
        };
        let (leaf, next) = plan.leaf_and_next_seq(seq);
        let by_session = [&session_id as &(dyn ToSql + Sync)];
        prepare_pipeline(&tx, [INSERT_ENTRIES, SET_HEAD, OPEN_OF]).await?;
        let ((), (), open) = tokio::try_join!(
            biased;
            insert_entries(&tx, session_id, &plan.entries),
            set_head(&tx, session_id, leaf.as_deref(), next),
            q_opt(&tx, OPEN_OF, &by_session),
        )?;
        if let Some(r) = open {
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
        // The head, and a turn a crash left open (rewound first).
        let held = self.held_token(session_id);
        prepare_pipeline(&tx, [head_statement(held), TAKE_OPEN]).await?;
        let (mut at, left_open) =
            tokio::try_join!(biased; self.head_held(&tx, session_id, held), take_open_turn(&tx, session_id))?;
        if let Some(anchor) = left_open
            && rewind_to(&tx, session_id, &anchor).await?
        {
            at = head(&tx, session_id).await?;
        }
        let Placed { entries: out, leaf, next_seq } = place(entries, at.0, at.1);
        let (Some(first), Some(last)) = (out.first(), out.last()) else {
            return Err(StoreError::Backend("a turn is admitted with at least one entry".into()));
        };
        let seen = async {
            let Some(engine) = seen_by else { return Ok(0) };
            exec(&tx, SEEN_BY, &[&session_id, &engine]).await
        };
        let open_params = [&session_id as &(dyn ToSql + Sync), &turn_id, &first.id, &last.id];
        prepare_pipeline(&tx, [INSERT_ENTRIES, SET_HEAD, OPEN, SEEN_BY]).await?;
        tokio::try_join!(
            biased;
            insert_entries(&tx, session_id, &out),
            set_head(&tx, session_id, leaf.as_deref(), next_seq),
            exec(&tx, OPEN, &open_params),
            seen,
        )?;
        self.commit(tx).await?;
        Ok(out)
    }

    async fn close_turn(&self, session_id: &str, close: TurnClose) -> Result<Closed, StoreError> {
        let mut c = self.client().await?;
        let tx = c.transaction().await?;
        let at = self.fenced_head(&tx, session_id).await?;
        let closed = match close {
            TurnClose::Rewind => {
                rewind_in(&tx, session_id).await?;
                Closed::default()
            }
            TurnClose::Accept { entries, commit } => {
                let Placed { entries: out, leaf, next_seq } = place(entries, at.0, at.1);
                let by_session = [&session_id as &(dyn ToSql + Sync)];
                prepare_pipeline(&tx, [INSERT_ENTRIES, SET_HEAD, CLOSE]).await?;
                let ((), (), first) = tokio::try_join!(
                    biased;
                    insert_entries(&tx, session_id, &out),
                    set_head(&tx, session_id, leaf.as_deref(), next_seq),
                    q_opt(&tx, CLOSE, &by_session),
                )?;
                let queued = match commit {
                    None => None,
                    Some(draft) => {
                        let first = first.ok_or_else(|| {
                            StoreError::Backend("a commit is queued for a turn that is not open".into())
                        })?;
                        Some(queue_commit(&tx, session_id, first.get(0), draft).await?)
                    }
                };
                Closed { entries: out, queued }
            }
        };
        self.commit(tx).await?;
        Ok(closed)
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
        const BEFORE: &str = "SELECT epoch, fingerprint FROM projections WHERE session_id = $1 AND host_id = $2";
        let before = async { q_opt(&tx, BEFORE, &[&session_id, &host_id]).await };
        let before = self.fenced_write(&tx, session_id, [BEFORE], before).await?;
        let before = before.map(|r| (r.get::<_, String>(0), r.get::<_, String>(1)));
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
}

#[async_trait]
impl Cursors for PostgresStore {
    async fn cursor(&self, session_id: &str, engine_id: &str) -> Result<Option<pb::HistoryCursor>, StoreError> {
        let c = self.client().await?;
        let sql = "SELECT message_id, seq, message_count, tokens FROM cursors WHERE session_id = $1 AND engine_id = $2";
        let row = q_opt(&c, sql, &[&session_id, &engine_id]).await?;
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
        const FORGET: &str = "DELETE FROM cursors WHERE session_id = $1 AND engine_id = $2";
        const SET: &str = "INSERT INTO cursors (session_id, engine_id, message_id, seq, message_count, tokens)
                           VALUES ($1, $2, $3, $4, $5, $6)
                           ON CONFLICT (session_id, engine_id) DO UPDATE SET message_id = EXCLUDED.message_id,
                              seq = EXCLUDED.seq, message_count = EXCLUDED.message_count, tokens = EXCLUDED.tokens";
        let sql = if cursor.is_some() { SET } else { FORGET };
        let set = async {
            match cursor {
                None => exec(&tx, FORGET, &[&session_id, &engine_id]).await,
                Some(k) => {
                    exec(
                        &tx,
                        SET,
                        &[
                            &session_id,
                            &engine_id,
                            &k.message_id,
                            &(k.seq as i64),
                            &(k.message_count as i64),
                            &(k.tokens as i64),
                        ],
                    )
                    .await
                }
            }
        };
        self.fenced_write(&tx, session_id, [sql], set).await?;
        self.commit(tx).await
    }

    async fn branch_after(
        &self,
        session_id: &str,
        cursor: &pb::HistoryCursor,
    ) -> Result<Option<Vec<pb::TranscriptEntry>>, StoreError> {
        // A cursor is most often in the visible tail (the engine holds the
        // last turn), which the cache brings up to date reading only what
        // is new; the whole branch only when the walk leaves the tail.
        let tail = self.visible_tail(session_id).await?;
        let ends = tail.iter().enumerate().rev().find_map(|(i, e)| ends_walk_to(cursor, e).map(|on| (i, on)));
        if let Some((at, on_branch)) = ends {
            return Ok(on_branch.then(|| tail[at + 1..].to_vec()));
        }
        let mut walk = AfterCursor::new(cursor);
        for e in self.branch(session_id).await?.into_iter().rev() {
            if let ControlFlow::Break(after) = walk.take(e) {
                return Ok(after);
            }
        }
        Ok(walk.at_root())
    }

    async fn delta(&self, session_id: &str, engine_id: &str) -> Result<Option<Delta>, StoreError> {
        let Some(cursor) = self.cursor(session_id, engine_id).await? else { return Ok(None) };
        let after = self.branch_after(session_id, &cursor).await?;
        Ok(Some(Delta { cursor, after }))
    }
}
