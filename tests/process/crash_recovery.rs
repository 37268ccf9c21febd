//! Crash recovery of the `ctxgate` binary: a SIGKILL in the middle of turns
//! and compactions loses no message a client was told was accepted, and a
//! harness turn cut by a SIGKILL is rewound (an abort's shape) when the
//! gateway restarts. The crash matrix (tests/crash_matrix/) does the same
//! at every stage of a durable turn, with the engine killed too.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ctxgate_proto::gateway::{self as api, turn_event::Event};
use ctxgate_proto::pb::transcript_entry::Entry;
use ctxgate_tests::hosting::{message_roles, session, shed_pushback, transcript, turn_request};
use ctxgate_tests::{gateway_client, serve, write_file};
use tokio_stream::StreamExt;

use crate::cli::SMALL_WINDOW;

/// What clients were told before the crash: entries that must survive.
#[derive(Default)]
struct Acknowledged {
    admitted: HashSet<String>,
    completed: HashSet<String>,
    compactions: HashSet<String>,
    /// Sessions with a completed turn (each exists on disk).
    sessions: HashSet<String>,
}

/// Runs turns on `key` until the gateway dies, recording every entry id the
/// gateway acknowledged; a shed turn is retried after its pushback, as a
/// client must.
async fn churn(url: String, key: String, acked: Arc<Mutex<Acknowledged>>) {
    let mut c = gateway_client(&url);
    for i in 0.. {
        let req = turn_request(&key, format!("{key} turn {i}: {}", "load ".repeat(80)));
        let mut stream = match c.run_turn(req).await {
            Ok(resp) => resp.into_inner(),
            Err(s) => match shed_pushback(&s) {
                Some(wait) => {
                    tokio::time::sleep(wait).await;
                    continue;
                }
                None => return,
            },
        };
        while let Some(e) = stream.next().await {
            let e = match e {
                Ok(e) => e,
                Err(s) => match shed_pushback(&s) {
                    Some(wait) => {
                        tokio::time::sleep(wait).await;
                        break;
                    }
                    None => return,
                },
            };
            let mut a = acked.lock().unwrap();
            match e.event {
                Some(Event::Admitted(x)) => {
                    a.admitted.insert(x.entry_id);
                }
                Some(Event::Completed(x)) => {
                    a.completed.insert(x.entry_id);
                    a.sessions.insert(key.clone());
                }
                Some(Event::CompactionDone(d)) => {
                    a.compactions.extend(d.entry_id);
                }
                _ => {}
            }
        }
    }
}

#[tokio::test]
async fn sigkill_mid_turns_and_compactions_loses_no_accepted_message() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_file(dir.path(), "ctxgate.json5", SMALL_WINDOW);
    let state = dir.path().join("state");
    let acked = Arc::new(Mutex::new(Acknowledged::default()));
    let keys: Vec<String> = (0..6).map(|i| format!("crash-{i}")).collect();

    for round in 0..3 {
        let gw = serve(&state, Some(&config)).await;
        let workers: Vec<_> =
            keys.iter().map(|k| tokio::spawn(churn(gw.endpoint.clone(), k.clone(), acked.clone()))).collect();
        // Let turns and compactions pile up, then kill mid-flight.
        let target = (round + 1) * 60;
        // Every session has run (a shed worker waits out its pushback).
        let running = |a: &Acknowledged| a.completed.len() >= target && a.sessions.len() == keys.len();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
        while !running(&acked.lock().unwrap()) {
            assert!(tokio::time::Instant::now() < deadline, "round {round}: not every session ran within 120 s");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        gw.signal_and_wait("KILL").await.unwrap();
        for w in workers {
            w.await.unwrap();
        }
    }

    let gw = serve(&state, Some(&config)).await;
    let mut c = gateway_client(&gw.endpoint);
    let mut on_disk = HashSet::new();
    for key in &keys {
        let t = c
            .get_transcript(api::GetTranscriptRequest {
                session: session(key),
                visible_only: false,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        // One chain: seqs increase by one, each entry's parent is the previous.
        for (i, e) in t.entries.iter().enumerate() {
            assert_eq!(e.seq, i as u64 + 1, "{key}: seq gap at {i}");
            let parent = if i == 0 { None } else { Some(t.entries[i - 1].id.clone()) };
            assert_eq!(e.parent_id, parent, "{key}: broken chain at {i}");
            if let Some(Entry::Compaction(cmp)) = &e.entry {
                assert!(
                    t.entries[..i].iter().any(|p| p.id == cmp.first_kept_entry_id),
                    "{key}: summary keeps from a missing entry"
                );
            }
        }
        on_disk.extend(t.entries.into_iter().map(|e| e.id));
        // The visible history reads and the session takes new turns.
        c.get_transcript(api::GetTranscriptRequest { session: session(key), visible_only: true, ..Default::default() })
            .await
            .unwrap();
        let events: Vec<_> = c
            .run_turn(turn_request(key, "still there?"))
            .await
            .unwrap()
            .into_inner()
            .collect::<Result<_, _>>()
            .await
            .unwrap();
        assert!(matches!(events.last().and_then(|e| e.event.as_ref()), Some(Event::Completed(_))), "{key}");
    }
    let a = acked.lock().unwrap();
    assert!(!a.compactions.is_empty(), "compactions ran during the churn");
    for (what, ids) in [("admitted message", &a.admitted), ("reply", &a.completed), ("compaction", &a.compactions)] {
        let lost: Vec<_> = ids.difference(&on_disk).collect();
        assert!(lost.is_empty(), "{} acknowledged {what}s lost: {lost:?}", lost.len());
    }
    eprintln!(
        "{} admitted, {} completed, {} compactions survived 3 SIGKILLs",
        a.admitted.len(),
        a.completed.len(),
        a.compactions.len()
    );
}

#[tokio::test]
async fn a_harness_turn_cut_by_sigkill_is_rewound_when_the_gateway_restarts() {
    use ctxgate_proto::pb::Role;
    use ctxgate_tests::harness::open_tool_turn;
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let gw = serve(&state, None).await;
    let d = open_tool_turn(&gw.endpoint, "cut", "run the tools").await;
    // Acknowledged, durable — and the gateway dies before the turn ends.
    gw.signal_and_wait("KILL").await.unwrap();
    drop(d);

    let gw = serve(&state, None).await;
    let mut c = gateway_client(&gw.endpoint);
    let roles: Vec<Role> = message_roles(&transcript(&c, "cut").await);
    assert_eq!(roles, [Role::User], "the unfinished turn ends as an abort: its user message only");
    let events: Vec<_> =
        c.run_turn(turn_request("cut", "again")).await.unwrap().into_inner().collect::<Result<_, _>>().await.unwrap();
    assert!(matches!(events.last().and_then(|e| e.event.as_ref()), Some(Event::Completed(_))));
}
