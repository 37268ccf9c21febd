//! A deliberately broken engine: proof that the conformance kit can fail.
//! It implements the generated service directly (no SDK, so no validation)
//! and breaks the contract on purpose: blank name, a listed method it does
//! not implement, no health or reflection service, non-idempotent ingest,
//! reordered assembly that splits tool pairs, a Compact stream with events
//! after its result, non-idempotent commits, INTERNAL on malformed input,
//! and a hang on oversized content. `--hang-health-check` adds a health
//! service whose Watch is UNIMPLEMENTED and whose Check never answers.

use std::pin::Pin;
use std::time::Duration;

use clap::Parser;
use ctxgate_engine_sdk::pb::{self, content_part::Part, context_engine_server as raw};
use ctxgate_engine_sdk::{Endpoint, ServeArgs};
use tonic::{Request, Response, Status};

struct Broken {
    /// `--honest-info`: a valid GetInfo, so a gateway attaches it (the
    /// fixture for "no health service at all counts as healthy").
    honest_info: bool,
}

type Unary<T> = Result<Response<T>, Status>;
type Events = Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::CompactEvent, Status>> + Send>>;

fn unimplemented<T>() -> Unary<T> {
    Err(Status::unimplemented("broken"))
}

#[tonic::async_trait]
impl raw::ContextEngine for Broken {
    async fn get_info(&self, _: Request<pb::GetInfoRequest>) -> Unary<pb::EngineInfo> {
        if self.honest_info {
            return Ok(Response::new(pb::EngineInfo {
                id: "broken".into(),
                name: "Broken fixture (honest info)".into(),
                contract_version: "1.0".into(),
                implemented_methods: ["GetInfo", "Ingest", "Assemble", "Compact"].map(String::from).to_vec(),
                ..Default::default()
            }));
        }
        Ok(Response::new(pb::EngineInfo {
            id: "broken".into(),
            name: "  ".into(),
            contract_version: "1.0".into(),
            implemented_methods: ["GetInfo", "Ingest", "Assemble", "Compact", "Bootstrap", "CommitTurn"]
                .map(String::from)
                .to_vec(),
            // Claims DELTA, holds nothing, answers no gap.
            history_delivery: pb::HistoryDelivery::Delta as i32,
            ..Default::default()
        }))
    }

    async fn ingest(&self, req: Request<pb::IngestRequest>) -> Unary<pb::IngestResult> {
        let m = req.into_inner().message.unwrap_or_default();
        if m.role > 4 {
            return Err(Status::internal("panic: unknown role"));
        }
        if m.content.iter().any(|p| matches!(&p.part, Some(Part::Text(t)) if t.len() > 1 << 20)) {
            tokio::time::sleep(Duration::from_secs(3600)).await;
        }
        Ok(Response::new(pb::IngestResult { ingested: true }))
    }

    async fn assemble(&self, req: Request<pb::AssembleRequest>) -> Unary<pb::AssembleResult> {
        let mut messages = req.into_inner().messages;
        messages.reverse();
        messages.retain(|m| !m.content.iter().any(|p| matches!(p.part, Some(Part::ToolCall(_)))));
        Ok(Response::new(pb::AssembleResult { messages, estimated_tokens: 0, ..Default::default() }))
    }

    type CompactStream = Events;

    async fn compact(&self, _: Request<pb::CompactRequest>) -> Unary<Events> {
        let progress = || pb::CompactEvent {
            event: Some(pb::compact_event::Event::Progress(pb::CompactProgress {
                stage: "x".into(),
                done: 5,
                total: 1,
                message: String::new(),
            })),
        };
        let result = pb::CompactEvent {
            event: Some(pb::compact_event::Event::Result(pb::CompactResult {
                ok: true,
                compacted: true,
                ..Default::default()
            })),
        };
        Ok(Response::new(Box::pin(tokio_stream::iter([Ok(result), Ok(progress())]))))
    }

    async fn commit_turn(&self, _: Request<pb::CommitTurnRequest>) -> Unary<pb::CommitTurnResult> {
        Ok(Response::new(pb::CommitTurnResult { status: pb::CommitStatus::Committed as i32 }))
    }

    async fn bootstrap(&self, _: Request<pb::BootstrapRequest>) -> Unary<pb::BootstrapResult> {
        unimplemented()
    }
    async fn ingest_batch(&self, _: Request<pb::IngestBatchRequest>) -> Unary<pb::IngestBatchResult> {
        unimplemented()
    }
    async fn after_turn(&self, _: Request<pb::AfterTurnRequest>) -> Unary<pb::AfterTurnResult> {
        unimplemented()
    }
    async fn maintain(&self, _: Request<pb::MaintainRequest>) -> Unary<pb::MaintainResult> {
        unimplemented()
    }
    async fn prepare_subagent_spawn(
        &self,
        _: Request<pb::PrepareSubagentSpawnRequest>,
    ) -> Unary<pb::PrepareSubagentSpawnResult> {
        unimplemented()
    }
    async fn rollback_subagent_spawn(
        &self,
        _: Request<pb::RollbackSubagentSpawnRequest>,
    ) -> Unary<pb::RollbackSubagentSpawnResult> {
        unimplemented()
    }
    async fn on_subagent_ended(&self, _: Request<pb::OnSubagentEndedRequest>) -> Unary<pb::OnSubagentEndedResult> {
        unimplemented()
    }
    async fn dispose(&self, _: Request<pb::DisposeRequest>) -> Unary<pb::DisposeResult> {
        unimplemented()
    }
    async fn forget_session(&self, _: Request<pb::ForgetSessionRequest>) -> Unary<pb::ForgetSessionResult> {
        unimplemented()
    }
}

#[derive(Parser)]
struct Args {
    #[command(flatten)]
    serve: ServeArgs,
    #[arg(long)]
    honest_info: bool,
    #[arg(long)]
    hang_health_check: bool,
}

/// A health service that accepts Check and never answers it.
struct HangingHealth;

#[tonic::async_trait]
impl tonic_health::pb::health_server::Health for HangingHealth {
    async fn check(
        &self,
        _: Request<tonic_health::pb::HealthCheckRequest>,
    ) -> Result<Response<tonic_health::pb::HealthCheckResponse>, Status> {
        std::future::pending().await
    }

    type WatchStream =
        Pin<Box<dyn tokio_stream::Stream<Item = Result<tonic_health::pb::HealthCheckResponse, Status>> + Send>>;

    async fn watch(
        &self,
        _: Request<tonic_health::pb::HealthCheckRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        Err(Status::unimplemented("no watch: poll Check"))
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let Endpoint::Tcp(addr) = args.serve.listen else {
        return Err("the broken fixture listens on TCP only".into());
    };
    let listener = tokio::net::TcpListener::bind(addr).await?;
    println!("listening on {}", listener.local_addr()?);
    let health = args.hang_health_check.then(|| tonic_health::pb::health_server::HealthServer::new(HangingHealth));
    tonic::transport::Server::builder()
        .add_service(
            raw::ContextEngineServer::new(Broken { honest_info: args.honest_info }).max_decoding_message_size(16 << 20),
        )
        .add_optional_service(health)
        .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
        .await?;
    Ok(())
}
