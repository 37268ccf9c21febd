//! One store test suite, two backends: every case runs against SQLite in a
//! temporary directory and against a PostgreSQL server the test starts
//! (its own cluster, a fresh database per case). Then the cases only a
//! shared store has: session leases, fencing, abandoned turns.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use ctxgate::store::postgres::{PostgresStore, WALKS};
use ctxgate::store::{
    Claimed, Claims, CommitDraft, Cursors, Delta, NewEntry, Outbox, PageOutcome, PageRequest, Renewal, Session,
    Sessions, SqliteStore, Store, StoreError, Transcript, TurnClose,
};
use ctxgate_proto::pb::{
    self, AgentMessage, CompactionEntry, ContentPart, Role, content_part::Part, transcript_entry::Entry,
};
use ctxgate_tests::postgres::{Postgres, pg_options};

/// A case's store, and a way to count rows behind its back.
struct Fx {
    store: Arc<dyn Store>,
    backend: Backend,
}

enum Backend {
    Sqlite(tempfile::TempDir),
    Postgres { pg: Arc<Postgres>, db: String },
}

impl Fx {
    fn store(&self) -> &dyn Store {
        &*self.store
    }

    /// The session of key "k" (created).
    async fn session(&self) -> Session {
        self.store.session("main", "k", true).await.unwrap().unwrap()
    }

    /// Rows in `table`, read directly from the database.
    async fn count(&self, table: &str) -> i64 {
        let sql = format!("SELECT COUNT(*) FROM {table}");
        match &self.backend {
            Backend::Sqlite(dir) => {
                let c = rusqlite::Connection::open(dir.path().join(ctxgate::store::DB_FILE)).unwrap();
                c.query_row(&sql, [], |r| r.get(0)).unwrap()
            }
            Backend::Postgres { pg, db } => pg.count(db, &sql).await,
        }
    }
}

fn compaction(summary: &str, first_kept: &str) -> NewEntry {
    NewEntry {
        turn_id: "c".into(),
        entry: Entry::Compaction(CompactionEntry {
            summary: summary.into(),
            first_kept_entry_id: first_kept.into(),
            ..Default::default()
        }),
    }
}

fn user(text: &str) -> NewEntry {
    let m = AgentMessage {
        role: Role::User as i32,
        content: vec![ContentPart { part: Some(Part::Text(text.into())) }],
        ..Default::default()
    };
    NewEntry { turn_id: "t".into(), entry: Entry::Message(m) }
}

trait EntryMessage {
    fn entry_message(self) -> AgentMessage;
}

impl EntryMessage for NewEntry {
    fn entry_message(self) -> AgentMessage {
        match self.entry {
            Entry::Message(m) => m,
            Entry::Compaction(_) => panic!("not a message"),
        }
    }
}

/// Runs each case on a fresh store made by `$fresh` (an async closure
/// taking the case's name).
macro_rules! cases {
    ($fresh:expr) => {
        for (name, case) in CASES {
            eprintln!("case {name}");
            let fx = $fresh(name).await;
            case(&fx).await;
        }
    };
}

type Case = for<'a> fn(&'a Fx) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + 'a>>;

macro_rules! case_list {
    ($($name:ident),* $(,)?) => {
        const CASES: &[(&str, Case)] = &[$((stringify!($name), |fx| Box::pin($name(fx)))),*];
    };
}

case_list!(
    append_chains_entries_and_branch_reads_them_back_in_order,
    the_visible_tail_gives_the_same_visible_history_as_the_whole_branch,
    the_cached_tail_follows_appends_rewinds_rewrites_and_summaries,
    a_tail_read_past_many_abandoned_entries_is_the_branchs,
    a_rewrite_branches_keeps_the_old_branch_and_remaps_summaries,
    new_and_reset_start_fresh_sessions_and_delete_removes_all,
    refusals_back_off_drops_are_audited_and_deletes_leave_forgets,
    branch_after_reads_back_to_the_cursor_and_follows_rewrites,
    a_delta_is_the_cursor_and_the_branch_after_it_within_or_before_the_visible_tail,
    a_branch_is_read_a_page_at_a_time_within_its_caps,
    a_closed_turn_queues_its_commit_with_the_turn_messages_and_a_delivery_moves_the_cursor,
    subagents_projections_and_durable_engines_round_trip,
);

#[tokio::test]
async fn every_case_on_sqlite() {
    cases!(async |_: &str| {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path()).unwrap();
        Fx { store: Arc::new(store), backend: Backend::Sqlite(dir) }
    });
}

#[tokio::test]
async fn every_case_on_postgres() {
    let pg = Arc::new(Postgres::start(false).await);
    cases!(async |name: &str| {
        let url = pg.database(name).await;
        let store = PostgresStore::open(&url, &pg_options(4, None)).await.unwrap();
        Fx { store: Arc::new(store), backend: Backend::Postgres { pg: pg.clone(), db: name.to_owned() } }
    });
}

