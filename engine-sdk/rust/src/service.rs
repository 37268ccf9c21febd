//! The generated `ContextEngine` service over an engine: each call is
//! validated, admitted under the concurrent-call cap, given its
//! [`CallContext`] (deadline, cancellation, host client, trace) and run in
//! its own task; a dropped call aborts that task and fires its token.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use ctxgate_proto::{ENGINE_SERVICE, Method, validate};
use tokio::sync::mpsc;
use tokio::task::AbortHandle;
use tokio::time::Instant;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::engine::{CompactOutcome, ContextEngine, Progress};
use crate::host::{HostChannels, Peer};
use crate::pb::{self, context_engine_server as raw};
use crate::{CallContext, EngineError};

/// How long a refused caller is asked to wait (`grpc-retry-pushback-ms`).
const PUSHBACK_MS: u64 = 50;

/// The generated service trait implemented over a [`ContextEngine`].
pub(crate) struct EngineService<E> {
    pub(crate) engine: Arc<E>,
    pub(crate) hosts: Arc<HostChannels>,
    /// One permit per engine call in flight, `max_calls` in all.
    pub(crate) slots: Arc<tokio::sync::Semaphore>,
    pub(crate) max_calls: usize,
    pub(crate) spans: Option<ctxgate_runtime::otlp::Exporter>,
}

/// A traced engine method's span: its own id (what the engine's callbacks
/// continue) and the caller's, for the export.
#[derive(Clone, Copy)]
struct Hop {
    this: ctxgate_proto::trace::TraceParent,
    parent: [u8; 8],
    start: std::time::SystemTime,
}

impl Hop {
    fn finish(
        hop: Option<Self>,
        spans: Option<&ctxgate_runtime::otlp::Exporter>,
        method: Method,
        error: Option<String>,
    ) {
        let (Some(hop), Some(spans)) = (hop, spans) else { return };
        spans.record(ctxgate_runtime::otlp::Span {
            name: format!("{ENGINE_SERVICE}/{method}"),
            kind: ctxgate_runtime::otlp::Kind::Server,
            this: hop.this,
            parent: Some(hop.parent),
            start: hop.start,
            end: std::time::SystemTime::now(),
            attributes: vec![("rpc.system", "grpc".into()), ("rpc.method", method.name().into())],
            error,
        });
    }
}

/// Cancels the call's token and aborts its task when the caller goes away
/// (the handler future or the response stream is dropped).
struct CallGuard {
    cancel: CancellationToken,
    task: AbortHandle,
}

impl Drop for CallGuard {
    fn drop(&mut self) {
        self.cancel.cancel();
        self.task.abort();
    }
}

fn deadline_of(metadata: &tonic::metadata::MetadataMap) -> Option<Instant> {
    let raw = metadata.get("grpc-timeout")?.to_str().ok()?;
    Some(Instant::now() + parse_grpc_timeout(raw)?)
}

