//! SQLite: the transcript tree (appends, the active branch and its visible
//! tail, rewrites), turns (open, accepted with their queued commit, or
//! rewound; those a dead gateway left open are rewound at open) and DELTA
//! engines' cursors.

use std::ops::ControlFlow;
use std::sync::Arc;

use async_trait::async_trait;
use ctxgate_proto::pb::{self, AgentMessage, transcript_entry::Entry};
use prost::Message as _;
use rusqlite::{Connection, OptionalExtension, params};

use super::SqliteStore;
use crate::store::shared::{
    AfterCursor, Placed, commit_request, decode_entry, kind_of, now_ms, order_page, place, plan_page, plan_rewrite,
    rewind_carries,
};
use crate::store::tails;
use crate::store::{
    Closed, CommitDraft, Cursors, Delta, NewEntry, PageOutcome, PageRequest, PendingCommit, RewriteOutcome, StoreError,
    Transcript, TurnClose,
};
use crate::transcript::Tail;

/// Appends entries to the session's active branch inside `tx`.
fn append_in(
    tx: &Connection,
    session_id: &str,
    entries: Vec<NewEntry>,
) -> Result<Vec<pb::TranscriptEntry>, StoreError> {
    let (leaf, seq): (Option<String>, i64) = tx
        .prepare_cached("SELECT leaf_id, next_seq FROM sessions WHERE session_id = ?1")?
        .query_row([session_id], |r| Ok((r.get(0)?, r.get(1)?)))
        .optional()?
        .ok_or_else(|| StoreError::NoSession(session_id.to_owned()))?;
    let Placed { entries, leaf, next_seq } = place(entries, leaf, seq);
    for e in &entries {
        insert_entry(tx, session_id, e)?;
    }
    tx.prepare_cached("UPDATE sessions SET leaf_id = ?2, next_seq = ?3 WHERE session_id = ?1")?
        .execute(params![session_id, leaf, next_seq])?;
    Ok(entries)
}

fn insert_entry(tx: &Connection, session_id: &str, e: &pb::TranscriptEntry) -> Result<(), StoreError> {
    tx.prepare_cached(
        "INSERT INTO entries (id, session_id, parent_id, seq, kind, body) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
    )?
    .execute(params![e.id, session_id, e.parent_id, e.seq as i64, kind_of(e), e.encode_to_vec()])?;
    Ok(())
}

/// The stored entry `id`.
fn entry(stmt: &mut rusqlite::CachedStatement<'_>, id: &str) -> Result<pb::TranscriptEntry, StoreError> {
    let body: Vec<u8> = stmt.query_row([id], |r| r.get(0))?;
    decode_entry(&body)
}

/// The session's leaf (`None`: no entries yet); NoSession when there is no
/// such session.
fn leaf_of(c: &Connection, session_id: &str) -> Result<Option<String>, StoreError> {
    c.prepare_cached("SELECT leaf_id FROM sessions WHERE session_id = ?1")?
        .query_row([session_id], |r| r.get(0))
        .optional()?
        .ok_or_else(|| StoreError::NoSession(session_id.to_owned()))
}

/// The active branch from its leaf back to (and including) `stop`, newest
/// first; `None` when `stop` is not on it.
fn branch_back_to(
    tx: &Connection,
    session_id: &str,
    stop: &str,
) -> Result<Option<Vec<pb::TranscriptEntry>>, StoreError> {
    let mut stmt = tx.prepare_cached("SELECT body FROM entries WHERE id = ?1")?;
    let mut out = Vec::new();
    let mut next = leaf_of(tx, session_id)?;
    while let Some(id) = next {
        let e = entry(&mut stmt, &id)?;
        next = e.parent_id.clone();
        let done = e.id == stop;
        out.push(e);
        if done {
            return Ok(Some(out));
        }
    }
    Ok(None)
}

/// The walk from the leaf towards the root that reads a visible tail: it
/// stops once the latest compaction's first kept entry is in hand, or at
/// the cached tail's leaf when it meets it with no newer summary on the
/// way (the rest of the walk is that tail).
#[derive(Default)]
struct TailWalk {
    /// The entry the walk needs next (`None`: done).
    next: Option<String>,
    cached_leaf: Option<String>,
    stop_at: Option<String>,
    met_cached: bool,
    /// Newest first.
    out: Vec<pb::TranscriptEntry>,
}