async fn a_closed_turn_queues_its_commit_with_the_turn_messages_and_a_delivery_moves_the_cursor(fx: &Fx) {
    let (store, s) = (fx.store(), fx.session().await);
    let id = s.session_id.clone();
    store.append(&id, vec![user("before")]).await.unwrap();
    let cursor = pb::HistoryCursor { message_id: "m0".into(), seq: 1, message_count: 1, tokens: 3 };
    store.set_cursor(&id, "e", Some(cursor.clone())).await.unwrap();
    assert_eq!(store.cursor(&id, "e").await.unwrap(), Some(cursor));
    let admitted = store.open_turn(&id, "t1", vec![user("question")], Some("e")).await.unwrap();
    store.append(&id, vec![user("tool")]).await.unwrap();
    let draft = CommitDraft {
        engine_id: "e".into(),
        request: pb::CommitTurnRequest { advancement_key: "t1".into(), ..Default::default() },
    };
    let closed = TurnClose::Accept { entries: vec![user("answer")], commit: Some(draft) };
    let closed = store.close_turn(&id, closed).await.unwrap();
    let reply = closed.entries;
    let pending = store.pending_commits(&id, "e").await.unwrap();
    assert_eq!(pending.len(), 1);
    // What the close says it queued is what the queue holds.
    let queued = closed.queued.expect("the close queued a commit");
    assert_eq!((queued.engine_id.as_str(), queued.attempts), ("e", 0));
    assert_eq!(queued.request, pending[0].request);
    let req = &pending[0].request;
    let texts: Vec<String> = req.messages.iter().map(ctxgate::provider::message_text).collect();
    assert_eq!(texts, ["question", "tool", "answer"], "the turn's messages, from admission to reply");
    assert_eq!(req.terminal.as_ref().map(|t| t.entry_id.as_str()), Some(reply[0].id.as_str()));
    assert_eq!(admitted[0].seq, 2);
    let advance = ctxgate::store::Advance {
        engine_id: "e".into(),
        last_message_id: reply[0].id.clone(),
        seq: reply[0].seq,
        messages: 3,
        tokens: 9,
    };
    store.complete_commit(&id, "t1", Some(advance.clone())).await.unwrap();
    assert!(store.pending_commits(&id, "e").await.unwrap().is_empty());
    let moved = store.cursor(&id, "e").await.unwrap().unwrap();
    assert_eq!(
        (moved.message_id.as_str(), moved.seq, moved.message_count, moved.tokens),
        (reply[0].id.as_str(), 4, 4, 12)
    );
    // A redelivery moves nothing back or forward.
    store.complete_commit(&id, "t1", Some(advance)).await.unwrap();
    assert_eq!(store.cursor(&id, "e").await.unwrap().unwrap().message_count, 4);
    assert_eq!(store.count_sessions().await.unwrap(), 1);
}

async fn subagents_projections_and_durable_engines_round_trip(fx: &Fx) {
    let (store, s) = (fx.store(), fx.session().await);
    let child = ctxgate::store::Subagent {
        agent_id: "main".into(),
        child_key: "child".into(),
        parent_key: "k".into(),
        rollback_token: Some("r".into()),
        expires_at_ms: Some(100),
    };
    store.add_subagent(child.clone()).await.unwrap();
    assert!(store.expired_subagents(99).await.unwrap().is_empty());
    assert_eq!(store.expired_subagents(100).await.unwrap(), std::slice::from_ref(&child));
    // A turn's start reads the session (creating it) and the key's subagent
    // standing together; the parent key is no subagent's.
    let started = store.turn_session("main", "child").await.unwrap();
    assert!(started.subagent && started.session.state == "active", "{started:?}");
    let again = store.turn_session("main", "child").await.unwrap();
    assert_eq!(again, started, "the second turn finds the session the first created");
    let parent = store.turn_session("main", "k").await.unwrap();
    assert_eq!((parent.session, parent.subagent), (s.clone(), false));
    assert_eq!(store.take_subagent("main", "child").await.unwrap(), Some(child));
    assert_eq!(store.take_subagent("main", "child").await.unwrap(), None);
    assert!(!store.turn_session("main", "child").await.unwrap().subagent, "the record is gone");

    assert!(store.record_projection(&s.session_id, "h", "e1", "f1").await.unwrap(), "first time: inject");
    assert!(!store.record_projection(&s.session_id, "h", "e1", "f1").await.unwrap(), "unchanged");
    assert!(store.record_projection(&s.session_id, "h", "e1", "f2").await.unwrap(), "changed");

    store.set_durable("e", true).await.unwrap();
    store.set_durable("e", true).await.unwrap();
    assert_eq!(store.durable_engines().await.unwrap(), ["e"]);
    store.set_durable("e", false).await.unwrap();
    assert!(store.durable_engines().await.unwrap().is_empty());
    store.note_engine_session(&s.session_id, "e").await.unwrap();
    store.note_engine_session(&s.session_id, "e").await.unwrap();
    assert_eq!(fx.count("engine_sessions").await, 1);
    assert!(store.archive_session("main", "k").await.unwrap());
    assert!(!store.archive_session("main", "k").await.unwrap());
    assert_eq!(store.session_ids("main", "k").await.unwrap(), std::slice::from_ref(&s.session_id));
}
async fn append_chains_entries_and_branch_reads_them_back_in_order(fx: &Fx) {
    let (store, s) = (fx.store(), fx.session().await);
    let a = store.append(&s.session_id, vec![user("one"), user("two")]).await.unwrap();
    assert_eq!(a[1].parent_id.as_deref(), Some(a[0].id.as_str()));
    let Some(Entry::Message(m)) = &a[0].entry else { panic!() };
    assert_eq!(m.id, a[0].id, "message id is the entry id");
    let c = compaction("s", &a[1].id);
    store.append(&s.session_id, vec![c]).await.unwrap();
    let b = store.branch(&s.session_id).await.unwrap();
    assert_eq!(b.iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 2, 3]);
    let stats = store.list_sessions(None, false, 0, 100).await.unwrap();
    assert_eq!((stats[0].entries, stats[0].compactions), (3, 1));
}

