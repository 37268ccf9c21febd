//! The SQLite backend's own tests: group commit, a full disk mid-batch,
//! crash recovery of open turns, migration of an unversioned database.
//! (What every backend must do is in the workspace's `store_backends`.)

use super::*;
use ctxgate_proto::pb::{
    self, AgentMessage, CompactionEntry, ContentPart, Role, content_part::Part, transcript_entry::Entry,
};
use prost::Message as _;
use rusqlite::params;

use super::schema::{MIGRATIONS, SCHEMA_V1};
use crate::store::{NewEntry, Outbox, Session, Sessions, StoreError, Transcript, TurnClose};

/// A store in a temp dir with one session for key "k".
async fn fixture() -> (tempfile::TempDir, SqliteStore, Session) {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path()).unwrap();
    let s = store.session("main", "k", true).await.unwrap().unwrap();
    (dir, store, s)
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writes_share_a_commit_and_a_failing_one_fails_alone() {
    let (_dir, store, _) = fixture().await;
    let mut sessions = Vec::new();
    for i in 0..32 {
        sessions.push(store.session("main", &format!("k{i}"), true).await.unwrap().unwrap());
    }
    // A slow read holds the connection while every write queues.
    let (held_tx, held) = std::sync::mpsc::channel();
    let db = store.db.clone();
    let slow = async move {
        db.read(move |_| {
            held_tx.send(()).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(300));
            Ok(())
        })
        .await
    };
    let slow = tokio::spawn(slow);
    held.recv().unwrap();
    let before = store.commit_counts();
    let mut writes: Vec<_> = sessions
        .iter()
        .map(|s| {
            let (store, id) = (store.clone(), s.session_id.clone());
            tokio::spawn(async move { store.append(&id, vec![user("hi")]).await })
        })
        .collect();
    let doomed = store.clone();
    writes.push(tokio::spawn(async move { doomed.append("no-such-session", vec![user("lost")]).await }));
    slow.await.unwrap().unwrap();
    let mut results = Vec::new();
    for w in writes {
        results.push(w.await.unwrap());
    }
    let doomed = results.pop().unwrap();
    assert!(matches!(doomed, Err(StoreError::NoSession(_))), "{doomed:?}");
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    let after = store.commit_counts();
    assert_eq!(after.1 - before.1, 33, "every write ran in a batch");
    assert!(after.0 - before.0 <= 2, "33 writes queued behind one read took {} commits", after.0 - before.0);
    for s in &sessions {
        assert_eq!(store.branch(&s.session_id).await.unwrap().len(), 1, "each write committed");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_database_mid_batch_answers_each_write_as_it_landed() {
    let (_dir, store, _) = fixture().await;
    let mut ids = Vec::new();
    for i in 0..6 {
        ids.push(store.session("main", &format!("f{i}"), true).await.unwrap().unwrap().session_id);
    }
    // Room for a little more than what is there: the big writes fill it.
    let pages: i64 = store.db.read(|c| Ok(c.query_row("PRAGMA page_count", [], |r| r.get(0))?)).await.unwrap();
    store.db.read(move |c| Ok(c.pragma_update(None, "max_page_count", pages + 8)?)).await.unwrap();
    let (held_tx, held) = std::sync::mpsc::channel();
    let db = store.db.clone();
    let slow = tokio::spawn(async move {
        db.read(move |_| {
            held_tx.send(()).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(300));
            Ok(())
        })
        .await
    });
    held.recv().unwrap();
    let writes: Vec<_> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| {
            let (store, id) = (store.clone(), id.clone());
            // Every other write is far over the room left.
            let text = if i % 2 == 1 { "x".repeat(200_000) } else { "small".into() };
            tokio::spawn(async move { store.append(&id, vec![user(&text)]).await })
        })
        .collect();
    slow.await.unwrap().unwrap();
    let mut failed = 0;
    for (w, id) in writes.into_iter().zip(&ids) {
        let answer = w.await.unwrap();
        let stored = store.branch(id).await.unwrap().len();
        match answer {
            Ok(_) => assert_eq!(stored, 1, "answered Ok but not stored"),
            Err(e) => {
                failed += 1;
                assert!(matches!(e, StoreError::Full(_) | StoreError::Backend(_)), "{e:?}");
                assert_eq!(stored, 0, "answered {e} but stored");
            }
        }
    }
    assert!(failed >= 3, "the big writes fail ({failed} failed)");
}

