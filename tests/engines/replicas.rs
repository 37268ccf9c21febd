//! One engine, several replicas (real engine processes on loopback, named
//! by a static `ipv4:` list or a `dns:///` name): a session stays on one
//! replica of an engine that keeps session state and moves, resynced, when
//! that replica dies; a stateless engine's calls spread over all; the
//! engine is out of service only when every replica is; a dying replica's
//! idempotent calls go to another, not to legacy; a subagent spawned on
//! the parent's replica and ended on all leaves nothing behind.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::path::Path;

use ctxgate_proto::gateway as api;
use ctxgate_tests::hosting::*;
use ctxgate_tests::{EngineProcess, TestGateway, bin, counter, metrics_text, start_window};

fn addr(e: &EngineProcess) -> String {
    e.endpoint.strip_prefix("http://").unwrap().to_owned()
}

async fn gateway(id: &str, endpoint: &str) -> TestGateway {
    let mut config = hosting(id, endpoint, &[]);
    config.gateway.metrics_listen = "127.0.0.1:0".into();
    TestGateway::start(config).await
}

/// A gateway with engine `id` at every address in `list` (`ipv4:`), once
/// all of them are in service.
async fn gateway_over(id: &str, list: &[String]) -> (TestGateway, api::EngineStatus) {
    let g = gateway(id, &format!("ipv4:{}", list.join(","))).await;
    let e = wait_engine(&g, id, "every replica in service", |e| {
        e.replicas.len() == list.len() && e.replicas.iter().all(in_service) && !e.name.is_empty()
    })
    .await;
    (g, e)
}

/// Three window engine replicas (each with its state dir) behind one
/// gateway, all in service.
async fn three_windows() -> (Vec<tempfile::TempDir>, Vec<EngineProcess>, TestGateway) {
    let dirs: Vec<tempfile::TempDir> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let mut engines = Vec::new();
    for d in &dirs {
        engines.push(start_window(d.path(), &[]).await);
    }
    let list: Vec<String> = engines.iter().map(addr).collect();
    let (g, _) = gateway_over("window", &list).await;
    (dirs, engines, g)
}

fn in_service(r: &api::ReplicaStatus) -> bool {
    r.quarantine.is_none() && r.health == "SERVING"
}

/// Runs a turn on `key` and checks it completed on the engine itself.
async fn served_by(g: &TestGateway, id: &str, key: &str, text: &str) {
    let events = run_turn(g, key, text).await;
    assert!(completed(&events), "{events:?}");
    let s = selected(&events);
    assert_eq!((s.engine_id.as_str(), s.warning.as_deref()), (id, None), "{events:?}");
}

fn calls_by_replica(e: &api::EngineStatus) -> Vec<(String, u64)> {
    e.replicas.iter().map(|r| (r.address.clone(), r.calls)).collect()
}

async fn restart_window(at: &str, dir: &Path) -> EngineProcess {
    let args = ["--listen", at, "--state-dir", dir.to_str().unwrap()];
    EngineProcess::start(bin("ctxgate-engine-window"), &args).await.unwrap()
}