async fn a_branch_is_read_a_page_at_a_time_within_its_caps(fx: &Fx) {
    let (store, s) = (fx.store(), fx.session().await);
    let all = store.append(&s.session_id, (0..10).map(|i| user(&format!("m{i} {}", "x".repeat(1000)))).collect()).await;
    let ids: Vec<String> = all.unwrap().into_iter().map(|e| e.id).collect();
    let page = |after: Option<&str>, until: Option<&str>, limit, max_bytes| PageRequest {
        after: after.map(Into::into),
        until: until.map(Into::into),
        limit,
        max_bytes,
    };
    let read = async |p: PageRequest| match store.branch_page(&s.session_id, p).await.unwrap() {
        PageOutcome::Page { entries, more } => (entries.into_iter().map(|e| e.id).collect::<Vec<_>>(), more),
        other => panic!("{other:?}"),
    };
    // Through it all, three at a time.
    let (mut seen, mut after) = (Vec::new(), None::<String>);
    loop {
        let (got, more) = read(page(after.as_deref(), None, 3, usize::MAX)).await;
        assert!(got.len() <= 3);
        seen.extend(got);
        after = seen.last().cloned();
        if !more {
            break;
        }
    }
    assert_eq!(seen, ids, "every entry once, in order");
    // Up to a fence, and a byte cap that still makes progress.
    assert_eq!(read(page(None, Some(&ids[4]), 100, usize::MAX)).await, (ids[..4].to_vec(), false));
    let (one, more) = read(page(Some(&ids[1]), None, 100, 1)).await;
    assert_eq!((one, more), (vec![ids[2].clone()], true));
    let (two, _) = read(page(None, None, 100, 2_500)).await;
    assert_eq!(two.len(), 2, "~1.1 KB entries, 2.5 KB: two");
    let unknown = store.branch_page(&s.session_id, page(Some("nope"), None, 3, usize::MAX)).await.unwrap();
    assert_eq!(unknown, PageOutcome::UnknownAfter);
    let unknown = store.branch_page(&s.session_id, page(None, Some("nope"), 3, usize::MAX)).await.unwrap();
    assert_eq!(unknown, PageOutcome::UnknownUntil);
    assert!(matches!(
        store.branch_page("no-such-session", page(None, None, 3, 10)).await,
        Err(StoreError::NoSession(_))
    ));
}

async fn the_visible_tail_gives_the_same_visible_history_as_the_whole_branch(fx: &Fx) {
    let (store, s) = (fx.store(), fx.session().await);
    let check = |b: Vec<pb::TranscriptEntry>, t: std::sync::Arc<ctxgate::transcript::Tail>| {
        assert_eq!(ctxgate::transcript::visible(&b), ctxgate::transcript::visible(&t));
        assert!(t.len() <= b.len());
    };
    check(store.branch(&s.session_id).await.unwrap(), store.visible_tail(&s.session_id).await.unwrap());
    let mut ids = Vec::new();
    for round in 0..4 {
        let added = store.append(&s.session_id, (0..5).map(|i| user(&format!("{round}-{i}"))).collect()).await.unwrap();
        ids.extend(added.into_iter().map(|e| e.id));
        // Keep the last 3 messages, then once keep nothing at all.
        let first_kept = if round == 2 { String::new() } else { ids[ids.len() - 3].clone() };
        let c = compaction(&format!("s{round}"), &first_kept);
        store.append(&s.session_id, vec![c]).await.unwrap();
        store.append(&s.session_id, vec![user("after")]).await.unwrap();
        let (b, t) = (store.branch(&s.session_id).await.unwrap(), store.visible_tail(&s.session_id).await.unwrap());
        assert!(t.len() < 8, "the tail is bounded, not the whole branch ({} entries)", t.len());
        check(b, t);
    }
}

/// Aborted turns leave their entries in the tree, between the branch's:
/// a read that meets many of them (SQLite passes over them in its scan,
/// then gives the rest of the walk to lookups by id) reads the branch.
async fn a_tail_read_past_many_abandoned_entries_is_the_branchs(fx: &Fx) {
    let (store, s) = (fx.store(), fx.session().await);
    let id = s.session_id.clone();
    let same = async || {
        let (b, t) = (store.branch(&id).await.unwrap(), store.visible_tail(&id).await.unwrap());
        assert_eq!(ctxgate::transcript::visible(&b), ctxgate::transcript::visible(&t));
        assert_eq!(t.len(), b.len(), "no summary: the tail is the branch");
    };
    for i in 0..50 {
        store.open_turn(&id, &format!("t{i}"), vec![user(&format!("q{i}"))], None).await.unwrap();
        store.append(&id, (0..10).map(|k| user(&format!("dropped {i}.{k}"))).collect()).await.unwrap();
        store.close_turn(&id, TurnClose::Rewind).await.unwrap();
        if i == 10 {
            same().await;
        }
    }
    // Only the turns' questions are on the branch, 500 entries are not.
    assert_eq!(store.branch(&id).await.unwrap().len(), 50);
    same().await;
}

async fn the_cached_tail_follows_appends_rewinds_rewrites_and_summaries(fx: &Fx) {
    let (store, s) = (fx.store(), fx.session().await);
    let id = s.session_id.clone();
    let same = async |store: &dyn Store| {
        let (b, t) = (store.branch(&id).await.unwrap(), store.visible_tail(&id).await.unwrap());
        assert_eq!(ctxgate::transcript::visible(&b), ctxgate::transcript::visible(&t));
        t
    };
    let mut last = Vec::new();
    for i in 0..6 {
        let turn = format!("t{i}");
        let entries = vec![user(&format!("q{i}"))];
        last = store.open_turn(&id, &turn, entries, None).await.unwrap();
        same(store).await;
        if i % 3 == 2 {
            // An aborted turn: the leaf goes back behind the cached one.
            store.close_turn(&id, TurnClose::Rewind).await.unwrap();
        } else {
            let reply = vec![user(&format!("a{i}"))];
            store.close_turn(&id, TurnClose::Accept { entries: reply, commit: None }).await.unwrap();
        }
        same(store).await;
    }
    // A summary in the new part, then a rewrite of an old message.
    store.append(&id, vec![compaction("sum", &last[0].id)]).await.unwrap();
    let t = same(store).await;
    assert!(t.len() <= 3, "{t:?}");
    store.append(&id, vec![user("later")]).await.unwrap();
    same(store).await;
    let replacement = AgentMessage { id: last[0].id.clone(), ..user("rewritten").entry_message() };
    let r = store.rewrite(&id, vec![(last[0].id.clone(), replacement)]).await.unwrap();
    assert!(r.changed, "{r:?}");
    let t = same(store).await;
    assert!(
        t.iter()
            .any(|e| matches!(&e.entry, Some(Entry::Message(m)) if ctxgate::provider::message_text(m) == "rewritten"))
    );
}

