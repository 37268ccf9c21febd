//! A context engine that fails on purpose, for the gateway's hosting tests.
//! Built on the SDK (so health, reflection and validation are real); the
//! faults are chosen with `--fault a,b,…`:
//!
//! - `crash-on-assemble`: the process exits in the middle of Assemble.
//! - `hang`: Assemble and Compact wait until the caller cancels.
//! - `hang-on-tools`: Assemble waits until the caller cancels once the
//!   history holds a tool result (mid tool loop).
//! - `projection`: Assemble asks for thread_bootstrap projection, epoch
//!   "e1" ("e2" once the prompt says "new epoch"), fingerprint "fp".
//! - `garbage`: Assemble answers a tool result without its call.
//! - `oversized`: Assemble answers a ~1 MiB message.
//! - `slow-compact`: Compact streams progress every 50 ms for 1 s.
//! - `progress-flood`: Compact streams 100 000 progress events, each with
//!   a 4 KiB stage, as fast as it can, then a result.
//! - `huge-metadata`: Assemble answers a message with 10 000 metadata
//!   entries (about 2 MiB).
//! - `huge-purpose`: Assemble calls Host.LlmComplete with a 16 MiB purpose,
//!   then with a 1 MiB one, and reports each status code
//!   (`event purpose <16MiB code>,<1MiB code>`).
//! - `compact-fails`: Compact answers INTERNAL.
//! - `needs-threads`: requires the "thread-bootstrap-projection" capability.
//! - `grant-probe`: Assemble tests its grant (own session, another session,
//!   after the call ended).
//! - `trace-probe`: Assemble reports the `traceparent` it got
//!   (`event trace <header>`).
//! - `slow-prepare`: PrepareSubagentSpawn takes 300 ms.
//! - `accepts-nothing`: declares `accepted_host_params = []` and reports
//!   which host params Assemble still received.
//! - `maintain-rewrite`: Maintain replaces the session's first message
//!   (found through the Host service) with the text "rewritten".
//! - `bootstraps`: Bootstrap answers bootstrapped (so Maintain(bootstrap)
//!   follows).
//! - `slow-assemble`: Assemble takes 800 ms (to hold a call in flight).
//! - `settings-probe`: Assemble reports the runtime settings it got (host,
//!   harness, model, budget, max output) and whether its grant allows
//!   llm_complete.
//! - `durable`: declares both transcript semantics and implements
//!   CommitTurn (idempotent per key) and ForgetSession; `commit-fails-first`
//!   makes the first commit answer UNAVAILABLE; `refuse-poison` refuses
//!   (FAILED_PRECONDITION "poison turn") the first two deliveries of every
//!   turn of a session whose key starts with "poison".
//!
//! SIGUSR1 reports NOT_SERVING, SIGUSR2 SERVING. After the `listening on`
//! line it prints `event <what> <detail> <unix µs>` lines the tests read.

use std::collections::HashSet;
use std::io::Write;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::Parser;
use ctxgate_engine_sdk::pb::{self, host_client::HostClient};
use ctxgate_engine_sdk::proto::Method;
use ctxgate_engine_sdk::testkit::msg;
use ctxgate_engine_sdk::{CallContext, CompactOutcome, ContextEngine, EngineError, Progress, ServeArgs, Server};
use tonic_health::ServingStatus;

#[derive(Parser)]
struct Args {
    #[command(flatten)]
    serve: ServeArgs,
    /// Comma-separated faults (see the file's docs).
    #[arg(long, default_value = "")]
    fault: String,
}

fn now_us() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros())
}

fn event(what: &str, detail: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "event {what} {detail} {}", now_us());
    let _ = out.flush();
}

struct Fault {
    faults: HashSet<String>,
    committed: std::sync::Mutex<HashSet<String>>,
    commits_tried: std::sync::atomic::AtomicU32,
    /// Deliveries seen per advancement key (`refuse-poison`).
    deliveries: std::sync::Mutex<std::collections::HashMap<String, u32>>,
}

impl Fault {
    fn has(&self, f: &str) -> bool {
        self.faults.contains(f)
    }
}

/// Never answers. A watcher spawned on the call's token reports when the
/// cancel arrives (the SDK drops the method's own future at that moment).
async fn hang(ctx: &CallContext, method: &'static str) -> EngineError {
    let token = ctx.cancellation().clone();
    tokio::spawn(async move {
        token.cancelled().await;
        event("cancelled", method);
    });
    std::future::pending::<()>().await;
    EngineError::Cancelled
}