#[tokio::test]
async fn a_turn_left_open_by_a_crash_is_rewound_at_open_and_keeps_its_compactions() {
    let (dir, store, s) = fixture().await;
    store.append(&s.session_id, vec![user("before")]).await.unwrap();
    let admitted = store.open_turn(&s.session_id, "t1", vec![user("question")], None).await.unwrap();
    let tool = NewEntry { turn_id: "t1".into(), entry: user("tool traffic").entry };
    store.append(&s.session_id, vec![tool]).await.unwrap();
    store.append(&s.session_id, vec![compaction("summary", &admitted[0].id)]).await.unwrap();
    drop(store);

    // The gateway died mid-turn: the next open rewinds it.
    let store = SqliteStore::open(dir.path()).unwrap();
    let branch = store.branch(&s.session_id).await.unwrap();
    let shape: Vec<String> = branch
        .iter()
        .map(|e| match &e.entry {
            Some(Entry::Message(m)) => crate::provider::message_text(m),
            Some(Entry::Compaction(c)) => format!("[{}]", c.summary),
            None => String::new(),
        })
        .collect();
    assert_eq!(shape, ["before", "question", "[summary]"], "the turn's message left, its summary stayed");
    // Nothing is lost: the rewound entry is still in the tree.
    let all: i64 = store.db.read(|c| Ok(c.query_row("SELECT COUNT(*) FROM entries", [], |r| r.get(0))?)).await.unwrap();
    assert_eq!(all, 5);
    // Closing an accepted turn moves nothing back.
    store.open_turn(&s.session_id, "t2", vec![user("next")], None).await.unwrap();
    let closed = TurnClose::Accept { entries: vec![user("reply")], commit: None };
    assert_eq!(store.close_turn(&s.session_id, closed).await.unwrap().entries.len(), 1);
    drop(store);
    let store = SqliteStore::open(dir.path()).unwrap();
    assert_eq!(store.branch(&s.session_id).await.unwrap().len(), 5);
}

#[tokio::test]
async fn a_database_from_before_versioning_is_migrated_and_keeps_its_queued_commits() {
    let dir = tempfile::tempdir().unwrap();
    {
        let c = Connection::open(dir.path().join(DB_FILE)).unwrap();
        c.execute_batch(SCHEMA_V1).unwrap();
        c.execute(
            "INSERT INTO sessions (session_id, agent_id, session_key, state, created_at_ms) VALUES ('s1', 'main', 'k', 'active', 1)",
            [],
        )
        .unwrap();
        let req = pb::CommitTurnRequest { advancement_key: "t1".into(), ..Default::default() };
        c.execute(
            "INSERT INTO outbox (session_id, advancement_key, engine_id, payload, created_at_ms) VALUES ('s1', 't1', 'e', ?1, 1)",
            [req.encode_to_vec()],
        )
        .unwrap();
    }
    let store = SqliteStore::open(dir.path()).unwrap();
    let pending = store.pending_commits("s1", "e").await.unwrap();
    assert_eq!(pending.len(), 1);
    assert_eq!((pending[0].attempts, pending[0].next_attempt_ms), (0, 0));
    let version: i64 = store.db.read(|c| Ok(c.pragma_query_value(None, "user_version", |r| r.get(0))?)).await.unwrap();
    assert_eq!(version, MIGRATIONS.len() as i64);
    drop(store);
    SqliteStore::open(dir.path()).expect("opening a current database again is a no-op");
}

/// A cached statement runs with new values without being planned again
/// (the query planner stability guarantee is on).
#[tokio::test]
async fn a_cached_statement_is_not_planned_again_for_each_binding() {
    let (_dir, store, s) = fixture().await;
    let other = store.session("main", "k2", true).await.unwrap().unwrap();
    store.append(&s.session_id, vec![user("a")]).await.unwrap();
    store.append(&other.session_id, vec![user("b")]).await.unwrap();
    let reprepared = store
        .db
        .read(move |c| {
            let sql = "SELECT COALESCE(MAX(seq), 0) FROM entries WHERE session_id = ?1";
            for id in [&s.session_id, &other.session_id, &s.session_id] {
                c.prepare_cached(sql)?.query_row([id], |r| r.get::<_, i64>(0))?;
            }
            Ok(c.prepare_cached(sql)?.get_status(rusqlite::StatementStatus::RePrepare))
        })
        .await
        .unwrap();
    assert_eq!(reprepared, 0);
}

