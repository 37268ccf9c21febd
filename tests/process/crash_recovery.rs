//! Crash recovery of the `ctxgate` binary: a SIGKILL in the middle of turns
//! and compactions loses no message a client was told was accepted, and a
//! harness turn cut by a SIGKILL is rewound (an abort's shape) when the
//! gateway restarts. The crash matrix (tests/crash_matrix/) does the same
//! at every stage of a durable turn, with the engine killed too.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ctxgate_proto::gateway::{self as api, gateway_client::GatewayClient, turn_event::Event};
use ctxgate_proto::pb::transcript_entry::Entry;
use tokio_stream::StreamExt;

use crate::cli::{SMALL_WINDOW, serve};

fn client(url: &str) -> GatewayClient<tonic::transport::Channel> {
    GatewayClient::new(tonic::transport::Endpoint::from_shared(url.to_owned()).unwrap().connect_lazy())
}

fn sref(key: &str) -> Option<api::SessionRef> {
    Some(api::SessionRef { agent_id: String::new(), session_key: key.into() })
}

/// What clients were told before the crash: entries that must survive.
#[derive(Default)]
struct Acknowledged {
    admitted: HashSet<String>,
    completed: HashSet<String>,
    compactions: HashSet<String>,
    /// Sessions with a completed turn (each exists on disk).
    sessions: HashSet<String>,
}

/// How long to wait before retrying a turn the gateway shed (a fresh
/// gateway admits only `minLimit` turns while it measures its baseline).
fn shed_pushback(s: &tonic::Status) -> Option<Duration> {
    (s.code() == tonic::Code::ResourceExhausted).then(|| {
        let ms = s.metadata().get("grpc-retry-pushback-ms").and_then(|v| v.to_str().ok()?.parse().ok());
        Duration::from_millis(ms.unwrap_or(100))
    })
}

/// Runs turns on `key` until the gateway dies, recording every entry id the
/// gateway acknowledged; a shed turn is retried after its pushback, as a
/// client must.
async fn churn(url: String, key: String, acked: Arc<Mutex<Acknowledged>>) {
    let mut c = client(&url);
    for i in 0.. {
        let req = api::RunTurnRequest {
            session: sref(&key),
            message: format!("{key} turn {i}: {}", "load ".repeat(80)),
            system_prompt: None,
            ..Default::default()
        };
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
    let config = dir.path().join("ctxgate.json5");
    std::fs::write(&config, SMALL_WINDOW).unwrap();
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
    let mut c = client(&gw.endpoint);
    let mut on_disk = HashSet::new();
    for key in &keys {
        let t = c
            .get_transcript(api::GetTranscriptRequest { session: sref(key), visible_only: false, ..Default::default() })
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
        c.get_transcript(api::GetTranscriptRequest { session: sref(key), visible_only: true, ..Default::default() })
            .await
            .unwrap();
        let req = api::RunTurnRequest {
            session: sref(key),
            message: "still there?".into(),
            system_prompt: None,
            ..Default::default()
        };
        let events: Vec<_> = c.run_turn(req).await.unwrap().into_inner().collect::<Result<_, _>>().await.unwrap();
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
    use ctxgate_tests::harness::{Drive, begin, client as harness_client, tool_call, tool_result};
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let gw = serve(&state, None).await;
    let hc = harness_client(&gw.endpoint);
    let mut d = Drive::open(&hc, begin("cut", "run the tools")).await.unwrap();
    d.context().await.unwrap();
    d.append(vec![tool_call("c1", "calculator", "{}")]).await.unwrap();
    d.append(vec![tool_result("c1", "calculator", "42")]).await.unwrap();
    // Acknowledged, durable — and the gateway dies before the turn ends.
    gw.signal_and_wait("KILL").await.unwrap();
    drop(d);

    let gw = serve(&state, None).await;
    let mut c = client(&gw.endpoint);
    let t = c
        .get_transcript(api::GetTranscriptRequest { session: sref("cut"), visible_only: false, ..Default::default() })
        .await
        .unwrap()
        .into_inner();
    let roles: Vec<Role> = t
        .entries
        .iter()
        .filter_map(
            |e| if let Some(Entry::Message(m)) = &e.entry { Some(Role::try_from(m.role).unwrap()) } else { None },
        )
        .collect();
    assert_eq!(roles, [Role::User], "the unfinished turn ends as an abort: its user message only");
    let req = api::RunTurnRequest {
        session: sref("cut"),
        message: "again".into(),
        system_prompt: None,
        ..Default::default()
    };
    let events: Vec<_> = c.run_turn(req).await.unwrap().into_inner().collect::<Result<_, _>>().await.unwrap();
    assert!(matches!(events.last().and_then(|e| e.event.as_ref()), Some(Event::Completed(_))));
}
