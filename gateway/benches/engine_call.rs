//! `cargo bench -p ctxgate --bench engine_call`: what the gateway adds to
//! one engine call. Assemble of a 200-message session, side by side in one
//! run, at 1, 16 and 64 concurrent callers:
//!
//! - **gateway**: the gateway's engine stack (guarded remote client: host
//!   params projection, deadline, own task, reply validation, metrics) to an
//!   SDK engine;
//! - **replicas**: the same stack over three SDK engines named by one
//!   `ipv4:` endpoint (a replica set: a pick per call, power of two
//!   choices for this engine, which keeps no session state);
//! - **direct**: a plain tonic client to the same SDK engine;
//! - **echo**: a plain tonic client to a bare tonic service that echoes the
//!   messages (no SDK: transport and codec only).
//!
//! Set `CTXGATE_BENCH_QUICK=1` for a short smoke run.

#![allow(clippy::unwrap_used)] // a benchmark fails loudly

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ctxgate::config::EngineEntry;
use ctxgate::engines::guarded::Guarded;
use ctxgate::engines::remote::Remote;
use ctxgate::engines::replicas::Replicas;
use ctxgate::engines::{Call, Engine, Legacy};
use ctxgate::metrics::Metrics;
use ctxgate_engine_sdk::testkit::msg;
use ctxgate_engine_sdk::{CallContext, CompactOutcome, ContextEngine, Endpoint, EngineError, Progress, Server};
use ctxgate_proto::pb::{self, context_engine_client::ContextEngineClient, context_engine_server as raw};
use tonic::{Request, Response, Status};

/// The engine behind "gateway" and "direct": assemble returns the history.
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
        let estimated_tokens = ctxgate_proto::estimate::messages_tokens(&req.messages);
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

/// The bare tonic echo: no SDK, no validation.
struct Echo;

type U<T> = Result<Response<T>, Status>;
type Events = Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::CompactEvent, Status>> + Send>>;

#[tonic::async_trait]
impl raw::ContextEngine for Echo {
    async fn assemble(&self, req: Request<pb::AssembleRequest>) -> U<pb::AssembleResult> {
        Ok(Response::new(pb::AssembleResult {
            messages: req.into_inner().messages,
            estimated_tokens: 1,
            ..Default::default()
        }))
    }
    type CompactStream = Events;
    async fn compact(&self, _: Request<pb::CompactRequest>) -> U<Events> {
        Err(Status::unimplemented("echo"))
    }
    async fn get_info(&self, _: Request<pb::GetInfoRequest>) -> U<pb::EngineInfo> {
        Err(Status::unimplemented("echo"))
    }
    async fn bootstrap(&self, _: Request<pb::BootstrapRequest>) -> U<pb::BootstrapResult> {
        Err(Status::unimplemented("echo"))
    }
    async fn ingest(&self, _: Request<pb::IngestRequest>) -> U<pb::IngestResult> {
        Err(Status::unimplemented("echo"))
    }
    async fn ingest_batch(&self, _: Request<pb::IngestBatchRequest>) -> U<pb::IngestBatchResult> {
        Err(Status::unimplemented("echo"))
    }
    async fn after_turn(&self, _: Request<pb::AfterTurnRequest>) -> U<pb::AfterTurnResult> {
        Err(Status::unimplemented("echo"))
    }
    async fn commit_turn(&self, _: Request<pb::CommitTurnRequest>) -> U<pb::CommitTurnResult> {
        Err(Status::unimplemented("echo"))
    }
    async fn maintain(&self, _: Request<pb::MaintainRequest>) -> U<pb::MaintainResult> {
        Err(Status::unimplemented("echo"))
    }
    async fn prepare_subagent_spawn(
        &self,
        _: Request<pb::PrepareSubagentSpawnRequest>,
    ) -> U<pb::PrepareSubagentSpawnResult> {
        Err(Status::unimplemented("echo"))
    }
    async fn rollback_subagent_spawn(
        &self,
        _: Request<pb::RollbackSubagentSpawnRequest>,
    ) -> U<pb::RollbackSubagentSpawnResult> {
        Err(Status::unimplemented("echo"))
    }
    async fn on_subagent_ended(&self, _: Request<pb::OnSubagentEndedRequest>) -> U<pb::OnSubagentEndedResult> {
        Err(Status::unimplemented("echo"))
    }
    async fn dispose(&self, _: Request<pb::DisposeRequest>) -> U<pb::DisposeResult> {
        Err(Status::unimplemented("echo"))
    }
    async fn forget_session(&self, _: Request<pb::ForgetSessionRequest>) -> U<pb::ForgetSessionResult> {
        Err(Status::unimplemented("echo"))
    }
    async fn call_tool(&self, _: Request<pb::CallToolRequest>) -> U<pb::CallToolResult> {
        Err(Status::unimplemented("echo"))
    }
}

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

