//! The raw gRPC client of one remote engine: deadlines (method default cut
//! to the caller's time, sent as `grpc-timeout` and enforced here too),
//! cancellation, host-param projection, and validation of every reply. Each
//! call runs in its own task, so even a panic inside tonic on a malformed
//! reply is one failed call, never a crashed gateway.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use ctxgate_proto::pb::{self, compact_event::Event, context_engine_client::ContextEngineClient};
use ctxgate_proto::{Method, validate};
use ctxgate_runtime::AbortOnDrop;
use tokio::time::Instant;
use tokio_stream::StreamExt;
use tonic::transport::Channel;
use tonic::{Code, Request, Status};

use super::{Call, CompactReply, EngineCallError, LEGACY_ID, ProgressFn};
use crate::config::{DEFAULT_ENGINE_TIMEOUT_SECONDS, DEFAULT_TIMEOUT_KEY, EngineEntry};

/// `timeouts.callTool` when the entry sets none.
pub const DEFAULT_CALL_TOOL_TIMEOUT: Duration = Duration::from_secs(120);

/// One remote engine's connection and settings.
pub struct Remote {
    pub id: String,
    pub endpoint: String,
    client: Client,
    channel: Channel,
    timeouts: BTreeMap<Method, Duration>,
    default_timeout: Duration,
    /// The info from the last successful attach (GetInfo).
    /// Shared: every call and every turn's lease reads it.
    info: RwLock<Option<Arc<pb::EngineInfo>>>,
    /// Where each traced call's span goes (`gateway.otlp`).
    spans: Option<ctxgate_runtime::otlp::Exporter>,
}

/// A status as the call's failure. tonic reports its own expired timeout as
/// CANCELLED "Timeout expired": that is a deadline, not an abort.
fn failure(method: Method, s: Status, timeout: Duration) -> EngineCallError {
    // Typed, never guessed from the text.
    if let Some(gap) = ctxgate_proto::history::gap_of(&s) {
        return EngineCallError::HistoryGap { method, held: gap.held };
    }
    match s.code() {
        Code::DeadlineExceeded => EngineCallError::DeadlineExceeded { method, after: timeout },
        Code::Cancelled if s.message() == "Timeout expired" => {
            EngineCallError::DeadlineExceeded { method, after: timeout }
        }
        Code::Unimplemented => EngineCallError::Unimplemented(method),
        // Overload, not breakage: gRPC's retry pushback marks a busy server.
        // Without it RESOURCE_EXHAUSTED is usually "too large", which fails
        // again on every retry, so it stays a failure.
        Code::ResourceExhausted | Code::Unavailable if s.metadata().contains_key("grpc-retry-pushback-ms") => {
            EngineCallError::Overloaded { method, detail: detail(&s) }
        }
        code => EngineCallError::Failed { method, code, detail: detail(&s) },
    }
}

/// An engine's status message, capped before it is logged or stored.
fn detail(s: &Status) -> String {
    capped(s.message(), 500)
}

use crate::peer_text::capped;

/// The engine client: every request carries the trace of the call it
/// belongs to.
type Client = ContextEngineClient<tonic::service::interceptor::InterceptedService<Channel, Propagate>>;

tokio::task_local! {
    /// The trace of the engine call running in this task (see `run`).
    static TRACE: Option<ctxgate_proto::trace::TraceParent>;
}

/// Adds `traceparent` (the engine call's own span, see [`Remote::hop`]) to
/// each request made inside a traced call's task.
#[derive(Clone, Copy)]
struct Propagate;

impl tonic::service::Interceptor for Propagate {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Ok(Some(t)) = TRACE.try_with(|t| *t)
            && let Ok(v) = t.to_string().parse()
        {
            req.metadata_mut().insert(ctxgate_proto::trace::HEADER, v);
        }
        Ok(req)
    }
}

/// Compaction progress as relayed to clients: short fields only.
fn capped_progress(p: pb::CompactProgress) -> pb::CompactProgress {
    pb::CompactProgress { stage: capped(&p.stage, 64), message: capped(&p.message, 1024), ..p }
}

fn violation(method: Method, v: impl std::fmt::Display) -> EngineCallError {
    EngineCallError::ContractViolation { method, detail: v.to_string() }
}

