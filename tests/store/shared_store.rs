//! Several `ctxgate serve` processes on one PostgreSQL (a cluster the test
//! starts): turns on one session sent to random gateways at once stay one
//! clean chain and never interleave; a gateway SIGKILLed mid-turn loses its
//! session to another once its lease lapses, its turn rewound as an abort,
//! and the durable engine's record has each accepted turn once; a store
//! URL that is wrong, unreachable or newer stops `serve` with a sentence
//! before it binds anything; a reset waits for the turn another gateway
//! runs on the session.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use ctxgate_proto::gateway::{self as api, gateway_client::GatewayClient, turn_event::Event};
use ctxgate_proto::pb::transcript_entry::Entry;
use ctxgate_tests::hosting::{fault_engine, shed_pushback, turn_request};
use ctxgate_tests::postgres::{Postgres, pg_options};
use ctxgate_tests::{EngineProcess, bin, gateway_client, serve, write_file};
use tokio_stream::StreamExt;

/// One PostgreSQL database (in a cluster of the test's own) that the
/// test's gateways share, and the durable fault engine they all select.
/// (Fields drop in order: the cluster last.)
struct SharedStore {
    /// The gateways' config files and state dirs.
    dir: tempfile::TempDir,
    engine: EngineProcess,
    url: String,
    _pg: Postgres,
}

impl SharedStore {
    async fn start(database: &str) -> Self {
        let pg = Postgres::start(false).await;
        let url = pg.database(database).await;
        let engine = fault_engine("durable").await;
        Self { dir: tempfile::tempdir().unwrap(), engine, url, _pg: pg }
    }

    /// `ctxgate serve` on the shared store, with the durable fault engine.
    async fn gateway(&self, name: &str) -> EngineProcess {
        let (dir, url, engine) = (self.dir.path(), &self.url, &self.engine.endpoint);
        let text = format!(
            "{{ store: {{ url: {url:?}, leaseSeconds: 2 }},
           plugins: {{ entries: {{ fault: {{ endpoint: {engine:?} }} }}, slots: {{ contextEngine: 'fault' }} }} }}"
        );
        let config = write_file(dir, &format!("{name}.json5"), &text);
        let g = serve(&dir.join(name), Some(&config)).await;
        // Turns before the engine's first attach anywhere are legacy's and not
        // recorded for it (as on one gateway): wait until this one attached.
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let s = gateway_client(&g.endpoint).get_status(api::StatusRequest {}).await.unwrap().into_inner();
            if s.engines.iter().any(|e| e.id == "fault" && e.quarantine.is_none() && !e.name.is_empty()) {
                return g;
            }
            assert!(Instant::now() < deadline, "{name}: the engine never attached");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Runs one turn to its end, retrying after a shed; the turn's id when it
/// completed, its status when it failed otherwise.
async fn turn(c: &mut GatewayClient<tonic::transport::Channel>, key: &str, text: &str) -> Result<String, String> {
    let deadline = Instant::now() + Duration::from_secs(60);
    'retry: loop {
        assert!(Instant::now() < deadline, "{key}: shed for 60 s");
        let req = turn_request(key, text);
        let mut stream = match c.run_turn(req).await {
            Ok(r) => r.into_inner(),
            Err(s) => match shed_pushback(&s) {
                Some(wait) => {
                    tokio::time::sleep(wait).await;
                    continue;
                }
                None => return Err(format!("{s:?}")),
            },
        };
        let mut id = None;
        while let Some(e) = stream.next().await {
            match e {
                Ok(e) => match e.event {
                    Some(Event::Admitted(a)) => id = Some(a.turn_id),
                    Some(Event::Completed(_)) => return id.ok_or_else(|| "completed, never admitted".into()),
                    Some(Event::Failed(f)) => return Err(format!("failed: {f:?}")),
                    _ => {}
                },
                Err(s) if id.is_none() && shed_pushback(&s).is_some() => {
                    tokio::time::sleep(shed_pushback(&s).unwrap()).await;
                    continue 'retry;
                }
                Err(s) => return Err(format!("{s:?}")),
            }
        }
        return Err("the stream ended without an outcome".into());
    }
}

/// Session `key`'s whole branch as the gateway at `url` reads it.
async fn transcript(url: &str, key: &str) -> Vec<ctxgate_proto::pb::TranscriptEntry> {
    ctxgate_tests::hosting::transcript(&gateway_client(url), key).await
}

/// The advancement keys the engine committed (its record), with how often
/// each was delivered.
fn engine_commits(engine: &EngineProcess) -> HashMap<String, usize> {
    let mut n = HashMap::new();
    for l in engine.lines_starting("event commit ") {
        *n.entry(l.split(' ').nth(2).unwrap().to_owned()).or_insert(0) += 1;
    }
    n
}