async fn a_rewrite_branches_keeps_the_old_branch_and_remaps_summaries(fx: &Fx) {
    let (store, s) = (fx.store(), fx.session().await);
    let a = store.append(&s.session_id, vec![user("one"), user(&"big ".repeat(100)), user("three")]).await.unwrap();
    let c = compaction("s", &a[1].id);
    store.append(&s.session_id, vec![c]).await.unwrap();
    let old = store.branch(&s.session_id).await.unwrap();

    let Some(Entry::Message(mut small)) = a[1].entry.clone() else { panic!() };
    small.content = user("elided").entry_message().content;
    let out = store
        .rewrite(&s.session_id, vec![(a[1].id.clone(), small), (String::new(), AgentMessage::default())])
        .await
        .unwrap();
    assert!(out.changed && out.rewritten_entries == 1 && out.bytes_freed > 300, "{out:?}");

    let new = store.branch(&s.session_id).await.unwrap();
    assert_eq!(new[0].id, old[0].id, "the branch starts at the parent of the first replaced entry");
    assert_ne!(new[1].id, old[1].id);
    let Some(Entry::Message(m)) = &new[1].entry else { panic!() };
    assert_eq!(m.id, a[1].id, "message ids stay stable");
    assert_eq!(ctxgate::provider::message_text(m), "elided");
    let Some(Entry::Compaction(cmp)) = &new[3].entry else { panic!() };
    assert_eq!(cmp.first_kept_entry_id, new[1].id, "the summary points into the new branch");
    assert_eq!(ctxgate::transcript::visible(&new).messages.len(), 2);
    // The old branch is still stored; the same rewrite again changes nothing.
    let stats = store.list_sessions(None, false, 0, 100).await.unwrap();
    assert_eq!(stats[0].entries, 4 + 3);
    let Some(Entry::Message(again)) = new[1].entry.clone() else { panic!() };
    assert!(!store.rewrite(&s.session_id, vec![(a[1].id.clone(), again)]).await.unwrap().changed);
}

async fn new_and_reset_start_fresh_sessions_and_delete_removes_all(fx: &Fx) {
    let store = fx.store();
    assert!(store.session("main", "k", false).await.unwrap().is_none());
    let first = store.session("main", "k", true).await.unwrap().unwrap();
    let second = store.replace_session("main", "k", false).await.unwrap();
    let third = store.replace_session("main", "k", true).await.unwrap();
    assert_ne!(first.session_id, second.session_id);
    assert_eq!(store.session("main", "k", false).await.unwrap().unwrap(), third);
    let visible: Vec<_> =
        store.list_sessions(Some("main"), false, 0, 100).await.unwrap().into_iter().map(|s| s.session.state).collect();
    assert_eq!(visible, ["inactive", "active"]);
    assert_eq!(store.list_sessions(None, true, 0, 100).await.unwrap().len(), 3);
    assert_eq!(store.delete_sessions("main", "k").await.unwrap(), 3);
    assert!(matches!(store.append(&third.session_id, vec![user("x")]).await, Err(StoreError::NoSession(_))));
}

async fn refusals_back_off_drops_are_audited_and_deletes_leave_forgets(fx: &Fx) {
    let (store, s) = (fx.store(), fx.session().await);
    let id = s.session_id.clone();
    let draft = |key: &str| CommitDraft {
        engine_id: "e".into(),
        request: pb::CommitTurnRequest { advancement_key: key.into(), ..Default::default() },
    };
    for key in ["t1", "t2"] {
        store.open_turn(&id, key, vec![user(key)], Some("e")).await.unwrap();
        let accept = TurnClose::Accept { entries: vec![], commit: Some(draft(key)) };
        store.close_turn(&id, accept).await.unwrap();
    }
    assert_eq!(store.due_commits(0, &["e".to_owned()]).await.unwrap(), [(id.clone(), "e".to_owned())]);
    store.refuse_commit(&id, "t1", "poison", 5_000).await.unwrap();
    assert!(
        store.due_commits(4_999, &["e".to_owned()]).await.unwrap().is_empty(),
        "the oldest row waits out its backoff"
    );
    assert_eq!(store.due_commits(5_000, &["e".to_owned()]).await.unwrap().len(), 1);
    assert_eq!(store.outbox_counts().await.unwrap(), (2, 1));
    let rows = store.outbox_of_key("main", "k").await.unwrap();
    assert_eq!((rows[0].attempts, rows[0].last_error.as_deref()), (1, Some("poison")));
    // Failures (not refusals) are counted per row, in a row.
    assert_eq!(store.fail_commit(&id, "t2").await.unwrap(), 1);
    assert_eq!(store.fail_commit(&id, "t2").await.unwrap(), 2);
    assert_eq!(store.fail_commit(&id, "t1").await.unwrap(), 1, "each row its own count");
    assert_eq!(store.fail_commit(&id, "gone").await.unwrap(), 0, "no such row: nothing counted");
    assert_eq!(store.outbox_counts().await.unwrap(), (2, 1), "a failure alone blocks nothing");

    store.retry_outbox("main", "k").await.unwrap();
    assert_eq!(store.due_commits(0, &["e".to_owned()]).await.unwrap().len(), 1, "retry makes it due now");
    let dropped = store.drop_outbox("main", "k").await.unwrap();
    assert_eq!(dropped.len(), 2);
    assert_eq!(fx.count("outbox_drops").await, 2);
    assert_eq!(store.branch(&id).await.unwrap().len(), 2, "a drop leaves the transcript alone");

    store.delete_sessions("main", "k").await.unwrap();
    let forgets = store.pending_forgets(0, &["e".to_owned()]).await.unwrap();
    assert_eq!(forgets.len(), 1, "the engine that served the session is owed a forget");
    assert_eq!((forgets[0].session_id.as_str(), forgets[0].engine_id.as_str()), (id.as_str(), "e"));
    store.settle_forget(&id, "e", Some((10, "down"))).await.unwrap();
    assert!(store.pending_forgets(9, &["e".to_owned()]).await.unwrap().is_empty());
    store.settle_forget(&id, "e", None).await.unwrap();
    assert!(store.pending_forgets(i64::MAX, &["e".to_owned()]).await.unwrap().is_empty());

    // Owed forgets are listed, and dropped (audited) per engine.
    let s2 = store.session("main", "k2", true).await.unwrap().unwrap();
    store.note_engine_session(&s2.session_id, "gone").await.unwrap();
    store.delete_sessions("main", "k2").await.unwrap();
    store.settle_forget(&s2.session_id, "gone", Some((10, "unreachable"))).await.unwrap();
    let (owed, more) = store.list_forgets(10).await.unwrap();
    assert_eq!((owed.len(), more, owed[0].engine_id.as_str()), (1, 0, "gone"));
    assert_eq!(
        (owed[0].attempts, owed[0].last_error.as_deref(), owed[0].next_attempt_ms),
        (1, Some("unreachable"), 10)
    );
    assert_eq!(store.list_forgets(0).await.unwrap().1, 1, "the count beyond the limit");
    assert!(store.drop_forgets("other").await.unwrap().is_empty());
    assert_eq!(store.drop_forgets("gone").await.unwrap(), owed);
    assert!(store.list_forgets(10).await.unwrap().0.is_empty());
    let (drops, _) = store.list_drops(10).await.unwrap();
    assert_eq!(drops.len(), 3, "two commits and a forget: {drops:?}");
    assert!(drops.iter().any(|d| d.advancement_key.is_empty() && d.session_key == "k2" && d.engine_id == "gone"));
    assert_eq!((store.list_drops(1).await.unwrap().0.len(), store.list_drops(1).await.unwrap().1), (1, 2));
    // Pruned by age.
    assert_eq!(store.prune_drops(0).await.unwrap(), 0, "nothing older than the epoch");
    assert_eq!(store.prune_drops(i64::MAX).await.unwrap(), 3);
    assert!(store.list_drops(10).await.unwrap().0.is_empty());
}