impl Remote {
    /// The client of the engine `entry` configures, at one of its
    /// addresses (`at`: the endpoint itself, or one replica of it).
    pub fn new(
        id: &str,
        entry: &EngineEntry,
        compact_timeout: Duration,
        at: &ctxgate_runtime::Endpoint,
        spans: Option<ctxgate_runtime::otlp::Exporter>,
    ) -> Result<Self, String> {
        let channel = if entry.uses_tls() {
            let files = entry.client_tls(id).map_err(|e| e.to_string())?;
            ctxgate_runtime::tls_channel(at, ctxgate_runtime::tls::client_config(&files)?)?
        } else {
            ctxgate_runtime::channel(at)
        };
        let client = ContextEngineClient::with_interceptor(channel.clone(), Propagate)
            .max_decoding_message_size(entry.max_message_bytes)
            .max_encoding_message_size(ctxgate_proto::limits::MAX_GRPC_MESSAGE_BYTES);
        let seconds = |key: &str| entry.timeouts.get(key).map(|v| Duration::from_secs_f64(*v));
        let mut timeouts: BTreeMap<Method, Duration> =
            Method::ALL.into_iter().filter_map(|m| Some((m, seconds(m.config_key())?))).collect();
        timeouts.entry(Method::Compact).or_insert(compact_timeout);
        // Delegated expansion (a tool calling the host's model) takes tens
        // of seconds: lossless-claw's runs 30–150 s.
        timeouts.entry(Method::CallTool).or_insert(DEFAULT_CALL_TOOL_TIMEOUT);
        let default_timeout =
            seconds(DEFAULT_TIMEOUT_KEY).unwrap_or(Duration::from_secs_f64(DEFAULT_ENGINE_TIMEOUT_SECONDS));
        Ok(Self {
            id: id.to_owned(),
            endpoint: at.to_string(),
            client,
            channel,
            timeouts,
            default_timeout,
            info: RwLock::new(None),
            spans,
        })
    }

    /// A traced call's own span: the turn's trace, a new span id (sent on
    /// as the engine's parent).
    fn hop(call: &Call) -> Option<ctxgate_proto::trace::TraceParent> {
        call.trace.map(|t| t.child())
    }

    /// Exports the span of a traced call that started at `start`.
    fn span<T>(
        &self,
        method: Method,
        call: &Call,
        hop: Option<ctxgate_proto::trace::TraceParent>,
        start: std::time::SystemTime,
        r: &Result<T, EngineCallError>,
    ) {
        let (Some(spans), Some(this)) = (&self.spans, hop) else { return };
        spans.record(ctxgate_runtime::otlp::Span {
            name: format!("{}/{method}", ctxgate_proto::ENGINE_SERVICE),
            kind: ctxgate_runtime::otlp::Kind::Client,
            this,
            parent: call.trace.map(|t| t.parent_id),
            start,
            end: std::time::SystemTime::now(),
            attributes: vec![
                ("rpc.system", "grpc".into()),
                ("rpc.method", method.name().into()),
                ("ctxgate.engine", self.id.clone()),
                ("server.address", self.endpoint.clone()),
            ],
            error: r.as_ref().err().map(ToString::to_string),
        });
    }

    /// The engine's channel (shared connection), for health checks.
    pub fn channel(&self) -> Channel {
        self.channel.clone()
    }