async fn probe_grants(ctx: &CallContext, session_id: &str, access: Option<pb::HostAccess>) {
    let Some(host) = ctx.host() else {
        event("grant", "none");
        return;
    };
    let own =
        host.read_transcript(ctx, false).await.map(|e| e.len().to_string()).unwrap_or_else(|e| format!("error:{e}"));
    event("grant-own", &own);
    // Forge a request for another session with the same token.
    let Some(access) = access else { return };
    // The forgeries go plaintext (a TLS host is probed for its own grant only).
    let Ok(channel) = ctxgate_engine_sdk::connect(&access.endpoint) else { return };
    let mut raw = HostClient::new(channel);
    let token = access.grant.map(|g| g.token).unwrap_or_default();
    let other = pb::ReadTranscriptRequest {
        grant: token.clone(),
        session_id: format!("{session_id}-other"),
        ..Default::default()
    };
    let code = match raw.read_transcript(other).await {
        Ok(_) => "ok".to_owned(),
        Err(s) => format!("{:?}", s.code()),
    };
    event("grant-other", &code);
    // Keep the token and try again once the call is over.
    let session_id = session_id.to_owned();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let late = pb::ReadTranscriptRequest { grant: token, session_id, ..Default::default() };
        let code = match raw.read_transcript(late).await {
            Ok(_) => "ok".to_owned(),
            Err(s) => format!("{:?}", s.code()),
        };
        event("grant-after", &code);
    });
}

/// A compaction result: 100 tokens became 10.
fn compacted(summary: &str) -> CompactOutcome {
    CompactOutcome::Done(pb::CompactResult {
        ok: true,
        compacted: true,
        summary: Some(summary.into()),
        tokens_before: 100,
        tokens_after: Some(10),
        ..Default::default()
    })
}

/// Asks the host for a completion with a 16 MiB purpose, then a 1 MiB one.
async fn huge_purposes(access: Option<pb::HostAccess>) {
    let Some(access) = access else {
        event("purpose", "no-host");
        return;
    };
    // The forgeries go plaintext (a TLS host is probed for its own grant only).
    let Ok(channel) = ctxgate_engine_sdk::connect(&access.endpoint) else { return };
    let mut raw = HostClient::new(channel);
    let token = access.grant.map(|g| g.token).unwrap_or_default();
    let mut codes = Vec::new();
    for size in [16 * 1024 * 1024, 1024 * 1024] {
        let req = pb::LlmCompleteRequest {
            grant: token.clone(),
            messages: vec![pb::LlmMessage { role: "user".into(), content: "hi".into() }],
            purpose: "p".repeat(size),
            ..Default::default()
        };
        codes.push(match raw.llm_complete(req).await {
            Ok(_) => "ok".to_owned(),
            Err(s) => format!("{:?}", s.code()),
        });
    }
    event("purpose", &codes.join(","));
}

impl ContextEngine for Fault {
    async fn get_info(&self, _ctx: &CallContext) -> Result<pb::EngineInfo, EngineError> {
        let host_requirements = if self.has("needs-threads") {
            vec![pb::HostRequirement {
                operation: "agent-run".into(),
                required_capabilities: vec!["thread-bootstrap-projection".into()],
                unsupported_message: Some("Run it under a harness with persistent threads.".into()),
            }]
        } else {
            vec![]
        };
        let mut methods =
            vec!["GetInfo", "Ingest", "Assemble", "Compact", "PrepareSubagentSpawn", "RollbackSubagentSpawn"];
        if self.has("maintain-rewrite") {
            methods.push("Maintain");
        }
        if self.has("bootstraps") {
            methods.push("Bootstrap");
        }
        let transcript_semantics = self.has("durable").then(|| {
            methods.extend(["CommitTurn", "ForgetSession"]);
            pb::TranscriptSemantics {
                current_turn_fence: pb::CurrentTurnFence::BeforeCurrentTurnEntryV1 as i32,
                turn_advancement_idempotency: pb::TurnAdvancementIdempotency::AtomicIdempotentV1 as i32,
            }
        });
        Ok(pb::EngineInfo {
            id: "fault".into(),
            name: "Fault fixture".into(),
            version: "0".into(),
            contract_version: "1.0".into(),
            accepted_host_params: self.has("accepts-nothing").then(pb::AcceptedHostParams::default),
            transcript_semantics,
            host_requirements,
            implemented_methods: methods.into_iter().map(String::from).collect(),
            ..Default::default()
        })
    }

    async fn bootstrap(
        &self,
        _ctx: &CallContext,
        req: pb::BootstrapRequest,
    ) -> Result<pb::BootstrapResult, EngineError> {
        if !self.has("bootstraps") {
            return Err(EngineError::Unimplemented(Method::Bootstrap));
        }
        event("bootstrap", &req.session_id);
        Ok(pb::BootstrapResult { bootstrapped: true, ..Default::default() })
    }

    async fn ingest(&self, _ctx: &CallContext, _req: pb::IngestRequest) -> Result<pb::IngestResult, EngineError> {
        Ok(pb::IngestResult { ingested: true })
    }

