//! What the hosting tests share: fixture engine processes, a config that
//! selects an engine (and a gateway using it), turns run to their end,
//! transcripts read back, and status polls.

#![allow(clippy::unwrap_used)] // test helpers fail loudly by design

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use ctxgate::config::{Config, EngineEntry};
use ctxgate_proto::gateway::{self as api, gateway_client::GatewayClient, turn_event::Event};
use ctxgate_proto::pb::{Role, TranscriptEntry, transcript_entry::Entry};
use tokio_stream::StreamExt;
use tonic::transport::Channel;

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

/// The broken fixture on loopback with `flags` (`--honest-info`, …).
pub async fn broken_engine(flags: &[&str]) -> EngineProcess {
    let args = [&["--listen", "127.0.0.1:0"], flags].concat();
    EngineProcess::start(bin("ctxgate-broken-engine"), &args).await.unwrap()
}

/// The fault fixture with `faults`, and a gateway that selects it as
/// "fault", attached.
pub async fn fault_gateway(faults: &str) -> (EngineProcess, TestGateway) {
    fault_gateway_with(faults, &[]).await
}

/// [`fault_gateway`] with per-method `timeouts` (seconds) for the engine.
pub async fn fault_gateway_with(faults: &str, timeouts: &[(&str, f64)]) -> (EngineProcess, TestGateway) {
    let engine = fault_engine(faults).await;
    let g = attached_gateway("fault", &engine.endpoint, timeouts).await;
    (engine, g)
}

/// The Python engine with its state in a temp dir of its own, and a
/// gateway that selects it as "py", attached: the dir (to keep while the
/// engine runs), the engine, the gateway.
pub async fn python_gateway() -> (tempfile::TempDir, EngineProcess, TestGateway) {
    let state = tempfile::tempdir().unwrap();
    let engine = crate::start_python(state.path()).await;
    let g = attached_gateway("py", &engine.endpoint, &[]).await;
    (state, engine, g)
}

/// A gateway that selects engine `id` at `endpoint` ([`hosting`]), once
/// the engine is attached.
pub async fn attached_gateway(id: &str, endpoint: &str, timeouts: &[(&str, f64)]) -> TestGateway {
    let g = TestGateway::start(hosting(id, endpoint, timeouts)).await;
    attached(&g, id).await;
    g
}

/// [`hosting`] (without timeouts) as the text of a config file, as a
/// user writes it for `ctxgate serve --config`.
pub fn hosting_json5(id: &str, endpoint: &str) -> String {
    format!(
        "{{ plugins: {{ slots: {{ contextEngine: '{id}' }}, entries: {{ {id}: {{ endpoint: '{endpoint}' }} }} }} }}"
    )
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

/// A RunTurn request: `text` on session `key`, no system prompt.
pub fn turn_request(key: &str, text: impl Into<String>) -> api::RunTurnRequest {
    api::RunTurnRequest { session: session(key), message: text.into(), system_prompt: None, ..Default::default() }
}

/// How long to wait before retrying a call the gateway shed
/// (RESOURCE_EXHAUSTED: a fresh gateway admits few turns while it measures
/// its baseline): its `grpc-retry-pushback-ms`, else 100 ms. `None` for
/// any other failure.
pub fn shed_pushback(s: &tonic::Status) -> Option<Duration> {
    (s.code() == tonic::Code::ResourceExhausted).then(|| {
        let ms = s.metadata().get("grpc-retry-pushback-ms").and_then(|v| v.to_str().ok()?.parse().ok());
        Duration::from_millis(ms.unwrap_or(100))
    })
}

pub async fn run_turn(g: &TestGateway, key: &str, text: &str) -> Vec<Event> {
    let req = turn_request(key, text);
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

/// Starts a manual Compact of session `key`: its events, unread.
pub async fn compaction_stream(g: &TestGateway, key: &str) -> tonic::Streaming<api::CompactionEvent> {
    let req = api::CompactSessionRequest { session: session(key), custom_instructions: None };
    g.client.clone().compact(req).await.unwrap().into_inner()
}

pub fn selected(events: &[Event]) -> &api::EngineSelected {
    events.iter().find_map(|e| if let Event::EngineSelected(s) = e { Some(s) } else { None }).unwrap()
}

pub fn completed(events: &[Event]) -> bool {
    matches!(events.last(), Some(Event::Completed(_)))
}

pub async fn messages(g: &TestGateway, key: &str) -> Vec<String> {
    transcript(&g.client, key)
        .await
        .into_iter()
        .filter_map(|e| {
            if let Some(Entry::Message(m)) = e.entry { Some(ctxgate::provider::message_text(&m)) } else { None }
        })
        .collect()
}

/// Every entry of session `key`'s active branch (GetTranscript, not only
/// the visible part), through `client`.
pub async fn transcript(client: &GatewayClient<Channel>, key: &str) -> Vec<TranscriptEntry> {
    let req = api::GetTranscriptRequest { session: session(key), visible_only: false, ..Default::default() };
    client.clone().get_transcript(req).await.unwrap().into_inner().entries
}

/// The roles of the messages among `entries`, in order.
pub fn message_roles(entries: &[TranscriptEntry]) -> Vec<Role> {
    entries
        .iter()
        .filter_map(
            |e| if let Some(Entry::Message(m)) = &e.entry { Some(Role::try_from(m.role).unwrap()) } else { None },
        )
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