    /// The info from the last attach, if any.
    pub fn info(&self) -> Option<Arc<pb::EngineInfo>> {
        self.info.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The method's timeout cut to the caller's deadline.
    fn budget(&self, method: Method, call: &Call) -> Duration {
        let own = self.timeouts.get(&method).copied().unwrap_or(self.default_timeout);
        match call.deadline {
            Some(d) => own.min(d.saturating_duration_since(Instant::now())),
            None => own,
        }
    }

    /// Runs `f` in its own task under the call's deadline and cancellation.
    async fn run<T, F>(
        &self,
        method: Method,
        call: &Call,
        f: impl FnOnce(Client, Duration) -> F,
    ) -> Result<T, EngineCallError>
    where
        T: Send + 'static,
        F: Future<Output = Result<T, EngineCallError>> + Send + 'static,
    {
        if call.cancel.is_cancelled() {
            return Err(EngineCallError::Cancelled);
        }
        let timeout = self.budget(method, call);
        // One span per engine call, carried into its task.
        let span =
            tracing::debug_span!("engine_call", engine = %self.id, %method, timeout_ms = timeout.as_millis() as u64);
        let (hop, start) = (Self::hop(call), std::time::SystemTime::now());
        let work = TRACE.scope(hop, f(self.client.clone(), timeout));
        let task = tokio::spawn(tracing::Instrument::instrument(work, span));
        let _abort = AbortOnDrop(task.abort_handle());
        let r = tokio::select! {
            r = tokio::time::timeout(timeout, task) => match r {
                Err(_) => Err(EngineCallError::DeadlineExceeded { method, after: timeout }),
                Ok(Ok(r)) => r,
                Ok(Err(e)) if e.is_panic() => Err(EngineCallError::Failed { method, code: Code::Internal, detail: "the client task panicked on the engine's reply".into() }),
                Ok(Err(_)) => Err(EngineCallError::Cancelled),
            },
            () = call.cancel.cancelled() => Err(EngineCallError::Cancelled),
        };
        self.span(method, call, hop, start, &r);
        r
    }

    /// GetInfo plus contract validation; on success the info is kept.
    pub async fn attach(&self, call: &Call) -> Result<pb::EngineInfo, EngineCallError> {
        let info = self
            .run(Method::GetInfo, call, |mut c, t| async move {
                let mut req = Request::new(pb::GetInfoRequest {});
                req.set_timeout(t);
                c.get_info(req).await.map(tonic::Response::into_inner).map_err(|s| failure(Method::GetInfo, s, t))
            })
            .await?;
        validate::result::info(&info).map_err(|v| violation(Method::GetInfo, v))?;
        if info.id.trim() == LEGACY_ID {
            return Err(violation(Method::GetInfo, "info.id: \"legacy\" is reserved for the gateway's own engine"));
        }
        if info.id != self.id {
            // The entry id names it in the gateway; the declared one only in status.
            tracing::info!(engine = %self.id, declared = %info.id, "the engine declares another id than its entry's; the gateway names it by its entry");
        }
        *self.info.write().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(info.clone()));
        Ok(info)
    }

    fn accepted(&self) -> Option<Vec<String>> {
        self.info().and_then(|i| i.accepted_host_params.as_ref().map(|a| a.params.clone()))
    }
}

/// Host params an engine did not accept are cleared before sending
/// (OpenClaw's `acceptedHostParams` projection). Unset = every param.
macro_rules! project {
    ($req:expr, $accepted:expr, [$($param:ident),*]) => {
        if let Some(accepted) = $accepted {
            $(
                if !accepted.iter().any(|a| a == stringify!($param)) {
                    $req.$param = Default::default();
                }
            )*
        }
    };
}

/// One unary engine method: project, send with the deadline, validate.
macro_rules! unary {
    ($name:ident, $rpc:ident, $method:expr, $Req:ty, $Res:ty, [$($param:ident),*], $check:expr) => {
        #[allow(unused_mut, unused_variables)]
        pub async fn $name(&self, mut req: $Req, call: &Call) -> Result<$Res, EngineCallError> {
            project!(req, self.accepted(), [$($param),*]);
            let r = self
                .run($method, call, |mut c, t| async move {
                    let mut r = Request::new(req);
                    r.set_timeout(t);
                    c.$rpc(r).await.map(tonic::Response::into_inner).map_err(|s| failure($method, s, t))
                })
                .await?;
            let check: fn(&$Res) -> validate::Result = $check;
            check(&r).map_err(|v| violation($method, v))?;
            Ok(r)
        }
    };
}

fn ok<T>(_: &T) -> validate::Result {
    Ok(())
}

