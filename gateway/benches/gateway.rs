//! `cargo bench -p ctxgate --bench gateway`: the figures in
//! docs/benchmarks.md, measured side by side in one run.
//!
//! - managed turns (`RunTurn`, offline provider) and harness turns
//!   (`DriveTurn`: begin, one context, one append, end) per second, side by
//!   side, 1 and 64 concurrent sessions, through the real gRPC API and
//!   SQLite store, legacy engine;
//! - built-in compaction time for histories of 10k, 100k and 1M tokens
//!   (extractive summariser, so the figure is the gateway's own cost);
//! - resident memory of a `ctxgate serve` process holding 10k idle sessions;
//! - an engine tool's round trip through the gateway: a harness's
//!   `call_tool` → the engine's CallTool (an SDK engine on loopback) → the
//!   result stored and answered as `tool_result`, p50/p99.
//!
//! Set `CTXGATE_BENCH_QUICK=1` for a short smoke run.

#![allow(clippy::unwrap_used)] // a benchmark fails loudly

use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ctxgate::compaction::{self, Input, Settings};
use ctxgate::config::Config;
use ctxgate::summarize::Extractive;
use ctxgate_proto::gateway::{self as api, gateway_client::GatewayClient, harness_client::HarnessClient};
use ctxgate_proto::pb::{AgentMessage, ContentPart, Role, content_part::Part};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;

fn quick() -> bool {
    std::env::var_os("CTXGATE_BENCH_QUICK").is_some()
}

fn sref(key: &str) -> Option<api::SessionRef> {
    Some(api::SessionRef { agent_id: String::new(), session_key: key.into() })
}

/// Turns the gateway shed (RESOURCE_EXHAUSTED with a retry pushback) in
/// this process; the clients here wait as asked and retry, as a client with
/// gRPC's retry policy does.
static SHEDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Counts a shed and waits its pushback; false for any other failure.
async fn shed(s: &tonic::Status) -> bool {
    let pushback = s.metadata().get("grpc-retry-pushback-ms").and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    match pushback {
        Some(ms) if s.code() == tonic::Code::ResourceExhausted => {
            SHEDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(ms)).await;
            true
        }
        _ => false,
    }
}

async fn one_turn(c: &mut GatewayClient<tonic::transport::Channel>, key: &str) {
    let attempt = async |c: &mut GatewayClient<tonic::transport::Channel>| -> Result<(), tonic::Status> {
        let req = api::RunTurnRequest {
            session: sref(key),
            message: "How is the build going today?".into(),
            system_prompt: None,
            ..Default::default()
        };
        let mut s = c.run_turn(req).await?.into_inner();
        while let Some(e) = s.next().await {
            e?;
        }
        Ok(())
    };
    loop {
        match attempt(c).await {
            Ok(()) => return,
            Err(s) if shed(&s).await => continue,
            Err(s) => panic!("{s:?}"),
        }
    }
}

/// One harness turn: begin (→ admitted, engine, context), append the
/// reply, end accepted.
async fn one_harness_turn(c: &mut HarnessClient<tonic::transport::Channel>, key: &str, end_with: bool) {
    let msg = |role: Role, t: &str| AgentMessage {
        role: role as i32,
        content: vec![ContentPart { part: Some(Part::Text(t.into())) }],
        ..Default::default()
    };
    let begin = api::Begin {
        session: sref(key),
        host: Some(api::HostProfile {
            id: "agent-harness:bench".into(),
            label: String::new(),
            capabilities: vec!["assemble-before-prompt".into(), "after-turn".into(), "maintain".into()],
        }),
        model: Some(api::ModelInfo {
            id: "bench".into(),
            provider: String::new(),
            context_window: 32_000,
            max_output_tokens: 1_024,
        }),
        user_messages: vec![msg(Role::User, "How is the build going today?")],
        ..Default::default()
    };
    loop {
        match harness_attempt(c, begin.clone(), msg(Role::Assistant, "All green, 412 tests passed."), end_with).await {
            Ok(()) => return,
            Err(s) if shed(&s).await => continue,
            Err(s) => panic!("{s:?}"),
        }
    }
}