impl TailWalk {
    /// The id of the entry the walk needs next.
    fn wants(&mut self) -> Option<&str> {
        let next = self.next.as_deref()?;
        if self.stop_at.is_none() && self.cached_leaf.as_deref() == Some(next) {
            self.met_cached = true;
            self.next = None;
        }
        self.next.as_deref()
    }

    /// Takes the entry [`wants`](Self::wants) named.
    fn take(&mut self, e: pb::TranscriptEntry) {
        let reached = self.stop_at.as_deref() == Some(e.id.as_str());
        if self.stop_at.is_none()
            && let Some(Entry::Compaction(cmp)) = &e.entry
        {
            self.stop_at = Some(cmp.first_kept_entry_id.clone());
        }
        let summary_keeps_nothing = self.stop_at.as_deref() == Some("");
        self.next = e.parent_id.clone().filter(|_| !reached && !summary_keeps_nothing);
        self.out.push(e);
    }
}

/// Rows an abandoned branch may put in the scan's way before it gives up,
/// beyond two per entry taken.
const OFF_BRANCH_ROWS: usize = 256;

/// Feeds `walk` from one scan of the session's entries, newest first: an
/// entry's parent was always written before it, so the branch comes in
/// order, read from the session's own pages (the table is clustered by
/// session and seq) instead of looked up by id (on a cache miss, a long
/// session's read was a lookup per entry). Rows of abandoned branches (rewinds,
/// rewrites) are passed over without decoding; a session with many gives
/// the rest of the walk to lookups by id.
fn scan_branch(c: &Connection, session_id: &str, walk: &mut TailWalk) -> Result<(), StoreError> {
    // The leaf is the cached tail's (nothing appended since): no scan.
    if walk.wants().is_none() {
        return Ok(());
    }
    let mut stmt = c.prepare_cached("SELECT id, body FROM entries WHERE session_id = ?1 ORDER BY seq DESC")?;
    let mut rows = stmt.query([session_id])?;
    let (mut taken, mut passed) = (0, 0);
    while let Some(row) = rows.next()? {
        let Some(next) = walk.wants() else { break };
        if row.get_ref(0)?.as_str().map_err(rusqlite::Error::from)? != next {
            passed += 1;
            if passed > OFF_BRANCH_ROWS + 2 * taken {
                break;
            }
            continue;
        }
        walk.take(decode_entry(row.get_ref(1)?.as_blob().map_err(rusqlite::Error::from)?)?);
        taken += 1;
    }
    Ok(())
}

/// Queues a closed durable turn's commit: the messages from the first
/// admitted entry to the leaf, and the leaf as the terminal anchor.
fn queue_commit_in(tx: &Connection, session_id: &str, draft: CommitDraft) -> Result<PendingCommit, StoreError> {
    let first: String = tx
        .prepare_cached("SELECT first_entry_id FROM open_turns WHERE session_id = ?1")?
        .query_row([session_id], |r| r.get(0))?;
    let range = branch_back_to(tx, session_id, &first)?
        .ok_or_else(|| StoreError::Backend(format!("the open turn's first entry {first} is not on the branch")))?;
    let engine = draft.engine_id.clone();
    let req = commit_request(draft, range);
    tx.prepare_cached("INSERT INTO outbox (session_id, advancement_key, engine_id, payload, created_at_ms) VALUES (?1, ?2, ?3, ?4, ?5)")?.execute(params![session_id, req.advancement_key, engine, req.encode_to_vec(), now_ms()])?;
    Ok(PendingCommit::queued(engine, req))
}

/// Rewinds the session's open turn (if any): the leaf goes back to the
/// turn's anchor (its last admitted entry). Compaction entries made during
/// the turn are copied onto the anchor unless they keep from a message the
/// rewind drops; everything stays in the tree.
fn rewind_in(tx: &Connection, session_id: &str) -> Result<(), StoreError> {
    let anchor: Option<String> = tx
        .prepare_cached("SELECT anchor_id FROM open_turns WHERE session_id = ?1")?
        .query_row([session_id], |r| r.get(0))
        .optional()?;
    tx.prepare_cached("DELETE FROM open_turns WHERE session_id = ?1")?.execute([session_id])?;
    let Some(anchor) = anchor else { return Ok(()) };
    let Some(tail) = branch_back_to(tx, session_id, &anchor)? else {
        // Rewrites follow the anchor; a branch without it was changed by hand.
        tracing::warn!(session = session_id, anchor, "an open turn's anchor is not on the branch; not rewound");
        return Ok(());
    };
    let Some(carried) = rewind_carries(tail) else { return Ok(()) };
    tx.prepare_cached("UPDATE sessions SET leaf_id = ?2 WHERE session_id = ?1")?
        .execute(params![session_id, anchor])?;
    append_in(tx, session_id, carried)?;
    Ok(())
}