impl Remote {
    unary!(
        bootstrap,
        bootstrap,
        Method::Bootstrap,
        pb::BootstrapRequest,
        pb::BootstrapResult,
        [session_key, session_target, runtime_settings, runtime_context, host],
        ok
    );
    unary!(ingest, ingest, Method::Ingest, pb::IngestRequest, pb::IngestResult, [session_key], ok);
    unary!(
        ingest_batch,
        ingest_batch,
        Method::IngestBatch,
        pb::IngestBatchRequest,
        pb::IngestBatchResult,
        [session_key],
        ok
    );
    unary!(
        after_turn,
        after_turn,
        Method::AfterTurn,
        pb::AfterTurnRequest,
        pb::AfterTurnResult,
        [session_key, session_target, runtime_settings, runtime_context, host],
        ok
    );
    unary!(
        commit_turn,
        commit_turn,
        Method::CommitTurn,
        pb::CommitTurnRequest,
        pb::CommitTurnResult,
        [session_key, session_target, runtime_settings, runtime_context, host],
        validate::result::commit_turn
    );
    unary!(
        maintain,
        maintain,
        Method::Maintain,
        pb::MaintainRequest,
        pb::MaintainResult,
        [session_key, session_target, runtime_settings, runtime_context, host],
        validate::result::maintain
    );
    unary!(
        prepare_subagent_spawn,
        prepare_subagent_spawn,
        Method::PrepareSubagentSpawn,
        pb::PrepareSubagentSpawnRequest,
        pb::PrepareSubagentSpawnResult,
        [host],
        ok
    );
    unary!(
        rollback_subagent_spawn,
        rollback_subagent_spawn,
        Method::RollbackSubagentSpawn,
        pb::RollbackSubagentSpawnRequest,
        pb::RollbackSubagentSpawnResult,
        [],
        ok
    );
    unary!(
        on_subagent_ended,
        on_subagent_ended,
        Method::OnSubagentEnded,
        pb::OnSubagentEndedRequest,
        pb::OnSubagentEndedResult,
        [],
        ok
    );
    unary!(
        call_tool,
        call_tool,
        Method::CallTool,
        pb::CallToolRequest,
        pb::CallToolResult,
        [session_key, runtime_context, host],
        validate::result::call_tool
    );
    unary!(
        forget_session,
        forget_session,
        Method::ForgetSession,
        pb::ForgetSessionRequest,
        pb::ForgetSessionResult,
        [session_key],
        ok
    );

    pub async fn assemble(
        &self,
        mut req: pb::AssembleRequest,
        call: &Call,
    ) -> Result<pb::AssembleResult, EngineCallError> {
        project!(req, self.accepted(), [session_key, prompt, runtime_settings, runtime_context, host]);
        let history = req.messages.len();
        let r = self
            .run(Method::Assemble, call, |mut c, t| async move {
                let mut r = Request::new(req);
                r.set_timeout(t);
                c.assemble(r).await.map(tonic::Response::into_inner).map_err(|s| failure(Method::Assemble, s, t))
            })
            .await?;
        validate::result::assemble(&r, history).map_err(|v| violation(Method::Assemble, v))?;
        Ok(r)
    }

    /// Compact: the whole stream is one safety window. Progress goes to
    /// `progress` as it arrives; exactly one terminal event must end it.
    pub async fn compact(
        &self,
        req: pb::CompactRequest,
        call: &Call,
        progress: &ProgressFn<'_>,
    ) -> Result<CompactReply, EngineCallError> {
        let (hop, start) = (Self::hop(call), std::time::SystemTime::now());
        let r = self.compact_stream(req, call, progress, hop).await;
        self.span(Method::Compact, call, hop, start, &r);
        r
    }