    async fn assemble(&self, ctx: &CallContext, req: pb::AssembleRequest) -> Result<pb::AssembleResult, EngineError> {
        event("assemble", &req.session_id);
        if self.has("trace-probe") {
            let t = ctx.trace().map_or_else(|| "none".to_owned(), ToString::to_string);
            event("trace", &t);
        }
        if self.has("crash-on-assemble") {
            std::process::exit(3);
        }
        if self.has("hang") {
            return Err(hang(ctx, "Assemble").await);
        }
        if self.has("slow-assemble") {
            tokio::time::sleep(Duration::from_millis(800)).await;
        }
        let has_tool_result = req
            .messages
            .iter()
            .any(|m| m.content.iter().any(|p| matches!(p.part, Some(pb::content_part::Part::ToolResult(_)))));
        if self.has("hang-on-tools") && has_tool_result {
            return Err(hang(ctx, "Assemble").await);
        }
        let projection = self.has("projection").then(|| pb::ContextProjection {
            mode: pb::ProjectionMode::ThreadBootstrap as i32,
            epoch: Some(
                if req.prompt.as_deref().unwrap_or_default().contains("new epoch") { "e2" } else { "e1" }.into(),
            ),
            fingerprint: Some("fp".into()),
        });
        if self.has("accepts-nothing") {
            let got = |b: bool| if b { "yes" } else { "no" };
            let seen = format!(
                "key={} prompt={} settings={} context={} host={}",
                got(req.session_key.is_some()),
                got(req.prompt.is_some()),
                got(req.runtime_settings.is_some()),
                got(req.runtime_context.is_some()),
                got(req.host.is_some())
            );
            event("params", &seen);
        }
        if self.has("settings-probe") {
            let rs = req.runtime_settings.clone().unwrap_or_default();
            let host = rs.execution_host.and_then(|h| h.id).unwrap_or_default();
            let harness = rs.runtime.and_then(|r| r.harness_id).unwrap_or_default();
            let model = rs.model.and_then(|m| m.resolved).unwrap_or_default();
            let limits = rs.limits.unwrap_or_default();
            let llm = req
                .host
                .as_ref()
                .and_then(|h| h.grant.as_ref())
                .is_some_and(|g| g.operations.iter().any(|o| o == "llm_complete"));
            let seen = format!(
                "host={host} harness={harness} model={model} budget={} max_output={} llm={llm}",
                limits.prompt_token_budget.unwrap_or_default(),
                limits.max_output_tokens.unwrap_or_default()
            );
            event("settings", &seen);
        }
        if self.has("grant-probe") {
            probe_grants(ctx, &req.session_id, req.host.clone()).await;
        }
        if self.has("huge-purpose") {
            huge_purposes(req.host.clone()).await;
        }
        let mut messages = req.messages;
        if self.has("garbage") {
            messages.insert(0, msg::tool_result("orphan", "no-such-call", "?"));
        }
        if self.has("oversized") {
            messages.push(msg::assistant("huge", &"x".repeat(1_000_000)));
        }
        if self.has("huge-metadata") {
            let mut m = msg::assistant("meta", "look at my metadata");
            m.metadata = (0..10_000).map(|i| (format!("key-{i}"), "v".repeat(200))).collect();
            messages.push(m);
        }
        Ok(pb::AssembleResult {
            estimated_tokens: ctxgate_engine_sdk::estimate::messages_tokens(&messages),
            messages,
            projection,
            ..Default::default()
        })
    }

    async fn commit_turn(
        &self,
        _ctx: &CallContext,
        req: pb::CommitTurnRequest,
    ) -> Result<pb::CommitTurnResult, EngineError> {
        if !self.has("durable") {
            return Err(EngineError::Unimplemented(Method::CommitTurn));
        }
        let n = self.commits_tried.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if n == 0 && self.has("commit-fails-first") {
            event("commit-refused", &req.advancement_key);
            return Err(EngineError::Host {
                operation: "CommitTurn",
                status: tonic::Status::unavailable("backend down"),
            });
        }
        if self.has("refuse-poison") && req.session_key.as_deref().is_some_and(|k| k.starts_with("poison")) {
            let mut seen = self.deliveries.lock().unwrap_or_else(|e| e.into_inner());
            let n = seen.entry(req.advancement_key.clone()).or_default();
            *n += 1;
            if *n <= 2 {
                event("commit-refused", &req.advancement_key);
                return Err(EngineError::FailedPrecondition("poison turn".into()));
            }
        }
        let fresh = self.committed.lock().unwrap_or_else(|e| e.into_inner()).insert(req.advancement_key.clone());
        let terminal = req.terminal.as_ref().map(|t| t.entry_id.clone()).unwrap_or_default();
        let last = req.messages.last().map(|m| m.id.clone()).unwrap_or_default();
        event(
            "commit",
            &format!("{} messages={} terminal_is_last={}", req.advancement_key, req.messages.len(), terminal == last),
        );
        let status = if fresh { pb::CommitStatus::Committed } else { pb::CommitStatus::Duplicate };
        Ok(pb::CommitTurnResult { status: status as i32 })
    }