async fn branch_after_reads_back_to_the_cursor_and_follows_rewrites(fx: &Fx) {
    let (store, s) = (fx.store(), fx.session().await);
    let id = s.session_id.clone();
    let a = store.append(&id, vec![user("one"), user("two"), user("three")]).await.unwrap();
    let at = |e: &pb::TranscriptEntry| pb::HistoryCursor {
        message_id: e.id.clone(),
        seq: e.seq,
        message_count: 0,
        tokens: 0,
    };
    let ids = |v: Vec<pb::TranscriptEntry>| v.into_iter().map(|e| e.id).collect::<Vec<_>>();
    let after = store.branch_after(&id, &at(&a[1])).await.unwrap().unwrap();
    assert_eq!(ids(after), [a[2].id.clone()]);
    assert_eq!(store.branch_after(&id, &pb::HistoryCursor::default()).await.unwrap().unwrap().len(), 3);
    let unknown = pb::HistoryCursor { message_id: "gone".into(), seq: 2, ..Default::default() };
    assert!(store.branch_after(&id, &unknown).await.unwrap().is_none(), "not on the branch");
    // A rewrite of "one" copies the branch under new ids; "two" keeps its message id.
    let Some(Entry::Message(mut small)) = a[0].entry.clone() else { unreachable!() };
    small.content = user("1").entry_message().content;
    assert!(store.rewrite(&id, vec![(a[0].id.clone(), small)]).await.unwrap().changed);
    let after = store.branch_after(&id, &at(&a[1])).await.unwrap().expect("followed through the copy");
    assert_eq!(after.len(), 1);
    assert!(matches!(&after[0].entry, Some(Entry::Message(m)) if m.id == a[2].id));
}

/// What a DELTA engine's turn reads: its cursor and what follows it, also
/// when the cursor is older than the visible tail (a compaction since).
async fn a_delta_is_the_cursor_and_the_branch_after_it_within_or_before_the_visible_tail(fx: &Fx) {
    let (store, s) = (fx.store(), fx.session().await);
    let id = s.session_id.clone();
    let a = store.append(&id, vec![user("one"), user("two"), user("three")]).await.unwrap();
    assert_eq!(store.delta(&id, "e").await.unwrap(), None, "no cursor, no delta");
    let at = |e: &pb::TranscriptEntry| pb::HistoryCursor {
        message_id: e.id.clone(),
        seq: e.seq,
        message_count: 1,
        tokens: 7,
    };
    let ids = |v: &[pb::TranscriptEntry]| v.iter().map(|e| e.id.clone()).collect::<Vec<_>>();
    store.set_cursor(&id, "e", Some(at(&a[1]))).await.unwrap();
    let delta = store.delta(&id, "e").await.unwrap().unwrap();
    assert_eq!((&delta.cursor, ids(delta.after.as_deref().unwrap())), (&at(&a[1]), vec![a[2].id.clone()]));
    let (cursor, messages) = delta.messages().expect("only messages follow");
    let Some(Entry::Message(three)) = a[2].entry.clone() else { unreachable!() };
    assert_eq!((cursor, messages), (at(&a[1]), vec![three]));
    // A compaction keeping "three" on: the visible tail starts there, and a
    // cursor at "one" is read back through the whole branch.
    let c = store.append(&id, vec![compaction("s", &a[2].id)]).await.unwrap();
    assert_eq!(store.visible_tail(&id).await.unwrap().len(), 2, "three and the summary");
    store.set_cursor(&id, "e", Some(at(&a[0]))).await.unwrap();
    let delta = store.delta(&id, "e").await.unwrap().unwrap();
    assert_eq!(ids(delta.after.as_deref().unwrap()), [a[1].id.clone(), a[2].id.clone(), c[0].id.clone()]);
    assert_eq!(delta.messages(), None, "a summary follows the cursor: what is visible changed");
    // A cursor whose message is gone from the branch.
    let gone = pb::HistoryCursor { message_id: "gone".into(), seq: a[1].seq, ..Default::default() };
    store.set_cursor(&id, "e", Some(gone.clone())).await.unwrap();
    assert_eq!(store.delta(&id, "e").await.unwrap(), Some(Delta { cursor: gone, after: None }));
    // Another engine's cursor is its own.
    assert_eq!(store.delta(&id, "other").await.unwrap(), None);
}