#[tokio::test]
async fn a_session_stays_on_one_replica_and_moves_resynced_when_it_dies() {
    let (dirs, engines, g) = three_windows().await;
    let list: Vec<String> = engines.iter().map(addr).collect();
    let mut engines: Vec<Option<EngineProcess>> = engines.into_iter().map(Some).collect();
    let e = engine_status(&g, "window").await;
    assert_eq!(e.affinity, "session", "the window engine declares session affinity: {e:?}");

    for i in 0..4 {
        served_by(&g, "window", "s1", &format!("turn {i} of s1")).await;
    }
    let e = engine_status(&g, "window").await;
    let busy: Vec<_> = e.replicas.iter().filter(|r| r.calls > 0).collect();
    assert_eq!(busy.len(), 1, "one session, one replica: {:?}", calls_by_replica(&e));
    let owner = busy[0].address.clone();
    let owner_ix = list.iter().position(|a| *a == owner).unwrap();

    // Many sessions spread over every replica.
    for s in 0..40 {
        served_by(&g, "window", &format!("spread-{s}"), "hello").await;
    }
    let e = engine_status(&g, "window").await;
    assert!(e.replicas.iter().all(|r| r.calls > 0), "{:?}", calls_by_replica(&e));

    // The session's replica dies: its next turns run on another replica,
    // which does not hold the history and is resynced.
    engines[owner_ix].take().unwrap().signal_and_wait("KILL").await.unwrap();
    // Quarantined by the first failed call, and UNREACHABLE once its
    // health monitor has probed it since (a later, separate event: on a
    // loaded machine the turns below can all run before that probe).
    wait_engine(&g, "window", "the dead replica quarantined and unreachable", |e| {
        e.replicas.iter().any(|r| r.address == owner && r.quarantine.is_some() && r.health == "UNREACHABLE")
    })
    .await;
    let gaps_before = counter(
        &metrics_text(g.metrics.unwrap()).await,
        "ctxgate_engine_history_gaps_total",
        "engine=\"window\",method=\"Assemble\"",
    );
    let before = engine_status(&g, "window").await;
    for i in 4..7 {
        served_by(&g, "window", "s1", &format!("turn {i} of s1")).await;
    }
    let e = engine_status(&g, "window").await;
    assert!(e.quarantine.is_none() && e.health == "SERVING", "two replicas serve: {e:?}");
    let dead = e.replicas.iter().find(|r| r.address == owner).unwrap();
    assert!(dead.quarantine.is_some() && dead.health == "UNREACHABLE", "{dead:?}");
    let moved: Vec<_> = e
        .replicas
        .iter()
        .zip(&before.replicas)
        .filter(|(now, then)| now.calls > then.calls)
        .map(|(now, _)| now.address.clone())
        .collect();
    assert_eq!(moved.len(), 1, "the session moved to one replica: {:?}", calls_by_replica(&e));
    assert_ne!(moved[0], owner);
    let m = metrics_text(g.metrics.unwrap()).await;
    let gaps = counter(&m, "ctxgate_engine_history_gaps_total", "engine=\"window\",method=\"Assemble\"");
    assert_eq!(gaps, gaps_before + 1, "one gap, then resynced: {m}");
    assert!(
        m.contains(&format!("ctxgate_engine_replica_in_service{{engine=\"window\",replica=\"{owner}\"}} 0")),
        "{m}"
    );
    assert_eq!(messages(&g, "s1").await.len(), 14, "every message of s1 is in the transcript");

    // It comes back (its old state, now behind): re-admitted, and the
    // session returns to it, resynced again.
    engines[owner_ix] = Some(restart_window(&owner, dirs[owner_ix].path()).await);
    wait_engine(&g, "window", "the replica re-admitted", |e| {
        e.replicas.iter().find(|r| r.address == owner).is_some_and(in_service)
    })
    .await;
    served_by(&g, "window", "s1", "turn 7 of s1").await;
    let m = metrics_text(g.metrics.unwrap()).await;
    assert_eq!(counter(&m, "ctxgate_engine_history_gaps_total", "engine=\"window\",method=\"Assemble\""), gaps + 1);

    // s1 has been on two replicas: deleting it reaches every one.
    let before = engine_status(&g, "window").await;
    g.client.clone().delete_session(sref("s1")).await.unwrap();
    wait_engine(&g, "window", "told to forget s1 on every replica", |e| {
        e.replicas.iter().zip(&before.replicas).all(|(now, then)| now.calls > then.calls)
    })
    .await;
    let forgets = engine_status(&g, "window").await.methods.into_iter().find(|m| m.method == "ForgetSession");
    assert_eq!(forgets.map(|m| (m.calls, m.failures)), Some((3, 0)), "one ForgetSession per replica");

    // Every replica gone: the engine is out of service and legacy answers.
    served_by(&g, "window", "s2", "turn 0 of s2").await;
    for e in engines.iter_mut() {
        e.take().unwrap().signal_and_wait("KILL").await.unwrap();
    }
    wait_engine(&g, "window", "quarantined", |e| e.quarantine.is_some()).await;
    let events = run_turn(&g, "s2", "turn 1 of s2").await;
    assert!(completed(&events), "{events:?}");
    assert_eq!(selected(&events).engine_id, "legacy");
    assert!(selected(&events).warning.as_deref().unwrap().contains("quarantined"), "{events:?}");
    assert_eq!(messages(&g, "s2").await.len(), 4, "nothing lost");
    g.stop().await;
}