    async fn forget_session(
        &self,
        _ctx: &CallContext,
        req: pb::ForgetSessionRequest,
    ) -> Result<pb::ForgetSessionResult, EngineError> {
        if !self.has("durable") {
            return Err(EngineError::Unimplemented(Method::ForgetSession));
        }
        event("forget", &req.session_id);
        Ok(pb::ForgetSessionResult {})
    }

    async fn maintain(&self, ctx: &CallContext, req: pb::MaintainRequest) -> Result<pb::MaintainResult, EngineError> {
        if !self.has("maintain-rewrite") {
            return Err(EngineError::Unimplemented(Method::Maintain));
        }
        let Some(host) = ctx.host() else { return Ok(pb::MaintainResult::default()) };
        let entries = host.read_transcript(ctx, false).await?;
        let first = entries.into_iter().find_map(|e| match e.entry {
            Some(pb::transcript_entry::Entry::Message(m)) if msg::text_of(&m) != "rewritten" => Some(m),
            _ => None,
        });
        let Some(first) = first else { return Ok(pb::MaintainResult::default()) };
        event("maintain", &req.session_id);
        let new = msg::user(&first.id, "rewritten");
        Ok(pb::MaintainResult {
            replacements: vec![pb::TranscriptReplacement { entry_id: first.id.clone(), message: Some(new) }],
            changed: true,
            ..Default::default()
        })
    }

    async fn prepare_subagent_spawn(
        &self,
        _ctx: &CallContext,
        req: pb::PrepareSubagentSpawnRequest,
    ) -> Result<pb::PrepareSubagentSpawnResult, EngineError> {
        event("prepare", &req.child_session_key);
        if self.has("slow-prepare") {
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        Ok(pb::PrepareSubagentSpawnResult {
            prepared: true,
            rollback_token: Some(format!("tok-{}", req.child_session_key)),
        })
    }

    async fn rollback_subagent_spawn(
        &self,
        _ctx: &CallContext,
        req: pb::RollbackSubagentSpawnRequest,
    ) -> Result<pb::RollbackSubagentSpawnResult, EngineError> {
        event("rollback", &req.rollback_token);
        Ok(pb::RollbackSubagentSpawnResult {})
    }

    async fn compact(
        &self,
        ctx: &CallContext,
        _req: pb::CompactRequest,
        progress: Progress,
    ) -> Result<CompactOutcome, EngineError> {
        if self.has("hang") {
            return Err(hang(ctx, "Compact").await);
        }
        if self.has("compact-fails") {
            return Err(EngineError::Internal("compaction exploded".into()));
        }
        if self.has("progress-flood") {
            let stage = "s".repeat(4096);
            for i in 0..100_000 {
                progress.report(&stage, i, 100_000, "flood").await?;
            }
            return Ok(compacted("flood summary"));
        }
        if self.has("slow-compact") {
            for i in 0..20 {
                progress.report("thinking", i, 20, format!("step {i}")).await?;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            return Ok(compacted("fault summary"));
        }
        Ok(CompactOutcome::DelegateToHost(pb::DelegateToHost {
            reason: Some("built-in is fine".into()),
            custom_instructions: None,
        }))
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let faults = args.fault.split(',').filter(|f| !f.is_empty()).map(str::to_owned).collect();
    let fault = Fault {
        faults,
        committed: Default::default(),
        commits_tried: Default::default(),
        deliveries: Default::default(),
    };
    let bound =
        Server::new(fault).options(&args.serve)?.drain_timeout(Duration::from_secs(1)).bind(&args.serve.listen).await?;
    println!("listening on {}", bound.local_endpoint());
    std::io::stdout().flush()?;
    let reporter = bound.health_reporter();
    tokio::spawn(async move {
        use tokio::signal::unix::{SignalKind, signal};
        let (Ok(mut down), Ok(mut up)) = (signal(SignalKind::user_defined1()), signal(SignalKind::user_defined2()))
        else {
            return;
        };
        loop {
            let status = tokio::select! {
                _ = down.recv() => ServingStatus::NotServing,
                _ = up.recv() => ServingStatus::Serving,
            };
            reporter.set_service_status(ctxgate_engine_sdk::proto::ENGINE_SERVICE, status).await;
            reporter.set_service_status("", status).await;
            event("health", &format!("{status:?}"));
        }
    });
    bound.serve(ctxgate_engine_sdk::shutdown_signal()).await?;
    Ok(())
}