// --- what only a shared store has ---------------------------------------------

/// Short, but long enough that a loaded machine does not let a live lease
/// lapse between two statements of a test.
const TTL: Duration = Duration::from_millis(1500);

/// Two gateways' stores on one fresh database.
async fn two_gateways(pg: &Postgres, db: &str) -> (PostgresStore, PostgresStore) {
    let url = pg.database(db).await;
    (
        PostgresStore::open(&url, &pg_options(2, None)).await.unwrap(),
        PostgresStore::open(&url, &pg_options(2, None)).await.unwrap(),
    )
}

fn texts(branch: &[pb::TranscriptEntry]) -> Vec<String> {
    branch
        .iter()
        .map(|e| match &e.entry {
            Some(Entry::Message(m)) => ctxgate::provider::message_text(m),
            Some(Entry::Compaction(c)) => format!("[{}]", c.summary),
            None => String::new(),
        })
        .collect()
}

/// A gateway's cached tail stays true to what another gateway writes:
/// appends, an aborted turn, a summary, a rewrite, a delete.
#[tokio::test]
async fn a_cached_tail_follows_what_another_gateway_writes() {
    let pg = Postgres::start(false).await;
    let (a, b) = two_gateways(&pg, "tails").await;
    let id = a.session("main", "k", true).await.unwrap().unwrap().session_id;
    let same = async || {
        let (branch, tail) = (a.branch(&id).await.unwrap(), a.visible_tail(&id).await.unwrap());
        assert_eq!(ctxgate::transcript::visible(&branch), ctxgate::transcript::visible(&tail));
        tail
    };
    a.append(&id, vec![user("a0"), user("a1")]).await.unwrap();
    assert_eq!(same().await.len(), 2);
    let b0 = b.append(&id, vec![user("b0")]).await.unwrap();
    assert_eq!(texts(&same().await), ["a0", "a1", "b0"], "b's append is read by a");
    b.open_turn(&id, "t", vec![user("q")], None).await.unwrap();
    b.append(&id, vec![user("partial")]).await.unwrap();
    assert_eq!(texts(&same().await), ["a0", "a1", "b0", "q", "partial"]);
    b.close_turn(&id, TurnClose::Rewind).await.unwrap();
    assert_eq!(texts(&same().await), ["a0", "a1", "b0", "q"], "b's abort rewinds behind a's cached leaf");
    b.append(&id, vec![compaction("sum", &b0[0].id)]).await.unwrap();
    b.append(&id, vec![user("b1")]).await.unwrap();
    let tail = same().await;
    assert_eq!(texts(&tail), ["b0", "q", "[sum]", "b1"], "a summary b wrote bounds a's tail");
    b.append(&id, vec![compaction("all", ""), user("b2")]).await.unwrap();
    assert!(same().await.len() < tail.len() + 2, "a summary that keeps nothing shortens the tail");
    let b2 = b.branch(&id).await.unwrap().last().unwrap().clone();
    let replacement = AgentMessage { id: b2.id.clone(), ..user("rewritten").entry_message() };
    assert!(b.rewrite(&id, vec![(b2.id.clone(), replacement)]).await.unwrap().changed);
    assert!(texts(&same().await).contains(&"rewritten".to_owned()), "b's rewrite is read by a");
    b.delete_sessions("main", "k").await.unwrap();
    assert!(matches!(a.visible_tail(&id).await, Err(StoreError::NoSession(_))));
}