async fn harness_attempt(
    c: &mut HarnessClient<tonic::transport::Channel>,
    begin: api::Begin,
    reply: AgentMessage,
    end_with: bool,
) -> Result<(), tonic::Status> {
    use api::harness_event::Event as H;
    use api::harness_request::Request as R;
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let send = |r: R| tx.try_send(api::HarnessRequest { request: Some(r) }).unwrap();
    send(R::Begin(begin));
    let mut events = c.drive_turn(tokio_stream::wrappers::ReceiverStream::new(rx)).await?.into_inner();
    let mut next_until = async |want: fn(&H) -> bool| -> Result<(), tonic::Status> {
        loop {
            let e = events.next().await.unwrap()?.event.unwrap();
            if want(&e) {
                return Ok(());
            }
        }
    };
    next_until(|e| matches!(e, H::Context(_))).await?;
    let accepted = api::TurnOutcome::Accepted as i32;
    if end_with {
        // The answer stored with the end: one round trip and one write fewer.
        send(R::End(api::End { outcome: accepted, messages: vec![reply], ..Default::default() }));
    } else {
        send(R::Append(api::Append { messages: vec![reply] }));
        next_until(|e| matches!(e, H::Appended(_))).await?;
        send(R::End(api::End { outcome: accepted, ..Default::default() }));
    }
    next_until(|e| matches!(e, H::Ended(_))).await?;
    drop(tx);
    while events.next().await.is_some() {}
    Ok(())
}

/// A gateway in this process on loopback (the same `server::run` as the
/// binary), its state in a temp dir; `configure` adjusts its config.
struct Gateway {
    channel: tonic::transport::Channel,
    stop: CancellationToken,
    server: tokio::task::JoinHandle<Result<(), ctxgate::api::server::ServeError>>,
    _state: tempfile::TempDir,
}

impl Gateway {
    async fn start(configure: impl FnOnce(&mut Config)) -> Self {
        let state = tempfile::tempdir().unwrap();
        let mut config = Config { state_dir: state.path().to_path_buf(), ..Config::default() };
        config.gateway.listen = "127.0.0.1:0".into();
        configure(&mut config);
        let listeners = ctxgate::api::server::Listeners::bind(&config).await.unwrap();
        let url = format!("http://{}", listeners.api.local_addr().unwrap());
        let stop = CancellationToken::new();
        let s = stop.clone();
        let server = tokio::spawn(ctxgate::api::server::run(config, listeners, async move { s.cancelled().await }));
        let channel = tonic::transport::Endpoint::from_shared(url).unwrap().connect().await.unwrap();
        Self { channel, stop, server, _state: state }
    }

    async fn stop(self) {
        self.stop.cancel();
        self.server.await.unwrap().unwrap();
    }
}

#[derive(Clone, Copy, Debug)]
enum Driver {
    Managed,
    Harness,
    /// The answer carried by `end` instead of an `append`.
    HarnessEndWith,
}

async fn turn(driver: Driver, channel: &tonic::transport::Channel, key: &str) {
    match driver {
        Driver::Managed => one_turn(&mut GatewayClient::new(channel.clone()), key).await,
        Driver::Harness => one_harness_turn(&mut HarnessClient::new(channel.clone()), key, false).await,
        Driver::HarnessEndWith => one_harness_turn(&mut HarnessClient::new(channel.clone()), key, true).await,
    }
}

