//! `engine-bench`: the Assemble round trip of a 200-message session against
//! any engine endpoints, side by side in one run, measured the way
//! `gateway/benches/engine_call.rs` measures its "direct" path (a plain
//! tonic client, the same request, p50/p99 over sorted latencies). The Rust
//! SDK's engine (engine_call's pass-through engine) always runs in-process as
//! `rust-sdk`; the others are processes:
//!
//! ```sh
//! cargo run --release -p ctxgate-tests --bin engine-bench
//!     # spawns the Python SDK's example engine (engine-sdk/python/run.sh) as `python-sdk`
//! cargo run --release -p ctxgate-tests --bin engine-bench -- --spawn NAME=PROGRAM --endpoint NAME=URL
//! ```
//!
//! A spawned PROGRAM gets `--listen 127.0.0.1:0 --state-dir DIR` and must
//! print `listening on ADDR`. Set `CTXGATE_BENCH_QUICK=1` for a short run.

#![allow(clippy::unwrap_used)] // a benchmark fails loudly

use std::sync::Arc;
use std::time::{Duration, Instant};

use ctxgate_engine_sdk::testkit::msg;
use ctxgate_engine_sdk::{CallContext, CompactOutcome, ContextEngine, Endpoint, EngineError, Progress, Server, pb};
use ctxgate_tests::{EngineProcess, repo_root};

/// The Rust SDK's engine: assemble returns the history (engine_call's `PassThrough`).
struct PassThrough;

impl ContextEngine for PassThrough {
    async fn get_info(&self, _: &CallContext) -> Result<pb::EngineInfo, EngineError> {
        Ok(pb::EngineInfo {
            id: "bench".into(),
            name: "bench".into(),
            contract_version: "1.0".into(),
            implemented_methods: ["GetInfo", "Ingest", "Assemble", "Compact"].map(String::from).to_vec(),
            ..Default::default()
        })
    }
    async fn ingest(&self, _: &CallContext, _: pb::IngestRequest) -> Result<pb::IngestResult, EngineError> {
        Ok(pb::IngestResult { ingested: false })
    }
    async fn assemble(&self, _: &CallContext, req: pb::AssembleRequest) -> Result<pb::AssembleResult, EngineError> {
        let estimated_tokens = ctxgate_engine_sdk::estimate::messages_tokens(&req.messages);
        Ok(pb::AssembleResult { messages: req.messages, estimated_tokens, ..Default::default() })
    }
    async fn compact(
        &self,
        _: &CallContext,
        _: pb::CompactRequest,
        _: Progress,
    ) -> Result<CompactOutcome, EngineError> {
        Ok(CompactOutcome::DelegateToHost(pb::DelegateToHost::default()))
    }
}

/// engine_call's request: 200 messages, a budget that keeps them all.
fn request() -> pb::AssembleRequest {
    let messages = (0..200)
        .map(|i| {
            let text = format!("message {i}: {}", "some words of conversation ".repeat(8));
            if i % 2 == 0 { msg::user(&format!("m{i}"), &text) } else { msg::assistant(&format!("m{i}"), &text) }
        })
        .collect();
    pb::AssembleRequest {
        session_id: "bench".into(),
        session_key: Some("bench".into()),
        messages,
        token_budget: Some(100_000),
        ..Default::default()
    }
}

/// `calls` calls from `concurrency` callers; sorted latencies.
async fn measure(endpoint: &str, concurrency: usize, calls: usize, req: Arc<pb::AssembleRequest>) -> Vec<Duration> {
    let client = ctxgate_runtime::engine_client(ctxgate_runtime::connect(endpoint).unwrap());
    // Warm the connection (and the engine) first.
    for _ in 0..20 {
        let out = client.clone().assemble((*req).clone()).await.unwrap().into_inner();
        assert_eq!(out.messages.len(), 200, "{endpoint} assembles the whole history");
    }
    let per = calls / concurrency;
    let tasks: Vec<_> = (0..concurrency)
        .map(|_| {
            let (client, req) = (client.clone(), req.clone());
            tokio::spawn(async move {
                let mut out = Vec::with_capacity(per);
                for _ in 0..per {
                    let t = Instant::now();
                    client.clone().assemble((*req).clone()).await.unwrap();
                    out.push(t.elapsed());
                }
                out
            })
        })
        .collect();
    let mut all = Vec::with_capacity(calls);
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    all.sort();
    all
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e6
}

fn named(arg: &str) -> (String, String) {
    let (name, value) = arg.split_once('=').unwrap_or_else(|| panic!("expected NAME=VALUE, got {arg:?}"));
    (name.to_owned(), value.to_owned())
}

#[tokio::main]
async fn main() {
    let quick = std::env::var_os("CTXGATE_BENCH_QUICK").is_some();
    let (mut endpoints, mut spawn) = (Vec::new(), Vec::new());
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().unwrap_or_else(|| panic!("{flag} takes NAME=VALUE"));
        match flag.as_str() {
            "--endpoint" => endpoints.push(named(&value)),
            "--spawn" => spawn.push(named(&value)),
            other => panic!("unknown option {other}: expected --endpoint NAME=URL or --spawn NAME=PROGRAM"),
        }
    }
    if endpoints.is_empty() && spawn.is_empty() {
        spawn.push(("python-sdk".into(), repo_root().join("engine-sdk/python/run.sh").display().to_string()));
    }

    let sdk = Server::new(PassThrough).bind(&Endpoint::Tcp(([127, 0, 0, 1], 0).into())).await.unwrap();
    let mut paths = vec![("rust-sdk".to_owned(), format!("http://{}", sdk.local_endpoint()))];
    tokio::spawn(sdk.serve(std::future::pending()));
    let state = tempfile::tempdir().unwrap();
    let mut processes = Vec::new();
    for (name, program) in spawn {
        let dir = state.path().join(&name);
        let args = ["--listen", "127.0.0.1:0", "--state-dir", dir.to_str().unwrap()];
        let engine = EngineProcess::start(&program, &args).await.unwrap();
        paths.push((name, engine.endpoint.clone()));
        processes.push(engine);
    }
    paths.extend(endpoints);

    let req = Arc::new(request());
    println!("Assemble of a 200-message session, one tonic client per engine, latency in µs");
    println!("{:<12} {:>5} {:>10} {:>10} {:>10}", "engine", "conc", "p50", "p99", "calls/s");
    for concurrency in [1usize, 16] {
        let calls = if quick { 16 * 20 } else { 16 * 125 };
        for (name, endpoint) in &paths {
            let started = Instant::now();
            let lat = measure(endpoint, concurrency, calls, req.clone()).await;
            let rate = lat.len() as f64 / started.elapsed().as_secs_f64();
            println!("{name:<12} {concurrency:>5} {:>10.0} {:>10.0} {rate:>10.0}", pct(&lat, 0.5), pct(&lat, 0.99));
        }
    }
    drop(processes);
}