#[tokio::test]
async fn a_session_lease_excludes_other_gateways_and_fences_a_holder_that_lost_it() {
    let pg = Postgres::start(false).await;
    let (a, b) = two_gateways(&pg, "leases").await;
    // Created at once by both: one active session for the key.
    let (sa, sb) = tokio::join!(a.session("main", "k", true), b.session("main", "k", true));
    let (sa, sb) = (sa.unwrap().unwrap(), sb.unwrap().unwrap());
    assert_eq!(sa.session_id, sb.session_id);
    let id = sa.session_id;

    let Claimed::Held(held) = a.claim_session(&id, TTL, false).await.unwrap() else { panic!("free at first") };
    assert!(matches!(b.claim_session(&id, TTL, false).await.unwrap(), Claimed::Busy { .. }));
    a.append(&id, vec![user("a1")]).await.unwrap();
    // Busy policy interrupt: the holder hears it at its next renewal.
    assert_eq!(a.renew_claim(&held, TTL).await.unwrap(), Renewal::Held);
    assert!(matches!(b.claim_session(&id, TTL, true).await.unwrap(), Claimed::Busy { .. }));
    assert_eq!(a.renew_claim(&held, TTL).await.unwrap(), Renewal::Interrupted);

    // `a` stops renewing (paused, partitioned): the lease lapses, `b` takes over.
    tokio::time::sleep(TTL + Duration::from_millis(100)).await;
    let Claimed::Held(took) = b.claim_session(&id, TTL, false).await.unwrap() else { panic!("the lease lapsed") };
    assert!(took.token > held.token, "every claim gets a newer token");
    b.open_turn(&id, "tb", vec![user("b0")], None).await.unwrap();
    let cursor = pb::HistoryCursor { message_id: "m1".into(), seq: 1, message_count: 1, tokens: 1 };
    b.set_cursor(&id, "e", Some(cursor.clone())).await.unwrap();
    let stale = a.append(&id, vec![user("stale")]).await;
    assert!(matches!(stale, Err(StoreError::Fenced(_))), "{stale:?}");
    let stale = a.close_turn(&id, TurnClose::Accept { entries: vec![user("stale")], commit: None }).await;
    assert!(matches!(stale, Err(StoreError::Fenced(_))), "{stale:?}");
    // Every other write of the session, too.
    let fenced =
        |r: Result<(), StoreError>, what: &str| assert!(matches!(r, Err(StoreError::Fenced(_))), "{what}: {r:?}");
    fenced(a.open_turn(&id, "t9", vec![user("stale")], None).await.map(drop), "open_turn");
    fenced(a.rewrite(&id, vec![("x".into(), user("y").entry_message())]).await.map(drop), "rewrite");
    fenced(a.set_cursor(&id, "e", None).await, "set_cursor");
    fenced(a.complete_commit(&id, "t1", None).await, "complete_commit");
    fenced(a.refuse_commit(&id, "t1", "no", 0).await, "refuse_commit");
    fenced(a.fail_commit(&id, "t1").await.map(drop), "fail_commit");
    fenced(a.record_projection(&id, "h", "e", "f").await.map(drop), "record_projection");
    fenced(a.delete_sessions("main", "k").await.map(drop), "delete_sessions");
    assert_eq!(a.renew_claim(&held, TTL).await.unwrap(), Renewal::Lost);
    // What a refused write had sent after its fenced statement (the stale
    // open_turn's end of the turn left open) went back with it.
    let open = "SELECT COUNT(*) FROM open_turns WHERE turn_id = 'tb'";
    assert_eq!(pg.count("leases", open).await, 1, "b's turn is still open");
    assert_eq!(b.cursor(&id, "e").await.unwrap(), Some(cursor), "the stale set_cursor went back");
    b.close_turn(&id, TurnClose::Accept { entries: vec![user("b1")], commit: None }).await.unwrap();
    assert_eq!(texts(&b.branch(&id).await.unwrap()), ["a1", "b0", "b1"], "nothing of the stale writes landed");

    // The stale release changes nothing; a real one frees the session at once.
    a.release_claim(&held).await.unwrap();
    assert!(matches!(a.claim_session(&id, TTL, false).await.unwrap(), Claimed::Busy { .. }));
    b.release_claim(&took).await.unwrap();
    let Claimed::Held(again) = a.claim_session(&id, TTL, false).await.unwrap() else { panic!("released") };
    a.append(&id, vec![user("a2")]).await.unwrap();
    a.release_claim(&again).await.unwrap();
}

/// Claims are committed without waiting for the WAL flush: one the
/// server lost in a crash hands its token out again. The gateway that
/// thinks it holds the session must then write nothing under the new
/// holder's lease, renew it or release it.
#[tokio::test]
async fn a_claim_lost_in_a_crash_fences_its_holder_though_its_token_comes_again() {
    let pg = Postgres::start(false).await;
    let (a, b) = two_gateways(&pg, "lost_claim").await;
    let id = a.session("main", "k", true).await.unwrap().unwrap().session_id;
    let Claimed::Held(held) = a.claim_session(&id, TTL, false).await.unwrap() else { panic!("free at first") };
    // What the server holds after losing the claim: the lease as it was.
    let sql = format!("UPDATE session_leases SET owner = NULL, token = token - 1 WHERE session_id = '{id}'");
    pg.sql("lost_claim", &sql).await;
    let Claimed::Held(took) = b.claim_session(&id, TTL, false).await.unwrap() else { panic!("free again") };
    assert_eq!(took.token, held.token, "the same token, handed out again");
    let stale = a.append(&id, vec![user("stale")]).await;
    assert!(matches!(stale, Err(StoreError::Fenced(_))), "{stale:?}");
    let stale = a.open_turn(&id, "t", vec![user("stale")], None).await;
    assert!(matches!(stale, Err(StoreError::Fenced(_))), "{stale:?}");
    assert_eq!(a.renew_claim(&held, TTL).await.unwrap(), Renewal::Lost);
    a.release_claim(&held).await.unwrap();
    assert!(matches!(a.claim_session(&id, TTL, false).await.unwrap(), Claimed::Busy { .. }), "b's lease stands");
    b.append(&id, vec![user("b")]).await.unwrap();
    assert_eq!(texts(&b.branch(&id).await.unwrap()), ["b"]);
}

#[tokio::test]
async fn a_turn_left_open_by_a_dead_gateway_is_rewound_once_its_lease_lapses() {
    let pg = Postgres::start(false).await;
    let (a, b) = two_gateways(&pg, "abandoned").await;
    let id = a.session("main", "k", true).await.unwrap().unwrap().session_id;
    a.append(&id, vec![user("before")]).await.unwrap();
    let Claimed::Held(_) = a.claim_session(&id, TTL, false).await.unwrap() else { panic!() };
    let admitted = a.open_turn(&id, "t1", vec![user("question")], None).await.unwrap();
    a.append(&id, vec![NewEntry { turn_id: "t1".into(), entry: user("tool traffic").entry }]).await.unwrap();
    a.append(&id, vec![compaction("summary", &admitted[0].id)]).await.unwrap();
    drop(a); // dies holding the lease

    assert!(b.abandoned_turns().await.unwrap().is_empty(), "the lease is still live");
    assert!(matches!(b.claim_session(&id, TTL, false).await.unwrap(), Claimed::Busy { .. }));
    tokio::time::sleep(TTL + Duration::from_millis(100)).await;
    assert_eq!(b.abandoned_turns().await.unwrap(), std::slice::from_ref(&id));
    let Claimed::Held(claim) = b.claim_session(&id, TTL, false).await.unwrap() else { panic!("lapsed") };
    // As an abort: the turn's message leaves the branch, its summary stays.
    assert_eq!(texts(&b.branch(&id).await.unwrap()), ["before", "question", "[summary]"]);
    assert_eq!(pg.count("abandoned", "SELECT COUNT(*) FROM entries").await, 5, "nothing left the tree");
    assert!(b.abandoned_turns().await.unwrap().is_empty());
    b.release_claim(&claim).await.unwrap();
}