async fn turns_per_second(driver: Driver, concurrency: usize, per_session: usize) -> f64 {
    let gateway = Gateway::start(|_| {}).await;
    let channel = gateway.channel.clone();
    // Warm up each session (creation is not a turn's steady-state cost).
    for i in 0..concurrency {
        turn(driver, &channel, &format!("bench-{i}")).await;
    }
    let started = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|i| {
            let channel = channel.clone();
            tokio::spawn(async move {
                for _ in 0..per_session {
                    turn(driver, &channel, &format!("bench-{i}")).await;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let rate = (concurrency * per_session) as f64 / started.elapsed().as_secs_f64();
    gateway.stop().await;
    rate
}

/// A history of about `tokens` tokens: user/assistant turns with tool pairs.
fn history(tokens: u64) -> Vec<AgentMessage> {
    let mut out = Vec::new();
    let mut total = 0;
    let mut i = 0;
    while total < tokens {
        let text = |role: Role, body: String| AgentMessage {
            id: format!("m{}", out.len()),
            role: role as i32,
            content: vec![ContentPart { part: Some(Part::Text(body)) }],
            ..Default::default()
        };
        let u = text(
            Role::User,
            format!("Step {i}: please update src/mod_{i}.rs and keep ticket BUG-{i} in mind. {}", "detail ".repeat(40)),
        );
        let a = text(
            Role::Assistant,
            format!("I decided to refactor fn_{i} first. TODO: run the tests later. {}", "words ".repeat(60)),
        );
        total += ctxgate_proto::estimate::message_tokens(&u) + ctxgate_proto::estimate::message_tokens(&a);
        out.push(u);
        let len = out.len();
        out.push(AgentMessage { id: format!("m{len}"), ..a });
        i += 1;
    }
    out
}

async fn compaction_time(tokens: u64) -> (Duration, u64, u64) {
    let messages = history(tokens);
    // A 2k-token kept tail so even the 10k history has something to summarise.
    let settings = Settings {
        keep_recent_tokens: 2_000,
        recent_turns_preserve: 0,
        chunk_tokens: 16_000,
        request_timeout: Duration::from_secs(180),
        quality_guard: true,
        max_retries: 1,
        strict_identifiers: true,
    };
    let input = Input { previous_summary: None, messages, token_budget: None, instructions: None };
    let started = Instant::now();
    let out =
        compaction::compact(input, &Extractive, &settings, &CancellationToken::new(), &mut |_, _, _| {}).await.unwrap();
    let took = started.elapsed();
    match out {
        compaction::Outcome::Compacted { tokens_before, tokens_after, .. } => (took, tokens_before, tokens_after),
        other => panic!("not compacted: {other:?}"),
    }
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .unwrap()
        .trim()
        .trim_end_matches(" kB")
        .trim()
        .parse()
        .unwrap()
}

async fn idle_sessions_memory(sessions: usize) -> (u64, u64) {
    let state = tempfile::tempdir().unwrap();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_ctxgate"))
        .args(["serve", "--listen", "127.0.0.1:0", "--state-dir", state.path().to_str().unwrap()])
        .env("CTXGATE_LOG", "warn")
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let line = lines.next_line().await.unwrap().unwrap();
    let url = format!("http://{}", line.strip_prefix("listening on ").unwrap());
    let pid = child.id().unwrap();
    let channel = tonic::transport::Endpoint::from_shared(url).unwrap().connect().await.unwrap();
    one_turn(&mut GatewayClient::new(channel.clone()), "warm").await;
    let before = rss_kib(pid);
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let tasks: Vec<_> = (0..32)
        .map(|_| {
            let (mut c, next) = (GatewayClient::new(channel.clone()), next.clone());
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if i >= sessions {
                        return;
                    }
                    one_turn(&mut c, &format!("idle-{i}")).await;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = rss_kib(pid);
    child.kill().await.unwrap();
    (before, after)
}

/// An SDK engine on loopback with one tool that echoes its arguments.
struct Echo;

impl ctxgate_engine_sdk::ContextEngine for Echo {
    async fn get_info(
        &self,
        _: &ctxgate_engine_sdk::CallContext,
    ) -> Result<ctxgate_proto::pb::EngineInfo, ctxgate_engine_sdk::EngineError> {
        use ctxgate_proto::Method;
        Ok(ctxgate_proto::pb::EngineInfo {
            id: "echo".into(),
            name: "Echo".into(),
            contract_version: ctxgate_proto::CONTRACT_VERSION.into(),
            implemented_methods: [Method::GetInfo, Method::Ingest, Method::Assemble, Method::Compact, Method::CallTool]
                .map(|m| m.name().to_owned())
                .to_vec(),
            tools: vec![ctxgate_engine_sdk::tool("echo", "Answers its arguments.", r#"{"type":"object"}"#)],
            ..Default::default()
        })
    }
    async fn ingest(
        &self,
        _: &ctxgate_engine_sdk::CallContext,
        _: ctxgate_proto::pb::IngestRequest,
    ) -> Result<ctxgate_proto::pb::IngestResult, ctxgate_engine_sdk::EngineError> {
        Ok(ctxgate_proto::pb::IngestResult { ingested: true })
    }
    async fn assemble(
        &self,
        _: &ctxgate_engine_sdk::CallContext,
        r: ctxgate_proto::pb::AssembleRequest,
    ) -> Result<ctxgate_proto::pb::AssembleResult, ctxgate_engine_sdk::EngineError> {
        Ok(ctxgate_proto::pb::AssembleResult { messages: r.messages, ..Default::default() })
    }
    async fn compact(
        &self,
        _: &ctxgate_engine_sdk::CallContext,
        _: ctxgate_proto::pb::CompactRequest,
        _: ctxgate_engine_sdk::Progress,
    ) -> Result<ctxgate_engine_sdk::CompactOutcome, ctxgate_engine_sdk::EngineError> {
        Ok(ctxgate_engine_sdk::CompactOutcome::DelegateToHost(Default::default()))
    }
    async fn call_tool(
        &self,
        _: &ctxgate_engine_sdk::CallContext,
        r: ctxgate_proto::pb::CallToolRequest,
    ) -> Result<ctxgate_proto::pb::CallToolResult, ctxgate_engine_sdk::EngineError> {
        Ok(ctxgate_engine_sdk::tool_text(r.arguments_json))
    }
}

/// p50 and p99 of `rounds` engine tool calls in one harness turn.
async fn call_tool_round_trip(rounds: usize) -> (Duration, Duration) {
    use api::harness_event::Event as H;
    use api::harness_request::Request as R;
    let engine = ctxgate_engine_sdk::testkit::TestEngine::start(Echo).await.unwrap();
    let gateway = Gateway::start(|config| {
        let entry = ctxgate::config::EngineEntry { endpoint: engine.endpoint.as_str().into(), ..Default::default() };
        config.plugins.entries.insert("echo".into(), entry);
        config.plugins.slots.context_engine = Some("echo".into());
    })
    .await;
    let channel = gateway.channel.clone();
    let mut gw = GatewayClient::new(channel.clone());
    // Until the engine is attached (its tools are offered).
    loop {
        let st = gw.get_status(api::StatusRequest {}).await.unwrap().into_inner();
        if st.engines.iter().any(|e| e.id == "echo" && e.quarantine.is_none() && !e.tools.is_empty()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let msg = |role: Role, part: Part| AgentMessage {
        role: role as i32,
        content: vec![ContentPart { part: Some(part) }],
        ..Default::default()
    };
    let begin = api::Begin {
        session: sref("tools"),
        host: Some(api::HostProfile {
            id: "agent-harness:bench".into(),
            label: String::new(),
            capabilities: vec!["assemble-before-prompt".into()],
        }),
        model: Some(api::ModelInfo {
            id: "bench".into(),
            provider: String::new(),
            context_window: 1_000_000,
            max_output_tokens: 1_024,
        }),
        user_messages: vec![msg(Role::User, Part::Text("use the tool".into()))],
        ..Default::default()
    };
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let send = |r: R| tx.try_send(api::HarnessRequest { request: Some(r) }).unwrap();
    send(R::Begin(begin));
    let mut events = HarnessClient::new(channel)
        .drive_turn(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let mut next_until = async |want: fn(&H) -> bool| loop {
        let e = events.next().await.unwrap().unwrap().event.unwrap();
        if want(&e) {
            return;
        }
    };
    next_until(|e| matches!(e, H::Context(_))).await;
    let mut took = Vec::with_capacity(rounds);
    for i in 0..rounds {
        let call = ctxgate_proto::pb::ToolCall {
            id: format!("c{i}"),
            name: "echo".into(),
            arguments_json: format!(r#"{{"n":{i}}}"#),
        };
        send(R::Append(api::Append { messages: vec![msg(Role::Assistant, Part::ToolCall(call))] }));
        next_until(|e| matches!(e, H::Appended(_))).await;
        let started = Instant::now();
        send(R::CallTool(api::CallTool { tool_call_id: format!("c{i}") }));
        next_until(|e| matches!(e, H::ToolResult(_))).await;
        took.push(started.elapsed());
    }
    send(R::End(api::End { outcome: api::TurnOutcome::Aborted as i32, ..Default::default() }));
    next_until(|e| matches!(e, H::Ended(_))).await;
    drop(tx);
    gateway.stop().await;
    engine.stop().await;
    took.sort();
    let at = |p: f64| took[((took.len() as f64 - 1.0) * p).round() as usize];
    (at(0.5), at(0.99))
}

#[tokio::main]
async fn main() {
    // `cargo bench` passes --bench; nothing else is accepted.
    let (per_session_1, per_session_64, idle) = if quick() { (50, 2, 500) } else { (2_000, 40, 10_000) };
    println!("ctxgate gateway benchmark ({} run)", if quick() { "quick" } else { "full" });
    for (concurrency, per) in [(1, per_session_1), (64, per_session_64)] {
        for driver in [Driver::Managed, Driver::Harness, Driver::HarnessEndWith] {
            let rate = turns_per_second(driver, concurrency, per).await;
            let what = match driver {
                Driver::Managed => "managed turns (RunTurn, offline model)      ",
                Driver::Harness => "harness turns (begin, context, append, end)",
                Driver::HarnessEndWith => "harness turns (begin, context, end + answer)",
            };
            let sheds = SHEDS.swap(0, std::sync::atomic::Ordering::Relaxed);
            println!(
                "{what}, legacy, {concurrency:>2} concurrent sessions: {rate:8.0} turns/s ({} turns, {sheds} shed and retried)",
                concurrency * per
            );
        }
    }
    for tokens in [10_000u64, 100_000, 1_000_000] {
        let (took, before, after) = compaction_time(tokens).await;
        println!(
            "built-in compaction of ~{tokens:>9} tokens: {:>9.1} ms ({before} → {after} tokens)",
            took.as_secs_f64() * 1e3
        );
    }
    let rounds = if quick() { 50 } else { 500 };
    let (p50, p99) = call_tool_round_trip(rounds).await;
    println!(
        "engine tool round trip (harness call_tool → CallTool → stored tool_result): p50 {:.2} ms, p99 {:.2} ms ({rounds} calls)",
        p50.as_secs_f64() * 1e3,
        p99.as_secs_f64() * 1e3
    );
    let (before, after) = idle_sessions_memory(idle).await;
    println!(
        "ctxgate serve RSS: {:.1} MiB warm, {:.1} MiB with {idle} idle sessions (+{:.2} KiB/session)",
        before as f64 / 1024.0,
        after as f64 / 1024.0,
        after.saturating_sub(before) as f64 / idle as f64
    );
}
