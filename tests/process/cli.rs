//! The `ctxgate` binary as a user runs it: serve, chat, compact, sessions,
//! status; clear errors for bad config and an unreachable gateway; and a
//! SIGKILL in the middle of turns and compactions that loses nothing.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::collections::HashSet;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ctxgate_proto::gateway::{self as api, gateway_client::GatewayClient, turn_event::Event};
use ctxgate_proto::pb::transcript_entry::Entry;
use ctxgate_tests::{EngineProcess, bin};
use tokio::process::Command;
use tokio_stream::StreamExt;

/// A config that compacts often: a small window and a short kept tail.
const SMALL_WINDOW: &str = "{
  models: { contextWindow: 3000, maxOutputTokens: 200 },
  agents: { defaults: { compaction: { keepRecentTokens: 300, reserveTokens: 300 } } },
}";

async fn serve(state: &Path, config: Option<&Path>) -> EngineProcess {
    let dir = state.to_str().unwrap();
    let mut args = vec!["serve", "--listen", "127.0.0.1:0", "--state-dir", dir];
    if let Some(c) = config {
        args.extend(["--config", c.to_str().unwrap()]);
    }
    EngineProcess::start(bin("ctxgate"), &args).await.expect("ctxgate serve starts")
}

async fn ctxgate(args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(bin("ctxgate")).args(args).output().await.unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn the_cli_chats_compacts_and_shows_sessions() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("ctxgate.json5");
    std::fs::write(&config, SMALL_WINDOW).unwrap();
    let gw = serve(&dir.path().join("state"), Some(&config)).await;
    let url = gw.endpoint.as_str();

    for i in 0..12 {
        let msg = format!("Message {i}: remember ticket OPS-{i}0 and keep it. {}", "words ".repeat(60));
        let (code, out, err) = ctxgate(&["chat", "--gateway", url, "--session", "demo", "-m", &msg]).await;
        assert_eq!(code, Some(0), "{err}");
        assert!(out.starts_with("(offline model)"), "{out}");
    }
    let (code, out, _) = ctxgate(&["compact", "--gateway", url, "--session", "demo"]).await;
    assert_eq!(code, Some(0));
    assert!(out.contains("compacted"), "{out}");

    let (code, out, _) = ctxgate(&["sessions", "show", "demo", "--gateway", url]).await;
    assert_eq!(code, Some(0));
    assert!(out.contains("── compaction summary"), "{out}");
    assert!(out.contains("## Exact identifiers") && out.contains("OPS-10"), "{out}");

    let (_, out, _) = ctxgate(&["sessions", "show", "demo", "--gateway", url, "--json"]).await;
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["entries"][0]["kind"], "compaction");
    assert_eq!(v["session"]["session_key"], "demo");

    let (_, out, _) = ctxgate(&["sessions", "ls", "--gateway", url, "--json"]).await;
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(v[0]["compactions"].as_u64().unwrap() >= 1);

    // Interactive chat reads lines from stdin and understands its commands.
    let mut child = Command::new(bin("ctxgate"))
        .args(["chat", "--gateway", url, "--session", "interactive"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use tokio::io::AsyncWriteExt;
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"first line\n/new\nsecond line\n/quit\n").await.unwrap();
    drop(stdin);
    let out = child.wait_with_output().await.unwrap();
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(stdout.matches("(offline model)").count(), 2, "{stdout}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("New session"), "/new was understood");
    let (_, out, _) = ctxgate(&["sessions", "show", "interactive", "--gateway", url, "--json"]).await;
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["entries"].as_array().unwrap().len(), 2, "/new started a fresh session: only the second exchange");

    let (_, out, _) = ctxgate(&["status", "--gateway", url, "--json"]).await;
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["selected_engine"], "legacy");
    assert_eq!(v["context_window"], 3000);
}

#[tokio::test]
async fn bad_config_and_an_unreachable_gateway_read_like_sentences() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.json5");
    std::fs::write(&bad, "{ agents: { defaults: { compaction: { timeoutSecs: 5 } } } }").unwrap();
    let (code, out, err) = ctxgate(&["serve", "--config", bad.to_str().unwrap(), "--listen", "127.0.0.1:0"]).await;
    assert_eq!(code, Some(1));
    assert!(out.is_empty(), "nothing was bound: {out}");
    assert!(err.contains("agents.defaults.compaction") && err.contains("timeoutSecs"), "{err}");

    let (code, _, err) = ctxgate(&["status", "--gateway", "http://127.0.0.1:1"]).await;
    assert_eq!(code, Some(1));
    assert!(err.contains("Cannot reach the gateway at http://127.0.0.1:1"), "{err}");
    let (code, _, err) = ctxgate(&["chat", "--gateway", "http://127.0.0.1:1", "-m", "hi"]).await;
    assert_eq!(code, Some(1));
    assert!(err.contains("ctxgate serve"), "{err}");
}

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

#[tokio::test]
async fn health_subcommands_exit_zero_when_serving_and_one_with_a_sentence_otherwise() {
    let dir = tempfile::tempdir().unwrap();
    let gw = serve(&dir.path().join("state"), None).await;
    let (code, out, err) = ctxgate(&["health", "--gateway", &gw.endpoint]).await;
    assert_eq!((code, out.trim()), (Some(0), "SERVING"), "{err}");
    let (code, _, err) = ctxgate(&["health", "--gateway", "http://127.0.0.1:1"]).await;
    assert_eq!(code, Some(1));
    assert!(err.contains("Cannot reach the gateway at http://127.0.0.1:1"), "{err}");

    let engine = ctxgate_tests::start_window(&dir.path().join("window"), &[]).await;
    let check = async |endpoint: &str| {
        let out = Command::new(bin("ctxgate-engine-window")).args(["health", "--endpoint", endpoint]).output().await;
        let out = out.unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, out, err) = check(&engine.endpoint).await;
    assert_eq!((code, out.trim()), (Some(0), "SERVING"), "{err}");
    let (code, _, err) = check("127.0.0.1:1").await;
    assert_eq!(code, Some(1));
    assert!(err.starts_with("ctxgate-engine-window: the engine at 127.0.0.1:1 cannot be checked"), "{err}");
}