/// Runs `calls` calls from `concurrency` callers; returns sorted latencies.
async fn measure<F, Fut>(concurrency: usize, calls: usize, f: F) -> Vec<Duration>
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let f = Arc::new(f);
    let per = calls / concurrency;
    let tasks: Vec<_> = (0..concurrency)
        .map(|_| {
            let f = f.clone();
            tokio::spawn(async move {
                let mut out = Vec::with_capacity(per);
                for _ in 0..per {
                    let t = Instant::now();
                    f().await;
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

#[tokio::main]
async fn main() {
    let quick = std::env::var_os("CTXGATE_BENCH_QUICK").is_some();
    let loopback = Endpoint::Tcp(([127, 0, 0, 1], 0).into());

    let sdk = Server::new(PassThrough).bind(&loopback).await.unwrap();
    let sdk_url = format!("http://{}", sdk.local_endpoint());
    tokio::spawn(sdk.serve(std::future::pending()));

    let echo_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let echo_url = format!("http://{}", echo_listener.local_addr().unwrap());
    let incoming = tonic::transport::server::TcpIncoming::from(echo_listener).with_nodelay(Some(true));
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(raw::ContextEngineServer::new(Echo))
            .serve_with_incoming(incoming),
    );

    let entry = EngineEntry { endpoint: sdk_url.as_str().into(), ..EngineEntry::default() };
    let at = entry.target().unwrap().by_name();
    let remote = Remote::new("bench", &entry, Duration::from_secs(180), &at, None).unwrap();
    let guarded = Arc::new(Guarded::new(
        remote,
        Arc::new(Legacy::default()),
        Metrics::default(),
        entry.max_concurrent_calls,
        true,
    ));
    guarded.remote.attach(&Call::default()).await.unwrap();
    guarded.readmit("bench start");

    // Three more engines, one replica set.
    let mut addrs = Vec::new();
    for _ in 0..3 {
        let s = Server::new(PassThrough).bind(&loopback).await.unwrap();
        addrs.push(s.local_endpoint().to_string());
        tokio::spawn(s.serve(std::future::pending()));
    }
    let set_entry = EngineEntry { endpoint: format!("ipv4:{}", addrs.join(",")).into(), ..EngineEntry::default() };
    let stop = tokio_util::sync::CancellationToken::new();
    let legacy = Arc::new(Legacy::default());
    let replicas =
        Replicas::start("bench", &set_entry, Duration::from_secs(180), legacy, Metrics::default(), stop.clone())
            .unwrap();
    while replicas.replicas().iter().any(|r| r.guarded.is_quarantined()) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    let direct = ctxgate_runtime::engine_client(ctxgate_runtime::connect(&sdk_url).unwrap());
    let echo = ContextEngineClient::new(ctxgate_runtime::connect(&echo_url).unwrap())
        .max_decoding_message_size(16 << 20)
        .max_encoding_message_size(16 << 20);
    let req = Arc::new(request());
    println!(
        "engine call cost: Assemble of a 200-message session ({} KiB), latency in µs",
        prost::Message::encoded_len(&*req) / 1024
    );
    println!("{:<8} {:>5} {:>10} {:>10} {:>10}", "path", "conc", "p50", "p99", "calls/s");
    for concurrency in [1usize, 16, 64] {
        let calls = if quick {
            64 * 4
        } else if concurrency == 1 {
            2_000
        } else {
            6_400
        };
        for path in ["echo", "direct", "gateway", "replicas"] {
            let started = Instant::now();
            let lat = match path {
                "echo" => {
                    let (c, r) = (echo.clone(), req.clone());
                    measure(concurrency, calls, move || {
                        let (mut c, r) = (c.clone(), (*r).clone());
                        async move {
                            c.assemble(r).await.unwrap();
                        }
                    })
                    .await
                }
                "direct" => {
                    let (c, r) = (direct.clone(), req.clone());
                    measure(concurrency, calls, move || {
                        let (mut c, r) = (c.clone(), (*r).clone());
                        async move {
                            c.assemble(r).await.unwrap();
                        }
                    })
                    .await
                }
                "replicas" => {
                    let (g, r) = (replicas.clone(), req.clone());
                    measure(concurrency, calls, move || {
                        let (g, r) = (g.clone(), (*r).clone());
                        async move {
                            g.assemble(r, &Call::default()).await.unwrap();
                        }
                    })
                    .await
                }
                _ => {
                    let (g, r) = (guarded.clone(), req.clone());
                    measure(concurrency, calls, move || {
                        let (g, r) = (g.clone(), (*r).clone());
                        async move {
                            g.assemble(r, &Call::default()).await.unwrap();
                        }
                    })
                    .await
                }
            };
            let rate = lat.len() as f64 / started.elapsed().as_secs_f64();
            println!("{path:<8} {concurrency:>5} {:>10.0} {:>10.0} {rate:>10.0}", pct(&lat, 0.5), pct(&lat, 0.99));
        }
    }
    assert!(guarded.quarantine_record().is_none(), "the benchmark must not fail calls");
    assert!(replicas.replicas().iter().all(|r| !r.guarded.is_quarantined()), "nor through the replicas");
    let spread: Vec<u64> =
        replicas.replicas().iter().map(|r| r.guarded.stats().values().map(|s| s.calls).sum()).collect();
    println!("replica calls: {spread:?}");
    stop.cancel();
}