#[tokio::test]
async fn a_stateless_engines_calls_spread_over_its_replicas() {
    let mut engines = Vec::new();
    for _ in 0..3 {
        engines.push(fault_engine("none").await);
    }
    let list: Vec<String> = engines.iter().map(addr).collect();
    let (g, e) = gateway_over("fault", &list).await;
    assert_eq!(e.affinity, "none", "{e:?}");
    // One session, yet every replica takes calls: nothing ties it to one.
    // (30 turns of random picks: a replica missing them all is ~1e-5.)
    for i in 0..30 {
        served_by(&g, "fault", "one", &format!("turn {i}")).await;
    }
    let e = engine_status(&g, "fault").await;
    assert!(e.replicas.iter().all(|r| r.calls > 0), "{:?}", calls_by_replica(&e));
    let total: u64 = e.replicas.iter().map(|r| r.calls).sum();
    let assembles = e.methods.iter().find(|m| m.method == "Assemble").unwrap().calls;
    assert!(total >= assembles && assembles == 30, "{total} calls, {assembles} assembles");
    g.stop().await;
}

#[tokio::test]
async fn a_dns_name_is_resolved_to_its_replicas_and_an_unknown_name_degrades_to_legacy() {
    let dir = tempfile::tempdir().unwrap();
    let engine = start_window(dir.path(), &[]).await;
    let port = addr(&engine).rsplit_once(':').unwrap().1.to_owned();
    let g = gateway("window", &format!("dns:///localhost:{port}")).await;
    // localhost may also name ::1 (where nothing listens: that replica is
    // quarantined and takes no calls).
    let e = wait_engine(&g, "window", "resolved and attached", |e| {
        e.replicas.iter().any(|r| r.address == format!("127.0.0.1:{port}") && in_service(r))
    })
    .await;
    assert!(e.replicas.iter().all(|r| r.address.ends_with(&format!(":{port}"))), "{e:?}");
    assert_eq!(e.endpoint, format!("dns:///localhost:{port}"));
    served_by(&g, "window", "d", "hello").await;
    g.stop().await;

    // A name that resolves to nothing: the placeholder dials the name and
    // fails; the engine is quarantined and every turn still completes.
    let g = gateway("window", "dns:///no-such-engine.invalid:7401").await;
    let e =
        wait_engine(&g, "window", "unreachable", |e| e.replicas.len() == 1 && e.replicas[0].health == "UNREACHABLE")
            .await;
    assert_eq!(e.replicas[0].address, "no-such-engine.invalid:7401");
    assert!(e.quarantine.is_some(), "{e:?}");
    let events = run_turn(&g, "d", "hello").await;
    assert!(completed(&events), "{events:?}");
    assert_eq!(selected(&events).engine_id, "legacy");
    g.stop().await;
}

#[tokio::test]
async fn killing_one_of_three_replicas_under_load_leaves_no_turn_to_legacy() {
    let (_dirs, mut engines, g) = three_windows().await;
    let until = tokio::time::Instant::now() + std::time::Duration::from_secs(4);
    let clients: Vec<_> = (0..8)
        .map(|c| {
            let client = g.client.clone();
            tokio::spawn(async move {
                let mut served = Vec::new();
                let mut i = 0;
                while tokio::time::Instant::now() < until {
                    let events = run_turn_on(&client, &format!("load-{c}"), &format!("turn {i}")).await;
                    assert!(completed(&events), "{events:?}");
                    served.push(selected(&events).engine_id.clone());
                    i += 1;
                }
                served
            })
        })
        .collect();
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    engines.remove(0).signal_and_wait("KILL").await.unwrap();
    let mut served = Vec::new();
    for c in clients {
        served.extend(c.await.unwrap());
    }
    let legacy = served.iter().filter(|e| *e != "window").count();
    let m = metrics_text(g.metrics.unwrap()).await;
    let fallbacks: Vec<&str> = m
        .lines()
        .filter(|l| l.starts_with("ctxgate_engine_fallbacks_total{engine=\"window\"") && !l.ends_with(" 0"))
        .collect();
    assert_eq!((legacy, fallbacks.len()), (0, 0), "{} turns; answered by legacy: {fallbacks:?}", served.len());
    assert!(served.len() >= 16, "the clients kept turning: {}", served.len());
    g.stop().await;
}