/// Waits (bounded) until the engine has committed every one of `keys`.
async fn committed_all(engine: &EngineProcess, keys: &HashSet<String>) -> HashMap<String, usize> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let got = engine_commits(engine);
        if keys.iter().all(|k| got.contains_key(k)) {
            return got;
        }
        assert!(Instant::now() < deadline, "the engine never received {} turn(s)", keys.len() - got.len());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One chain (seq +1, each entry's parent the previous); each turn's
/// entries together; every user message of the session once.
fn assert_one_clean_chain(key: &str, entries: &[ctxgate_proto::pb::TranscriptEntry], sent: &[String]) {
    for (i, e) in entries.iter().enumerate() {
        assert_eq!(e.seq, i as u64 + 1, "{key}: seq gap at {i}");
        let parent = (i > 0).then(|| entries[i - 1].id.clone());
        assert_eq!(e.parent_id, parent, "{key}: broken chain at {i}");
    }
    let mut seen_turns = HashSet::new();
    for w in entries.windows(2) {
        if w[0].turn_id != w[1].turn_id {
            assert!(
                seen_turns.insert(w[0].turn_id.clone()),
                "{key}: turn {} is interleaved with another",
                w[0].turn_id
            );
        }
    }
    let users: Vec<String> = entries
        .iter()
        .filter_map(|e| match &e.entry {
            Some(Entry::Message(m)) if m.role == ctxgate_proto::pb::Role::User as i32 => {
                Some(ctxgate::provider::message_text(m))
            }
            _ => None,
        })
        .collect();
    let mut a = users.clone();
    let mut b = sent.to_vec();
    a.sort();
    b.sort();
    assert_eq!(a, b, "{key}: every message sent is there once, nothing else");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_gateways_keep_each_session_one_clean_chain_under_concurrent_turns() {
    let store = SharedStore::start("mesh").await;
    let mut gateways = Vec::new();
    for name in ["g0", "g1", "g2"] {
        gateways.push(store.gateway(name).await);
    }
    let urls: Vec<String> = gateways.iter().map(|g| g.endpoint.clone()).collect();

    // 8 sessions; three clients per session, each turn to a random gateway:
    // up to three turns of one session in flight across the gateways.
    const SESSIONS: usize = 8;
    const TURNS: usize = 4;
    let mut tasks = Vec::new();
    for s in 0..SESSIONS {
        for w in 0..3 {
            let urls = urls.clone();
            tasks.push(tokio::spawn(async move {
                let key = format!("mesh-{s}");
                let mut seed = (s * 31 + w * 7 + 1) as u64;
                let mut done = Vec::new();
                for t in 0..TURNS {
                    seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    let url = &urls[(seed >> 33) as usize % urls.len()];
                    let text = format!("{key} client {w} turn {t}");
                    let id =
                        turn(&mut gateway_client(url), &key, &text).await.unwrap_or_else(|e| panic!("{text}: {e}"));
                    done.push((key.clone(), text, id));
                }
                done
            }));
        }
    }
    let mut sent: HashMap<String, Vec<String>> = HashMap::new();
    let mut accepted = HashSet::new();
    for t in tasks {
        for (key, text, id) in t.await.unwrap() {
            sent.entry(key).or_default().push(text);
            accepted.insert(id);
        }
    }
    assert_eq!(accepted.len(), SESSIONS * 3 * TURNS);
    for (i, (key, texts)) in sent.iter().enumerate() {
        // Any gateway reads the same history.
        let entries = transcript(&urls[i % urls.len()], key).await;
        assert_one_clean_chain(key, &entries, texts);
        assert_eq!(entries, transcript(&urls[(i + 1) % urls.len()], key).await, "{key}: gateways disagree");
    }
    let record = committed_all(&store.engine, &accepted).await;
    let extra: Vec<_> = record.keys().filter(|k| !accepted.contains(*k)).collect();
    assert!(extra.is_empty(), "the engine has turns nobody accepted: {extra:?}");
    eprintln!(
        "{} turns over 3 gateways, {} sessions; {} deliveries for {} commits",
        accepted.len(),
        SESSIONS,
        record.values().sum::<usize>(),
        record.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_killed_mid_turn_loses_its_session_to_another_once_the_lease_lapses() {
    use ctxgate_tests::harness::open_tool_turn;
    let store = SharedStore::start("takeover").await;
    let a = store.gateway("a").await;
    let b = store.gateway("b").await;

    let before = turn(&mut gateway_client(&a.endpoint), "cut", "first").await.unwrap();
    let d = open_tool_turn(&a.endpoint, "cut", "run the tools").await;
    // Acknowledged, durable, the lease held — and the gateway dies.
    a.signal_and_wait("KILL").await.unwrap();
    drop(d);

    // The other gateway's turn waits for the lease (enqueue), then runs.
    let started = Instant::now();
    let after = turn(&mut gateway_client(&b.endpoint), "cut", "again").await.unwrap();
    let waited = started.elapsed();
    assert!(waited < Duration::from_secs(20), "took over after {waited:?}");
    let entries = transcript(&b.endpoint, "cut").await;
    let shape: Vec<String> = entries
        .iter()
        .filter_map(|e| match &e.entry {
            Some(Entry::Message(m)) => Some(format!(
                "{:?}:{}",
                ctxgate_proto::pb::Role::try_from(m.role).unwrap(),
                ctxgate::provider::message_text(m)
            )),
            _ => None,
        })
        .collect();
    assert_eq!(shape.len(), 5, "{shape:?}");
    assert_eq!(&shape[2], "User:run the tools", "the killed turn ends as an abort: its user message only");
    assert_eq!(&shape[3], "User:again", "{shape:?}");
    let keys: HashSet<String> = [before.clone(), after.clone()].into();
    let record = committed_all(&store.engine, &keys).await;
    assert_eq!(record.len(), 2, "the killed turn never reaches the engine's record: {record:?}");
    eprintln!("taken over after {waited:?}; engine record {record:?}");
    drop(b);
}

#[tokio::test]
async fn a_wrong_unreachable_or_newer_store_stops_serve_with_a_sentence_before_binding() {
    let pg = Postgres::start(false).await;
    let newer = pg.database("newer").await;
    let dir = tempfile::tempdir().unwrap();
    let serve = async |url: &str| {
        let out = tokio::process::Command::new(bin("ctxgate"))
            .args(["serve", "--listen", "127.0.0.1:0", "--state-dir", dir.path().to_str().unwrap()])
            .env("CTXGATE_STORE_URL", url)
            .output()
            .await
            .unwrap();
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert_eq!(out.status.code(), Some(1), "{url}: {stderr}");
        assert!(stdout.is_empty(), "{url}: nothing was bound: {stdout}");
        stderr.into_owned()
    };
    let e = serve("postgres://postgres@127.0.0.1:1/ctxgate").await;
    assert!(e.contains("cannot connect to PostgreSQL") && e.contains("127.0.0.1:1"), "{e}");
    let e = serve(&pg.url("missing")).await;
    assert!(e.contains("database \"missing\" does not exist"), "{e}");
    let e = serve("mysql://127.0.0.1/ctxgate").await;
    assert!(e.contains("store.url") && e.contains("postgres://"), "{e}");
    let e = serve("postgres://postgres:secret@127.0.0.1:1/ctxgate").await;
    assert!(!e.contains("secret"), "the password stays out of messages: {e}");

    // A database a newer ctxgate migrated.
    drop(ctxgate::store::postgres::PostgresStore::open(&newer, &pg_options(1, None)).await.unwrap());
    pg.sql("newer", "UPDATE ctxgate_schema SET version = version + 1").await;
    let e = serve(&newer).await;
    assert!(e.contains("newer ctxgate") && e.contains("upgrade ctxgate"), "{e}");
}

#[tokio::test]
async fn a_reset_on_one_gateway_waits_for_the_turn_another_runs_and_archives_it_whole() {
    use ctxgate_proto::pb::Role;
    use ctxgate_tests::harness::{open_tool_turn, text};
    let store = SharedStore::start("reset").await;
    let a = store.gateway("a").await;
    let b = store.gateway("b").await;

    // A turn open on gateway a (its harness is mid tool loop): a holds the lease.
    let mut d = open_tool_turn(&a.endpoint, "busy", "run the tools").await;
    let mut cb = gateway_client(&b.endpoint);
    let reset = tokio::spawn(async move { cb.reset_session(ctxgate_tests::hosting::sref("busy")).await });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!reset.is_finished(), "the reset waits for the turn another gateway runs: {:?}", reset.await);

    d.append(vec![text(Role::Assistant, "the answer is 42")]).await.unwrap();
    d.end(api::TurnOutcome::Accepted).await.unwrap();
    let fresh = tokio::time::timeout(Duration::from_secs(20), reset).await.unwrap().unwrap().unwrap().into_inner();
    let all = gateway_client(&a.endpoint)
        .list_sessions(api::ListSessionsRequest { include_archived: true, ..Default::default() })
        .await
        .unwrap()
        .into_inner()
        .sessions;
    let archived: Vec<_> = all.iter().filter(|s| s.session_key == "busy" && s.state == "archived").collect();
    assert_eq!(archived.len(), 1, "{all:?}");
    assert_eq!(archived[0].entries, 4, "the whole turn went with the archived session: {:?}", archived[0]);
    assert_eq!((fresh.state.as_str(), fresh.entries), ("active", 0), "{fresh:?}");
    assert!(transcript(&b.endpoint, "busy").await.is_empty(), "the new session starts empty");
}