/// A `grpc-timeout` value (up to 8 digits and a unit H M S m u n); `None`
/// when it is malformed.
pub fn parse_grpc_timeout(raw: &str) -> Option<Duration> {
    // ASCII only: splitting off the unit byte of "ϋ" would panic (found by
    // the `grpc_timeout` fuzz target).
    if !raw.is_ascii() {
        return None;
    }
    let (digits, unit) = raw.split_at(raw.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    let d = match unit {
        "H" => Duration::from_secs(n.checked_mul(3600)?),
        "M" => Duration::from_secs(n.checked_mul(60)?),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    };
    Some(d)
}

async fn until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

fn panic_status(method: Method) -> Status {
    tracing::error!(%method, "engine method panicked");
    Status::internal(format!("{method} failed inside the engine"))
}

type Unary<T> = Result<Response<T>, Status>;

/// The answer to a call over the limit: overload, with a retry pushback.
fn over_limit(max: usize) -> Status {
    let mut s = Status::resource_exhausted(format!("the engine is serving its limit of {max} concurrent calls"));
    s.metadata_mut().insert("grpc-retry-pushback-ms", PUSHBACK_MS.into());
    s
}

impl<E: ContextEngine> EngineService<E> {
    /// A slot for one engine call, or the overload answer. GetInfo always
    /// gets one: the gateway needs it to attach.
    fn admit(&self, method: Method) -> Result<Option<tokio::sync::OwnedSemaphorePermit>, Status> {
        if method == Method::GetInfo {
            return Ok(None);
        }
        match self.slots.clone().try_acquire_owned() {
            Ok(p) => Ok(Some(p)),
            Err(_) => {
                tracing::warn!(%method, "engine call refused: at the concurrent-call limit");
                Err(over_limit(self.max_calls))
            }
        }
    }

    async fn context<T>(&self, req: &Request<T>, host: Option<&pb::HostAccess>) -> (CallContext, Option<Hop>) {
        // No TCP peer: the call came over the unix socket.
        let peer = req.remote_addr().map_or(Peer::Local, |a| Peer::Ip(a.ip()));
        // The deadline is the caller's from its arrival; a name lookup for the
        // host endpoint spends from it.
        let deadline = deadline_of(req.metadata());
        let within = deadline.map_or(Duration::from_secs(2), |d| d.saturating_duration_since(Instant::now()));
        let host = self.hosts.client(host, peer, within).await;
        let incoming = req
            .metadata()
            .get(ctxgate_proto::trace::HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(ctxgate_proto::trace::TraceParent::parse);
        // A traced call is a span of the caller's trace (its callbacks
        // continue it); an untraced one (an attach's GetInfo) is none.
        let hop = incoming.map(|t| Hop { this: t.child(), parent: t.parent_id, start: std::time::SystemTime::now() });
        let span = hop.map(|h| h.this);
        (CallContext { deadline, cancel: CancellationToken::new(), host, trace: incoming, span }, hop)
    }

    /// Validates, then runs one unary engine method in its own task, bounded
    /// by the deadline and cancelled with the caller.
    async fn unary<Req, Res, Fut>(
        &self,
        method: Method,
        req: Request<Req>,
        check: fn(&Req) -> validate::Result,
        host: fn(&Req) -> Option<&pb::HostAccess>,
        call: impl FnOnce(Arc<E>, CallContext, Req) -> Fut,
    ) -> Unary<Res>
    where
        Req: Send + 'static,
        Res: Send + 'static,
        Fut: Future<Output = Result<Res, EngineError>> + Send + 'static,
    {
        let msg = req.get_ref();
        check(msg)?;
        let permit = self.admit(method)?;
        let (ctx, hop) = self.context(&req, host(msg)).await;
        let (deadline, cancel, ctx_trace) = (ctx.deadline, ctx.cancel.clone(), ctx.trace);
        let fut = call(self.engine.clone(), ctx, req.into_inner());
        let trace_id = ctx_trace.map(|t| t.trace_id_hex()).unwrap_or_default();
        let fut = tracing::Instrument::instrument(fut, tracing::debug_span!("engine_method", %method, trace_id));
        let task = tokio::spawn(async move {
            // The slot is held while the work runs, aborted work included.
            let _permit = permit;
            tokio::select! {
                r = fut => r,
                () = until(deadline) => Err(EngineError::DeadlineExceeded),
            }
        });
        let _guard = CallGuard { cancel, task: task.abort_handle() };
        let r = match task.await {
            Ok(r) => r.map(Response::new).map_err(Status::from),
            Err(e) if e.is_panic() => Err(panic_status(method)),
            Err(_) => Err(Status::cancelled("the call was cancelled")),
        };
        Hop::finish(hop, self.spans.as_ref(), method, r.as_ref().err().map(|s| s.message().to_owned()));
        r
    }
}

fn no_host<T>(_: &T) -> Option<&pb::HostAccess> {
    None
}

fn no_check<T>(_: &T) -> validate::Result {
    Ok(())
}

type CompactStream = Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::CompactEvent, Status>> + Send>>;

#[tonic::async_trait]
impl<E: ContextEngine> raw::ContextEngine for EngineService<E> {
    async fn get_info(&self, req: Request<pb::GetInfoRequest>) -> Unary<pb::EngineInfo> {
        self.unary(Method::GetInfo, req, no_check, no_host, |e, ctx, _| async move {
            let mut info = e.get_info(&ctx).await?;
            // Tools declared through `tools()` join the info (with CallTool).
            if info.tools.is_empty() {
                info.tools = e.tools();
                if !info.tools.is_empty() && !Method::CallTool.listed_in(&info.implemented_methods) {
                    info.implemented_methods.push(Method::CallTool.name().to_owned());
                }
            }
            Ok(info)
        })
        .await
    }

    async fn call_tool(&self, req: Request<pb::CallToolRequest>) -> Unary<pb::CallToolResult> {
        self.unary(
            Method::CallTool,
            req,
            validate::request::call_tool,
            |r| r.host.as_ref(),
            |e, ctx, r| async move { e.call_tool(&ctx, r).await },
        )
        .await
    }

    async fn bootstrap(&self, req: Request<pb::BootstrapRequest>) -> Unary<pb::BootstrapResult> {
        self.unary(
            Method::Bootstrap,
            req,
            validate::request::bootstrap,
            |r| r.host.as_ref(),
            |e, ctx, r| async move { e.bootstrap(&ctx, r).await },
        )
        .await
    }

    async fn ingest(&self, req: Request<pb::IngestRequest>) -> Unary<pb::IngestResult> {
        self.unary(Method::Ingest, req, validate::request::ingest, no_host, |e, ctx, r| async move {
            e.ingest(&ctx, r).await
        })
        .await
    }

    async fn ingest_batch(&self, req: Request<pb::IngestBatchRequest>) -> Unary<pb::IngestBatchResult> {
        self.unary(Method::IngestBatch, req, validate::request::ingest_batch, no_host, |e, ctx, r| async move {
            e.ingest_batch(&ctx, r).await
        })
        .await
    }

    async fn assemble(&self, req: Request<pb::AssembleRequest>) -> Unary<pb::AssembleResult> {
        self.unary(
            Method::Assemble,
            req,
            validate::request::assemble,
            |r| r.host.as_ref(),
            |e, ctx, r| async move { e.assemble(&ctx, r).await },
        )
        .await
    }

    type CompactStream = CompactStream;

    async fn compact(&self, req: Request<pb::CompactRequest>) -> Unary<CompactStream> {
        validate::request::compact(req.get_ref())?;
        let permit = self.admit(Method::Compact)?;
        let (ctx, hop) = self.context(&req, req.get_ref().host.as_ref()).await;
        let (deadline, cancel) = (ctx.deadline, ctx.cancel.clone());
        let spans = self.spans.clone();
        let (tx, rx) = mpsc::channel(16);
        let engine = self.engine.clone();
        let msg = req.into_inner();
        let progress = Progress::new(tx.clone());
        let work = tokio::spawn(async move {
            let _permit = permit;
            tokio::select! {
                r = engine.compact(&ctx, msg, progress) => r,
                () = until(deadline) => Err(EngineError::DeadlineExceeded),
            }
        });
        let guard = CallGuard { cancel, task: work.abort_handle() };
        // A supervisor turns the work's end (result, error or panic) into the
        // stream's one terminal item.
        tokio::spawn(async move {
            let terminal = match work.await {
                Ok(Ok(CompactOutcome::Done(result))) => Ok(pb::compact_event::Event::Result(result)),
                Ok(Ok(CompactOutcome::DelegateToHost(d))) => Ok(pb::compact_event::Event::DelegateToHost(d)),
                Ok(Err(e)) => Err(Status::from(e)),
                Err(e) if e.is_panic() => Err(panic_status(Method::Compact)),
                Err(_) => return, // aborted: the caller is gone
            };
            Hop::finish(hop, spans.as_ref(), Method::Compact, terminal.as_ref().err().map(|s| s.message().to_owned()));
            let _ = tx.send(terminal.map(|event| pb::CompactEvent { event: Some(event) })).await;
        });
        // The guard lives as long as the response stream: dropping the stream
        // (client cancel, RST_STREAM) cancels the token and aborts the work.
        let stream = ReceiverStream::new(rx).map(move |item| {
            let _keep = &guard;
            item
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn after_turn(&self, req: Request<pb::AfterTurnRequest>) -> Unary<pb::AfterTurnResult> {
        self.unary(
            Method::AfterTurn,
            req,
            validate::request::after_turn,
            |r| r.host.as_ref(),
            |e, ctx, r| async move { e.after_turn(&ctx, r).await },
        )
        .await
    }

    async fn commit_turn(&self, req: Request<pb::CommitTurnRequest>) -> Unary<pb::CommitTurnResult> {
        self.unary(
            Method::CommitTurn,
            req,
            validate::request::commit_turn,
            |r| r.host.as_ref(),
            |e, ctx, r| async move { e.commit_turn(&ctx, r).await },
        )
        .await
    }

    async fn maintain(&self, req: Request<pb::MaintainRequest>) -> Unary<pb::MaintainResult> {
        self.unary(
            Method::Maintain,
            req,
            validate::request::maintain,
            |r| r.host.as_ref(),
            |e, ctx, r| async move { e.maintain(&ctx, r).await },
        )
        .await
    }

    async fn prepare_subagent_spawn(
        &self,
        req: Request<pb::PrepareSubagentSpawnRequest>,
    ) -> Unary<pb::PrepareSubagentSpawnResult> {
        self.unary(
            Method::PrepareSubagentSpawn,
            req,
            validate::request::prepare_subagent_spawn,
            |r| r.host.as_ref(),
            |e, ctx, r| async move { e.prepare_subagent_spawn(&ctx, r).await },
        )
        .await
    }

    async fn rollback_subagent_spawn(
        &self,
        req: Request<pb::RollbackSubagentSpawnRequest>,
    ) -> Unary<pb::RollbackSubagentSpawnResult> {
        self.unary(
            Method::RollbackSubagentSpawn,
            req,
            validate::request::rollback_subagent_spawn,
            no_host,
            |e, ctx, r| async move { e.rollback_subagent_spawn(&ctx, r).await },
        )
        .await
    }

    async fn on_subagent_ended(&self, req: Request<pb::OnSubagentEndedRequest>) -> Unary<pb::OnSubagentEndedResult> {
        self.unary(
            Method::OnSubagentEnded,
            req,
            validate::request::on_subagent_ended,
            no_host,
            |e, ctx, r| async move { e.on_subagent_ended(&ctx, r).await },
        )
        .await
    }

    async fn dispose(&self, req: Request<pb::DisposeRequest>) -> Unary<pb::DisposeResult> {
        self.unary(Method::Dispose, req, no_check, no_host, |e, ctx, _| async move { e.dispose(&ctx).await }).await
    }

    async fn forget_session(&self, req: Request<pb::ForgetSessionRequest>) -> Unary<pb::ForgetSessionResult> {
        self.unary(Method::ForgetSession, req, validate::request::forget_session, no_host, |e, ctx, r| async move {
            e.forget_session(&ctx, r).await
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeout_units() {
        let mut m = tonic::metadata::MetadataMap::new();
        for (v, d) in [("5S", 5_000u64), ("250m", 250), ("1M", 60_000), ("1H", 3_600_000)] {
            m.insert("grpc-timeout", v.parse().unwrap());
            let left = deadline_of(&m).unwrap() - Instant::now();
            assert!(
                left <= Duration::from_millis(d) && left + Duration::from_millis(50) >= Duration::from_millis(d),
                "{v}"
            );
        }
        for bad in ["", "S", "123456789S", "5x", "-1S", "+1S"] {
            m.insert("grpc-timeout", bad.parse().unwrap());
            assert!(deadline_of(&m).is_none(), "{bad:?}");
        }
        // The fuzz target's crash: a multi-byte last character.
        assert_eq!(parse_grpc_timeout("\u{3cb}"), None);
        assert_eq!(parse_grpc_timeout("1\u{3cb}"), None);
    }
}