#[tokio::test]
async fn a_replica_that_dies_inside_a_call_is_replaced_by_another_not_by_legacy() {
    // Replica 0 exits in the middle of its first Assemble; the others serve.
    let mut engines = vec![fault_engine("crash-on-assemble").await];
    for _ in 0..2 {
        engines.push(fault_engine("").await);
    }
    let list: Vec<String> = engines.iter().map(addr).collect();
    let (g, _) = gateway_over("fault", &list).await;
    let dead = list[0].clone();
    let mut turns = 0;
    while !engine_status(&g, "fault").await.replicas.iter().any(|r| r.address == dead && r.quarantine.is_some()) {
        assert!(turns < 200, "no turn reached replica 0 in {turns} turns");
        served_by(&g, "fault", &format!("s{turns}"), "hello").await;
        turns += 1;
    }
    let m = metrics_text(g.metrics.unwrap()).await;
    let assembles = |what: &str| counter(&m, what, "engine=\"fault\",method=\"Assemble\"");
    assert_eq!(assembles("ctxgate_engine_fallbacks_total"), 0, "the dying replica's Assemble was answered by legacy");
    assert!(engine_status(&g, "fault").await.quarantine.is_none(), "two replicas serve");
    g.stop().await;
}

/// Rows of `sql` (one `?1`: the value) summed over the replicas' stores.
fn rows_everywhere(dirs: &[tempfile::TempDir], sql: &str, value: &str) -> i64 {
    dirs.iter()
        .map(|d| {
            let flags = rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY;
            let c = rusqlite::Connection::open_with_flags(d.path().join("window.sqlite"), flags).unwrap();
            c.query_row(sql, [value], |r| r.get::<_, i64>(0)).unwrap()
        })
        .sum()
}

#[tokio::test]
async fn a_subagent_spawned_and_ended_across_replicas_leaves_nothing_behind() {
    let (dirs, _engines, g) = three_windows().await;
    for i in 0..3 {
        served_by(&g, "window", "mom", &format!("parent turn {i}")).await;
    }
    let mut c = g.client.clone();
    let spawn = api::SpawnSubagentRequest {
        parent: Some(sref("mom")),
        child_session_key: "kid".into(),
        context_mode: "fork".into(),
        ttl_ms: None,
    };
    // Prepared on the parent's replica (it holds the parent's state).
    assert!(c.spawn_subagent(spawn).await.unwrap().into_inner().engine_prepared);
    assert_eq!(rows_everywhere(&dirs, "SELECT COUNT(*) FROM sessions WHERE session_key = ?1", "kid"), 1);
    assert_eq!(rows_everywhere(&dirs, "SELECT COUNT(*) FROM spawns WHERE ?1 != ''", "x"), 1);
    // The child's turns run on its own replica (resynced there if it is another).
    for i in 0..2 {
        served_by(&g, "window", "kid", &format!("child turn {i}")).await;
    }
    assert!(rows_everywhere(&dirs, "SELECT COUNT(*) FROM sessions WHERE session_key = ?1", "kid") >= 1);
    // Ended as deleted: every replica hears it, whichever holds the child.
    let end = api::EndSubagentRequest { child: Some(sref("kid")), reason: "deleted".into() };
    assert!(c.end_subagent(end).await.unwrap().into_inner().ended);
    assert_eq!(rows_everywhere(&dirs, "SELECT COUNT(*) FROM sessions WHERE session_key = ?1", "kid"), 0);
    assert_eq!(rows_everywhere(&dirs, "SELECT COUNT(*) FROM spawns WHERE ?1 != ''", "x"), 0);
    assert!(
        rows_everywhere(&dirs, "SELECT COUNT(*) FROM sessions WHERE session_key = ?1", "mom") >= 1,
        "the parent stays"
    );
    g.stop().await;
}