/// Turns left open by a gateway that died end as aborted ones do.
pub(super) fn recover_open_turns(conn: &mut Connection) -> Result<(), StoreError> {
    let tx = conn.transaction()?;
    let open: Vec<String> = {
        let mut stmt = tx.prepare("SELECT session_id FROM open_turns")?;
        stmt.query_map([], |r| r.get(0))?.collect::<rusqlite::Result<_>>()?
    };
    for session_id in &open {
        rewind_in(&tx, session_id)?;
    }
    tx.commit()?;
    if !open.is_empty() {
        tracing::info!(turns = open.len(), "turns left open by the last run were rewound");
    }
    Ok(())
}

#[async_trait]
impl Transcript for SqliteStore {
    async fn append(&self, session_id: &str, entries: Vec<NewEntry>) -> Result<Vec<pb::TranscriptEntry>, StoreError> {
        let session_id = session_id.to_owned();
        self.db
            .write(move |tx| {
                let out = append_in(tx, &session_id, entries)?;
                Ok(out)
            })
            .await
    }

    async fn branch(&self, session_id: &str) -> Result<Vec<pb::TranscriptEntry>, StoreError> {
        let session_id = session_id.to_owned();
        self.db
            .read(move |c| {
                let Some(leaf) = leaf_of(c, &session_id)? else { return Ok(Vec::new()) };
                let mut stmt = c.prepare_cached(
                    "WITH RECURSIVE chain(id, parent_id, body, depth) AS (
                   SELECT id, parent_id, body, 0 FROM entries WHERE id = ?1
                   UNION ALL
                   SELECT e.id, e.parent_id, e.body, chain.depth + 1 FROM entries e JOIN chain ON e.id = chain.parent_id
                 ) SELECT body FROM chain ORDER BY depth DESC",
                )?;
                let rows = stmt.query_map([leaf], |r| r.get::<_, Vec<u8>>(0))?;
                rows.map(|body| decode_entry(&body?)).collect()
            })
            .await
    }

    async fn branch_page(&self, session_id: &str, page: PageRequest) -> Result<PageOutcome, StoreError> {
        let session_id = session_id.to_owned();
        self.db
            .read(move |c| {
                // The walk reads ids and sizes, not bodies.
                let chain: Vec<(String, usize)> = match leaf_of(c, &session_id)? {
                    None => Vec::new(),
                    Some(leaf) => {
                        let mut stmt = c.prepare_cached(
                            "WITH RECURSIVE chain(id, parent_id, size, depth) AS (
                               SELECT id, parent_id, length(body), 0 FROM entries WHERE id = ?1
                               UNION ALL
                               SELECT e.id, e.parent_id, length(e.body), chain.depth + 1
                                 FROM entries e JOIN chain ON e.id = chain.parent_id
                             ) SELECT id, size FROM chain ORDER BY depth DESC",
                        )?;
                        let rows = stmt.query_map([leaf], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))?;
                        rows.map(|r| r.map(|(id, size)| (id, usize::try_from(size).unwrap_or(0))))
                            .collect::<Result<_, _>>()?
                    }
                };
                let (ids, more) = match plan_page(&chain, &page) {
                    Ok(planned) => planned,
                    Err(miss) => return Ok(miss),
                };
                let mut stmt = c.prepare_cached("SELECT body FROM entries WHERE id = ?1")?;
                let mut bodies = std::collections::HashMap::with_capacity(ids.len());
                for id in &ids {
                    bodies.insert(id.clone(), stmt.query_row([id], |r| r.get::<_, Vec<u8>>(0))?);
                }
                Ok(PageOutcome::Page { entries: order_page(&ids, bodies)?, more })
            })
            .await
    }

    async fn visible_tail(&self, session_id: &str) -> Result<Arc<Tail>, StoreError> {
        let session_id = session_id.to_owned();
        let tails = self.tails.clone();
        let cached = tails::take(&tails, &session_id);
        self.db
            .read(move |c| {
                let Some(leaf) = leaf_of(c, &session_id)? else { return Ok(Arc::default()) };
                let cached_leaf = cached.as_ref().and_then(|t| t.entries.last()).map(|l| l.id.clone());
                let mut walk = TailWalk { next: Some(leaf), cached_leaf, ..TailWalk::default() };
                scan_branch(c, &session_id, &mut walk)?;
                // What the scan left (a branch among many abandoned ones):
                // one entry at a time.
                let mut stmt = c.prepare_cached("SELECT body FROM entries WHERE id = ?1")?;
                while let Some(id) = walk.wants() {
                    let e = entry(&mut stmt, id)?;
                    walk.take(e);
                }
                let spliced = if walk.met_cached { cached } else { None };
                walk.out.reverse();
                Ok(tails::keep(&tails, &session_id, spliced, walk.out))
            })
            .await
    }

    async fn rewrite(
        &self,
        session_id: &str,
        replacements: Vec<(String, AgentMessage)>,
    ) -> Result<RewriteOutcome, StoreError> {
        let session_id = session_id.to_owned();
        let this = self.clone();
        let branch = self.branch(&session_id).await?;
        this.db
            .write(move |tx| {
                let (leaf, seq): (Option<String>, i64) = tx
                    .prepare_cached("SELECT leaf_id, next_seq FROM sessions WHERE session_id = ?1")?
                    .query_row([&session_id], |r| Ok((r.get(0)?, r.get(1)?)))?;
                let plan = match plan_rewrite(&branch, replacements, leaf.as_deref(), seq) {
                    Ok(plan) => plan,
                    Err(kept) => return Ok(kept),
                };
                for e in &plan.entries {
                    insert_entry(tx, &session_id, e)?;
                }
                let (leaf, next) = plan.leaf_and_next_seq(seq);
                tx.prepare_cached("UPDATE sessions SET leaf_id = ?2, next_seq = ?3 WHERE session_id = ?1")?
                    .execute(params![session_id, leaf, next])?;
                // An open turn's admitted entries were copied too: follow them.
                for column in ["first_entry_id", "anchor_id"] {
                    let old: Option<String> = tx
                        .query_row(
                            &format!("SELECT {column} FROM open_turns WHERE session_id = ?1"),
                            [&session_id],
                            |r| r.get(0),
                        )
                        .optional()?;
                    if let Some(new) = old.and_then(|o| plan.outcome.remap.get(&o)) {
                        tx.prepare_cached(&format!("UPDATE open_turns SET {column} = ?2 WHERE session_id = ?1"))?
                            .execute(params![session_id, new])?;
                    }
                }
                Ok(plan.outcome)
            })
            .await
    }

    async fn open_turn(
        &self,
        session_id: &str,
        turn_id: &str,
        entries: Vec<NewEntry>,
        seen_by: Option<&str>,
    ) -> Result<Vec<pb::TranscriptEntry>, StoreError> {
        let (session_id, turn_id) = (session_id.to_owned(), turn_id.to_owned());
        let seen_by = seen_by.map(str::to_owned);
        self.db
            .write(move |tx| {
                // A turn left open (its rewind failed) ends as an abort first.
                rewind_in(tx, &session_id)?;
                let out = append_in(tx, &session_id, entries)?;
                let (Some(first), Some(last)) = (out.first(), out.last()) else {
                    return Err(StoreError::Backend("a turn is admitted with at least one entry".into()));
                };
                tx.prepare_cached(
                    "INSERT INTO open_turns (session_id, turn_id, first_entry_id, anchor_id) VALUES (?1, ?2, ?3, ?4)",
                )?
                .execute(params![session_id, turn_id, first.id, last.id])?;
                if let Some(engine) = seen_by {
                    tx.prepare_cached("INSERT OR IGNORE INTO engine_sessions (session_id, engine_id) VALUES (?1, ?2)")?
                        .execute(params![session_id, engine])?;
                }
                Ok(out)
            })
            .await
    }

    async fn close_turn(&self, session_id: &str, close: TurnClose) -> Result<Closed, StoreError> {
        let session_id = session_id.to_owned();
        self.db
            .write(move |tx| match close {
                TurnClose::Rewind => {
                    rewind_in(tx, &session_id)?;
                    Ok(Closed::default())
                }
                TurnClose::Accept { entries, commit } => {
                    let entries = append_in(tx, &session_id, entries)?;
                    let queued = commit.map(|draft| queue_commit_in(tx, &session_id, draft)).transpose()?;
                    tx.prepare_cached("DELETE FROM open_turns WHERE session_id = ?1")?.execute([&session_id])?;
                    Ok(Closed { entries, queued })
                }
            })
            .await
    }

    async fn record_projection(
        &self,
        session_id: &str,
        host_id: &str,
        epoch: &str,
        fingerprint: &str,
    ) -> Result<bool, StoreError> {
        let (session_id, host_id, epoch, fingerprint) =
            (session_id.to_owned(), host_id.to_owned(), epoch.to_owned(), fingerprint.to_owned());
        self.db.write(move |tx| {
            let before: Option<(String, String)> = tx
                .query_row(
                    "SELECT epoch, fingerprint FROM projections WHERE session_id = ?1 AND host_id = ?2",
                    params![session_id, host_id],
                    |r| Ok((r.get(0)?, r.get(1)?)),
                )
                .optional()?;
            let changed = before.as_ref() != Some(&(epoch.clone(), fingerprint.clone()));
            if changed {
                tx.prepare_cached("INSERT OR REPLACE INTO projections (session_id, host_id, epoch, fingerprint) VALUES (?1, ?2, ?3, ?4)")?.execute(params![session_id, host_id, epoch, fingerprint])?;
            }
            Ok(changed)
        })
        .await
    }
}

