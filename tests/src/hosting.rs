//! What the hosting tests share: a fault engine process, a config that
//! selects an engine, turns run to their end, and status polls.

#![allow(clippy::unwrap_used)] // test helpers fail loudly by design

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use ctxgate::config::{Config, EngineEntry};
use ctxgate_proto::gateway::{self as api, turn_event::Event};
use ctxgate_proto::pb::transcript_entry::Entry;
use tokio_stream::StreamExt;

use crate::{EngineProcess, PATIENCE, TestGateway, bin, within};

/// The session of `key` for agent "main".
pub fn sref(key: &str) -> api::SessionRef {
    api::SessionRef { agent_id: String::new(), session_key: key.into() }
}

/// [`sref`] as the optional field requests carry.
pub fn session(key: &str) -> Option<api::SessionRef> {
    Some(sref(key))
}

pub async fn fault_engine(faults: &str) -> EngineProcess {
    EngineProcess::start(bin("ctxgate-fault-engine"), &["--listen", "127.0.0.1:0", "--fault", faults]).await.unwrap()
}

/// The fault fixture with `faults`, and a gateway that selects it as
/// "fault", attached.
pub async fn fault_gateway(faults: &str) -> (EngineProcess, TestGateway) {
    let engine = fault_engine(faults).await;
    let g = TestGateway::start(hosting("fault", &engine.endpoint, &[])).await;
    attached(&g, "fault").await;
    (engine, g)
}

pub fn hosting(id: &str, endpoint: &str, timeouts: &[(&str, f64)]) -> Config {
    let mut c = Config::default();
    let entry = EngineEntry {
        endpoint: endpoint.into(),
        timeouts: timeouts.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect::<BTreeMap<_, _>>(),
        ..EngineEntry::default()
    };
    c.plugins.entries.insert(id.into(), entry);
    c.plugins.slots.context_engine = Some(id.into());
    c
}

pub async fn status(g: &TestGateway) -> api::StatusResult {
    g.client.clone().get_status(api::StatusRequest {}).await.unwrap().into_inner()
}

pub async fn engine_status(g: &TestGateway, id: &str) -> api::EngineStatus {
    status(g).await.engines.into_iter().find(|e| e.id == id).unwrap()
}

/// Polls Status (bounded) until `ok` holds for the engine.
pub async fn wait_engine(
    g: &TestGateway,
    id: &str,
    what: &str,
    ok: impl Fn(&api::EngineStatus) -> bool,
) -> api::EngineStatus {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let e = engine_status(g, id).await;
        if ok(&e) {
            return e;
        }
        assert!(Instant::now() < deadline, "engine {id} never became {what}: {e:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

pub async fn attached(g: &TestGateway, id: &str) {
    wait_engine(g, id, "attached", |e| e.quarantine.is_none() && !e.name.is_empty()).await;
}

pub async fn run_turn(g: &TestGateway, key: &str, text: &str) -> Vec<Event> {
    let req =
        api::RunTurnRequest { session: session(key), message: text.into(), system_prompt: None, ..Default::default() };
    within(PATIENCE, format!("the turn {text:?} on {key:?} ending"), async {
        let mut stream = g.client.clone().run_turn(req).await.unwrap().into_inner();
        let mut events = Vec::new();
        while let Some(e) = stream.next().await {
            events.push(e.unwrap().event.unwrap());
        }
        events
    })
    .await
}

pub fn selected(events: &[Event]) -> &api::EngineSelected {
    events.iter().find_map(|e| if let Event::EngineSelected(s) = e { Some(s) } else { None }).unwrap()
}

pub fn completed(events: &[Event]) -> bool {
    matches!(events.last(), Some(Event::Completed(_)))
}

pub async fn messages(g: &TestGateway, key: &str) -> Vec<String> {
    let req = api::GetTranscriptRequest { session: session(key), visible_only: false, ..Default::default() };
    g.client
        .clone()
        .get_transcript(req)
        .await
        .unwrap()
        .into_inner()
        .entries
        .into_iter()
        .filter_map(|e| {
            if let Some(Entry::Message(m)) = e.entry { Some(ctxgate::provider::message_text(&m)) } else { None }
        })
        .collect()
}

pub fn quarantine_of(e: &api::EngineStatus) -> (&str, &str) {
    let q = e.quarantine.as_ref().unwrap();
    (q.operation.as_str(), q.reason.as_str())
}

pub fn turn_id(events: &[Event]) -> String {
    events.iter().find_map(|e| if let Event::Admitted(a) = e { Some(a.turn_id.clone()) } else { None }).unwrap()
}

/// The turn's failure, if it failed.
pub fn failure(events: &[Event]) -> Option<&api::Failed> {
    events.last().and_then(|e| if let Event::Failed(f) = e { Some(f) } else { None })
}

/// Runs the `ctxgate` binary: exit code and stdout.
pub async fn ctxgate(args: &[&str]) -> (Option<i32>, String) {
    let out = tokio::process::Command::new(bin("ctxgate")).args(args).output().await.unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Sends a signal ("USR1", "KILL", …) to a process.
pub async fn signal(pid: u32, name: &str) {
    let ok = tokio::process::Command::new("kill").arg(format!("-{name}")).arg(pid.to_string()).status().await.unwrap();
    assert!(ok.success(), "kill -{name} {pid}");
}