    async fn compact_stream(
        &self,
        mut req: pb::CompactRequest,
        call: &Call,
        progress: &ProgressFn<'_>,
        hop: Option<ctxgate_proto::trace::TraceParent>,
    ) -> Result<CompactReply, EngineCallError> {
        project!(req, self.accepted(), [session_target, runtime_settings, runtime_context, host]);
        const M: Method = Method::Compact;
        if call.cancel.is_cancelled() {
            return Err(EngineCallError::Cancelled);
        }
        let timeout = self.budget(M, call);
        let deadline = Instant::now() + timeout;
        // Progress crosses from the call's task holding only the latest
        // event: a flood of progress costs one event's memory, and a client
        // only ever needs the latest.
        let (tx, mut rx) = tokio::sync::watch::channel::<(u64, Option<pb::CompactProgress>)>((0, None));
        let mut client = self.client.clone();
        let span = tracing::debug_span!("engine_call", engine = %self.id, method = %M, timeout_ms = timeout.as_millis() as u64);
        let task = tokio::spawn(tracing::Instrument::instrument(
            TRACE.scope(hop, async move {
                let mut r = Request::new(req);
                r.set_timeout(timeout);
                let mut stream = client.compact(r).await.map_err(|s| failure(M, s, timeout))?.into_inner();
                let mut terminal = None;
                while let Some(event) = stream.next().await {
                    let event = event.map_err(|s| failure(M, s, timeout))?;
                    if terminal.is_some() {
                        return Err(violation(M, "an event came after the terminal event"));
                    }
                    match event.event {
                        Some(Event::Progress(p)) => {
                            tx.send_modify(|(n, last)| {
                                *n += 1;
                                *last = Some(capped_progress(p));
                            });
                        }
                        Some(Event::Result(r)) => terminal = Some(CompactReply::Done(r)),
                        Some(Event::DelegateToHost(d)) => terminal = Some(CompactReply::DelegateToHost(d)),
                        None => return Err(violation(M, "an event with nothing set")),
                    }
                }
                terminal.ok_or_else(|| violation(M, "the stream ended without a result or delegate_to_host"))
            }),
            span,
        ));
        let _abort = AbortOnDrop(task.abort_handle());
        tokio::pin!(task);
        // The number of the last progress event relayed.
        let mut relayed = 0;
        let mut relay = |rx: &mut tokio::sync::watch::Receiver<(u64, Option<pb::CompactProgress>)>| {
            let latest = rx.borrow_and_update();
            if latest.0 > relayed
                && let Some(p) = latest.1.clone()
            {
                relayed = latest.0;
                drop(latest);
                progress(p);
            }
        };
        loop {
            tokio::select! {
                Ok(()) = rx.changed() => relay(&mut rx),
                r = &mut task => {
                    relay(&mut rx);
                    let reply = match r {
                        Ok(r) => r?,
                        Err(e) if e.is_panic() => return Err(EngineCallError::Failed { method: M, code: Code::Internal, detail: "the client task panicked on the engine's reply".into() }),
                        Err(_) => return Err(EngineCallError::Cancelled),
                    };
                    if let CompactReply::Done(r) = &reply
                        && r.compacted
                        && !r.ok
                    {
                        return Err(violation(M, "result says compacted but not ok"));
                    }
                    return Ok(reply);
                }
                () = tokio::time::sleep_until(deadline) => return Err(EngineCallError::DeadlineExceeded { method: M, after: timeout }),
                () = call.cancel.cancelled() => return Err(EngineCallError::Cancelled),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overload_answers_are_shed_and_other_failures_stay_failures() {
        let t = Duration::from_secs(1);
        let shed = |e: &EngineCallError| matches!(e, EngineCallError::Overloaded { .. });
        let with_pushback = |mut s: Status| {
            s.metadata_mut().insert("grpc-retry-pushback-ms", 50.into());
            s
        };
        assert!(shed(&failure(Method::Assemble, with_pushback(Status::resource_exhausted("busy")), t)));
        assert!(shed(&failure(Method::Assemble, with_pushback(Status::unavailable("draining")), t)));
        // Without a pushback RESOURCE_EXHAUSTED is "too large": a failure.
        let big = failure(Method::CommitTurn, Status::resource_exhausted("messages: over the limit"), t);
        assert!(matches!(big, EngineCallError::Failed { code: Code::ResourceExhausted, .. }), "{big:?}");
        // Without a pushback, UNAVAILABLE is the engine (or the way to it) failing.
        let down = failure(Method::Assemble, Status::unavailable("connection refused"), t);
        assert!(matches!(down, EngineCallError::Failed { code: Code::Unavailable, .. }), "{down:?}");
        let timeout = failure(Method::Assemble, Status::cancelled("Timeout expired"), t);
        assert!(matches!(timeout, EngineCallError::DeadlineExceeded { .. }), "{timeout:?}");
        let long = failure(Method::Assemble, Status::internal("x".repeat(10_000)), t);
        assert!(matches!(long, EngineCallError::Failed { ref detail, .. } if detail.len() == 500));
    }
}