#[async_trait]
impl Cursors for SqliteStore {
    async fn cursor(&self, session_id: &str, engine_id: &str) -> Result<Option<pb::HistoryCursor>, StoreError> {
        let (s, e) = (session_id.to_owned(), engine_id.to_owned());
        self.db.read(move |c| cursor_of(c, &s, &e)).await
    }

    async fn set_cursor(
        &self,
        session_id: &str,
        engine_id: &str,
        cursor: Option<pb::HistoryCursor>,
    ) -> Result<(), StoreError> {
        let (s, e) = (session_id.to_owned(), engine_id.to_owned());
        self.db.write(move |c| {
            match cursor {
                None => c.prepare_cached("DELETE FROM cursors WHERE session_id = ?1 AND engine_id = ?2")?.execute(params![s, e])?,
                Some(k) => c.prepare_cached("INSERT OR REPLACE INTO cursors (session_id, engine_id, message_id, seq, message_count, tokens)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6)")?.execute(params![s, e, k.message_id, k.seq as i64, k.message_count as i64, k.tokens as i64])?,
            };
            Ok(())
        })
        .await
    }

    async fn branch_after(
        &self,
        session_id: &str,
        cursor: &pb::HistoryCursor,
    ) -> Result<Option<Vec<pb::TranscriptEntry>>, StoreError> {
        let (session_id, cursor) = (session_id.to_owned(), cursor.clone());
        self.db.read(move |c| branch_after(c, &session_id, &cursor)).await
    }