/// A connection keeps a statement's generic plan, made when `entries` was
/// small on a fresh database. Written as a join, a walk's step was then a
/// hash of its one row and a scan of the whole table at every step (half
/// the throughput in a benchmark) at 700 rows analyzed and more; a step
/// must look its parent up by the key once the table is past a few pages.
#[tokio::test]
async fn every_walk_from_a_leaf_looks_parents_up_by_key_under_a_plan_made_on_a_small_table() {
    let pg = Postgres::start(false).await;
    let url = pg.database("plans").await;
    drop(PostgresStore::open(&url, &pg_options(1, None)).await.unwrap());
    // Sessions `from..=to` of 70 entries each, in one chain.
    let sessions = |from: u32, to: u32| {
        format!(
            "INSERT INTO sessions (session_id, agent_id, session_key, state, created_at_ms, leaf_id)
               SELECT 's' || s, 'main', 'k' || s, 'active', 0, 's' || s || '-70' FROM generate_series({from}, {to}) s;
             INSERT INTO entries (id, session_id, parent_id, seq, kind, body)
               SELECT 's' || s || '-' || i, 's' || s, CASE WHEN i > 1 THEN 's' || s || '-' || (i - 1) END, i, 1, '\\x00'
                 FROM generate_series({from}, {to}) s, generate_series(1, 70) i;"
        )
    };
    pg.sql("plans", &format!("{} ANALYZE;", sessions(1, 10))).await;
    pg.sql("plans", &sessions(11, 20)).await;
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(conn);
    client.batch_execute("SET plan_cache_mode = force_generic_plan").await.unwrap();
    for (i, walk) in WALKS.iter().enumerate() {
        let params = client.prepare(walk).await.unwrap().params().len();
        client.batch_execute(&format!("PREPARE walk{i} AS {walk}")).await.unwrap();
        let explain = format!("EXPLAIN EXECUTE walk{i}({})", vec!["NULL"; params].join(", "));
        let plan: Vec<String> = client
            .simple_query(&explain)
            .await
            .unwrap()
            .iter()
            .filter_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
                _ => None,
            })
            .collect();
        let plan = plan.join("\n");
        assert!(plan.contains("Index Scan using entries_pkey"), "{walk}\n{plan}");
        assert!(!plan.contains("Seq Scan on entries") && !plan.contains("Hash Join"), "{walk}\n{plan}");
    }
}

#[tokio::test]
async fn a_database_with_a_newer_schema_is_refused_with_a_sentence() {
    let pg = Postgres::start(false).await;
    let url = pg.database("newer").await;
    drop(PostgresStore::open(&url, &pg_options(1, None)).await.unwrap());
    pg.sql("newer", "UPDATE ctxgate_schema SET version = 99").await;
    let Err(e) = PostgresStore::open(&url, &pg_options(1, None)).await else { panic!("a newer schema opens") };
    let e = e.to_string();
    assert!(e.contains("newer ctxgate") && e.contains("99"), "{e}");
    assert!(!e.contains("password"), "{e}");
}

#[tokio::test]
async fn tls_to_postgres_is_verified_and_a_wrong_ca_or_a_plaintext_server_is_a_sentence() {
    let pg = Postgres::start_tls().await;
    let url = pg.database("tls").await;
    let ca = pg.cert().unwrap().to_owned();
    let require = format!("{url}?sslmode=require");
    let store =
        PostgresStore::open(&require.replace("127.0.0.1", "localhost"), &pg_options(1, Some(&ca))).await.unwrap();
    store.session("main", "k", true).await.unwrap();
    let tls = pg
        .count(
            "tls",
            "SELECT COUNT(*) FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) WHERE s.ssl AND a.datname = 'tls'",
        )
        .await;
    assert!(tls >= 1, "the store's connection is TLS");
    drop(store);

    // The public roots do not know a self-signed server.
    let Err(e) = PostgresStore::open(&require, &pg_options(1, None)).await else {
        panic!("an unknown issuer was trusted")
    };
    assert!(e.to_string().contains("cannot connect to PostgreSQL") && e.to_string().contains("certificate"), "{e}");
    eprintln!("wrong CA: {e}");
    // Without sslmode=require: plaintext, as before.
    PostgresStore::open(&url, &pg_options(1, Some(&ca))).await.unwrap();
    let plain = Postgres::start(false).await;
    let url = plain.database("plain").await;
    let Err(e) = PostgresStore::open(&format!("{url}?sslmode=require"), &pg_options(1, Some(&ca))).await else {
        panic!("TLS required from a plaintext server")
    };
    assert!(e.to_string().contains("TLS"), "{e}");
    eprintln!("plaintext server: {e}");
    // A CA file that is not one.
    let Err(e) = PostgresStore::open(&require, &pg_options(1, Some(Path::new("/etc/hostname")))).await else {
        panic!()
    };
    assert!(e.to_string().contains("store.caFile"), "{e}");
}

#[tokio::test]
async fn outbox_passes_of_two_gateways_split_the_due_rows() {
    let pg = Postgres::start(false).await;
    let (a, b) = two_gateways(&pg, "passes").await;
    let engines = ["e".to_owned()];
    for key in ["k1", "k2"] {
        let id = a.session("main", key, true).await.unwrap().unwrap().session_id;
        a.open_turn(&id, key, vec![user(key)], Some("e")).await.unwrap();
        let draft = CommitDraft {
            engine_id: "e".into(),
            request: pb::CommitTurnRequest { advancement_key: key.into(), ..Default::default() },
        };
        a.close_turn(&id, TurnClose::Accept { entries: vec![], commit: Some(draft) }).await.unwrap();
    }
    assert_eq!(a.due_commits(0, &engines).await.unwrap().len(), 2);
    assert!(b.due_commits(0, &engines).await.unwrap().is_empty(), "the other gateway's pass has them");
    assert_eq!(a.due_commits(0, &engines).await.unwrap().len(), 2, "its own next pass takes them again");
}