/// A database of schema 5 (entries in rowid order) is rebuilt clustered by
/// session and seq: every branch reads back the same, appends go on, and
/// the table has no rowid any more.
#[tokio::test]
async fn entries_of_schema_5_are_clustered_by_session_and_read_the_same() {
    type Row = (String, i64, String, Option<String>, i64, Vec<u8>);
    // Two sessions' entries written interleaved, and one rewound branch.
    let (_dir, store, a) = fixture().await;
    let b = store.session("main", "k2", true).await.unwrap().unwrap();
    for i in 0..20 {
        store.append(&a.session_id, vec![user(&format!("a{i}"))]).await.unwrap();
        store.append(&b.session_id, vec![user(&format!("b{i}"))]).await.unwrap();
    }
    store.open_turn(&a.session_id, "t", vec![user("prompt")], None).await.unwrap();
    store.append(&a.session_id, vec![user("abandoned reply")]).await.unwrap();
    store.close_turn(&a.session_id, TurnClose::Rewind).await.unwrap();
    store.append(&a.session_id, vec![user("after the rewind")]).await.unwrap();
    let before = [store.branch(&a.session_id).await.unwrap(), store.branch(&b.session_id).await.unwrap()];
    let (sessions, rows) = store
        .db
        .read(|c| {
            let sessions: Vec<(String, String, Option<String>, i64)> = c
                .prepare("SELECT session_id, session_key, leaf_id, next_seq FROM sessions")?
                .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))?
                .collect::<Result<_, _>>()?;
            let rows: Vec<Row> = c
                .prepare("SELECT session_id, seq, id, parent_id, kind, body FROM entries ORDER BY id")?
                .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?)))?
                .collect::<Result<_, _>>()?;
            Ok((sessions, rows))
        })
        .await
        .unwrap();
    drop(store);

    let old = tempfile::tempdir().unwrap();
    {
        let mut c = Connection::open(old.path().join(DB_FILE)).unwrap();
        let tx = c.transaction().unwrap();
        for sql in &MIGRATIONS[..5] {
            tx.execute_batch(sql).unwrap();
        }
        tx.pragma_update(None, "user_version", 5).unwrap();
        for (id, key, leaf, next) in &sessions {
            tx.execute(
                "INSERT INTO sessions (session_id, agent_id, session_key, state, created_at_ms, leaf_id, next_seq)
                 VALUES (?1, 'main', ?2, 'active', 1, ?3, ?4)",
                params![id, key, leaf, next],
            )
            .unwrap();
        }
        for (session, seq, id, parent, kind, body) in &rows {
            tx.execute(
                "INSERT INTO entries (id, session_id, parent_id, seq, kind, body) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                params![id, session, parent, seq, kind, body],
            )
            .unwrap();
        }
        tx.commit().unwrap();
    }
    let store = SqliteStore::open(old.path()).unwrap();
    let after = [store.branch(&a.session_id).await.unwrap(), store.branch(&b.session_id).await.unwrap()];
    assert_eq!(after, before);
    let rows_of_a = rows.iter().filter(|r| r.0 == a.session_id).count();
    assert_eq!((rows_of_a, after[0].len()), (23, 22), "the rewound reply is off the branch");
    let tail = store.visible_tail(&b.session_id).await.unwrap();
    assert_eq!(tail.len(), 20);
    let appended = store.append(&b.session_id, vec![user("b20")]).await.unwrap();
    assert_eq!(appended[0].seq, 21);
    assert_eq!(store.branch(&b.session_id).await.unwrap().len(), 21);
    let (count, rowid) = store
        .db
        .read(|c| {
            let count: i64 = c.query_row("SELECT COUNT(*) FROM entries", [], |r| r.get(0))?;
            Ok((count, c.prepare("SELECT rowid FROM entries").map(|_| ()).is_err()))
        })
        .await
        .unwrap();
    assert_eq!(count, rows.len() as i64 + 1);
    assert!(rowid, "the rebuilt table is WITHOUT ROWID");
}