    async fn delta(&self, session_id: &str, engine_id: &str) -> Result<Option<Delta>, StoreError> {
        let (s, e) = (session_id.to_owned(), engine_id.to_owned());
        self.db
            .read(move |c| {
                let Some(cursor) = cursor_of(c, &s, &e)? else { return Ok(None) };
                let after = branch_after(c, &s, &cursor)?;
                Ok(Some(Delta { cursor, after }))
            })
            .await
    }
}

fn cursor_of(c: &Connection, session_id: &str, engine_id: &str) -> Result<Option<pb::HistoryCursor>, StoreError> {
    let sql = "SELECT message_id, seq, message_count, tokens FROM cursors WHERE session_id = ?1 AND engine_id = ?2";
    Ok(c.prepare_cached(sql)?
        .query_row(params![session_id, engine_id], |r| {
            Ok(pb::HistoryCursor {
                message_id: r.get(0)?,
                seq: r.get::<_, i64>(1)? as u64,
                message_count: r.get::<_, i64>(2)? as u64,
                tokens: r.get::<_, i64>(3)? as u64,
            })
        })
        .optional()?)
}

/// Walked from the leaf back, one entry at a time: the cost is what
/// follows the cursor, not the session's age.
fn branch_after(
    c: &Connection,
    session_id: &str,
    cursor: &pb::HistoryCursor,
) -> Result<Option<Vec<pb::TranscriptEntry>>, StoreError> {
    let mut next = leaf_of(c, session_id)?;
    let mut stmt = c.prepare_cached("SELECT body FROM entries WHERE id = ?1")?;
    let mut walk = AfterCursor::new(cursor);
    while let Some(id) = next.take() {
        let e = entry(&mut stmt, &id)?;
        next = e.parent_id.clone();
        if let ControlFlow::Break(after) = walk.take(e) {
            return Ok(after);
        }
    }
    Ok(walk.at_root())
}
