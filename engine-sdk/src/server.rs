//! Serving an engine: contract checks, per-call context, panic containment,
//! health, reflection and graceful drain.

use std::future::Future;
use std::io::Write;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use ctxgate_proto::{ENGINE_SERVICE, FILE_DESCRIPTOR_SET, Method, validate};
use tokio::sync::mpsc;
use tokio::task::AbortHandle;
use tokio::time::Instant;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::{ReceiverStream, UnixListenerStream};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tonic_health::ServingStatus;

use crate::endpoint::Endpoint;
use crate::engine::{CompactOutcome, ContextEngine, Progress};
use crate::host::{HostChannels, HostPolicy, Peer};
use crate::limits::MAX_GRPC_MESSAGE_BYTES;
use crate::pb::{self, context_engine_server as raw};
use crate::{CallContext, EngineError};

/// Command-line options every engine binary shares; `#[command(flatten)]`
/// them into the engine's own parser.
#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    /// Where to listen: HOST:PORT (port 0 picks one) or unix:///PATH.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: Endpoint,
    /// How long in-flight calls may finish after SIGTERM or Ctrl-C.
    #[arg(long, default_value_t = 10)]
    pub drain_seconds: u64,
    /// Engine calls served at once; one more is answered RESOURCE_EXHAUSTED
    /// with a retry pushback (the gateway falls back for that call, without
    /// quarantine). GetInfo is never refused.
    #[arg(long, default_value_t = DEFAULT_MAX_CONCURRENT_CALLS)]
    pub max_concurrent_calls: usize,
    /// A host endpoint this engine may call back (HOST:PORT, http://HOST:PORT
    /// or unix:///PATH), repeatable. None: only the address of the peer that
    /// made the call (a host name is resolved to check it).
    #[arg(long = "host-allow", value_name = "ENDPOINT")]
    pub host_allow: Vec<crate::host::HostEndpoint>,
    /// Serve TLS with this certificate (PEM), with `--tls-key`.
    #[arg(long, requires = "tls_key")]
    pub tls_cert: Option<std::path::PathBuf>,
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<std::path::PathBuf>,
    /// With TLS: only clients (the gateway) presenting a certificate this CA
    /// (PEM) signed are served (mTLS).
    #[arg(long, requires = "tls_cert")]
    pub tls_client_ca: Option<std::path::PathBuf>,
    /// The CA (PEM) an https:// host endpoint's certificate must chain to
    /// (default: the public web roots); host callbacks then present
    /// `--tls-cert` as the client certificate, when given.
    #[arg(long)]
    pub host_ca: Option<std::path::PathBuf>,
    /// Export a span per traced engine method over OTLP/gRPC to this
    /// collector (http://HOST:PORT), continuing the caller's `traceparent`.
    /// A flag, not OpenTelemetry's `OTEL_EXPORTER_OTLP_ENDPOINT`: platforms
    /// inject that one in forms (https, paths) this exporter does not speak,
    /// and an engine must not fail to start over it.
    #[arg(long)]
    pub otlp_endpoint: Option<String>,
    /// The `service.name` of those spans.
    #[arg(long, env = "OTEL_SERVICE_NAME", default_value = "ctxgate-engine")]
    pub otlp_service_name: String,
}

impl ServeArgs {
    /// The server TLS the options ask for, read now (a mistake is a
    /// sentence naming its option); SIGHUP re-reads the same files.
    pub fn tls(&self) -> Result<Option<crate::tls::LiveServerTls>, String> {
        let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) else { return Ok(None) };
        let named = |option: &str, path: &std::path::PathBuf| (option.to_owned(), path.clone());
        let files = crate::tls::ServerFiles {
            cert: named(TLS_PAIR.0, cert),
            key: named(TLS_PAIR.1, key),
            client_ca: self.tls_client_ca.as_ref().map(|p| named("--tls-client-ca", p)),
        };
        crate::tls::LiveServerTls::new(files).map(Some)
    }

    /// The client TLS for https:// host endpoints.
    pub fn host_tls(&self) -> Result<tonic::transport::ClientTlsConfig, String> {
        let ca = self.host_ca.as_deref().map(|p| crate::tls::Pem::new("--host-ca", p));
        crate::tls::client(ca, crate::tls::pair(self.tls_cert.as_ref(), self.tls_key.as_ref(), TLS_PAIR))
    }
}

/// The options a certificate and its key come from.
const TLS_PAIR: (&str, &str) = ("--tls-cert", "--tls-key");

/// The default cap on engine calls in flight.
pub const DEFAULT_MAX_CONCURRENT_CALLS: usize = 1024;

/// How long a refused caller is asked to wait (`grpc-retry-pushback-ms`).
const PUSHBACK_MS: u64 = 50;

/// Runs `engine` as a process: logs to stderr, binds, prints exactly one
/// line `listening on ADDR` to stdout, serves until SIGTERM or Ctrl-C, then
/// drains. Engine binaries call this from `main`.
pub async fn serve_main<E: ContextEngine>(engine: E, args: ServeArgs) -> Result<(), Box<dyn std::error::Error>> {
    init_tracing();
    let bound = Server::new(engine).options(&args)?.bind(&args.listen).await?;
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "listening on {}", bound.local_endpoint())?;
        out.flush()?;
    }
    bound.serve(shutdown_signal()).await?;
    Ok(())
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    // Logs go to stderr: stdout carries only the `listening on` line.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi).try_init();
}

/// Aborts a spawned task when dropped: work that must not outlive the
/// call, stream or server it belongs to.
pub struct AbortOnDrop(pub AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// SIGHUP, listened to from `bind` on (before `listening on` is printed,
/// so an early SIGHUP never kills a TLS engine).
#[cfg(unix)]
type Hangup = tokio::signal::unix::Signal;
#[cfg(not(unix))]
type Hangup = ();

fn hangup() -> Option<Hangup> {
    #[cfg(unix)]
    return tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
    #[cfg(not(unix))]
    return None;
}

/// Re-reads the server's certificate files on every SIGHUP: new
/// connections use them; a mistake keeps the running certificate.
async fn reload_tls_on_sighup(tls: crate::tls::LiveServerTls, mut hup: Hangup) {
    #[cfg(unix)]
    while hup.recv().await.is_some() {
        match tls.reload(tls.files()) {
            Ok(()) => tracing::info!("SIGHUP: TLS certificate re-read; new connections use it"),
            Err(e) => tracing::error!(error = %e, "SIGHUP: TLS certificate not re-read; keeping the running one"),
        }
    }
    #[cfg(not(unix))]
    let _ = (tls, &mut hup);
}

/// Resolves on SIGTERM or Ctrl-C.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
    tracing::info!("shutdown requested, draining");
}

/// Builds an engine server.
#[derive(Debug)]
pub struct Server<E> {
    engine: Arc<E>,
    drain: Duration,
    max_calls: usize,
    hosts: HostPolicy,
    tls: Option<crate::tls::LiveServerTls>,
    host_tls: Option<tonic::transport::ClientTlsConfig>,
    spans: Option<crate::otlp::Exporter>,
}

enum Listener {
    Tcp(tokio::net::TcpListener),
    Unix(tokio::net::UnixListener, std::path::PathBuf),
}

/// A server bound to its address, not yet serving.
pub struct Bound<E> {
    server: Server<E>,
    listener: Listener,
    local: Endpoint,
    reporter: tonic_health::server::HealthReporter,
    health: tonic_health::pb::health_server::HealthServer<tonic_health::server::HealthService>,
    /// With TLS: SIGHUP, to re-read the certificate.
    hangup: Option<Hangup>,
}

impl<E: ContextEngine> Server<E> {
    pub fn new(engine: E) -> Self {
        Self::from_arc(Arc::new(engine))
    }

    pub fn from_arc(engine: Arc<E>) -> Self {
        Self {
            engine,
            drain: Duration::from_secs(10),
            max_calls: DEFAULT_MAX_CONCURRENT_CALLS,
            hosts: HostPolicy::default(),
            tls: None,
            host_tls: None,
            spans: None,
        }
    }

    /// Every option of `args` but `--listen` (bind to it): drain, call
    /// limit, host allow-list, TLS, span export. An engine that builds its
    /// own server calls this, so that no option it accepts goes unused.
    /// Starts the span exporter, so it runs inside a tokio runtime.
    pub fn options(self, args: &ServeArgs) -> Result<Self, String> {
        let spans = match &args.otlp_endpoint {
            Some(e) => Some(
                crate::otlp::Exporter::start(e, &args.otlp_service_name)
                    .map_err(|m| format!("--otlp-endpoint: {m}"))?,
            ),
            None => None,
        };
        Ok(self
            .drain_timeout(Duration::from_secs(args.drain_seconds))
            .max_concurrent_calls(args.max_concurrent_calls)
            .host_policy(HostPolicy::allow(args.host_allow.clone()))
            .tls(args.tls()?)
            .host_tls(args.host_tls()?)
            .spans(spans))
    }

    /// Exports a span per engine method (see [`crate::otlp`]).
    pub fn spans(mut self, spans: Option<crate::otlp::Exporter>) -> Self {
        self.spans = spans;
        self
    }

    /// What to trust and present calling back https:// host endpoints
    /// (default: the public web roots, no client certificate).
    pub fn host_tls(mut self, tls: tonic::transport::ClientTlsConfig) -> Self {
        self.host_tls = Some(tls);
        self
    }

    /// Serves TLS (rustls) when given: over TCP only (`bind` refuses a unix
    /// socket with TLS). Its certificate can be replaced while serving
    /// ([`crate::tls::LiveServerTls::reload`]).
    pub fn tls(mut self, tls: Option<crate::tls::LiveServerTls>) -> Self {
        self.tls = tls;
        self
    }

    /// Which host endpoints calls may name (default: the calling peer's
    /// address only; see [`HostPolicy`]).
    pub fn host_policy(mut self, policy: HostPolicy) -> Self {
        self.hosts = policy;
        self
    }

    /// Engine calls served at once (default 1024, at least 1); one more is
    /// RESOURCE_EXHAUSTED with `grpc-retry-pushback-ms`, which the gateway
    /// treats as overload (legacy for that call), not as a failure.
    pub fn max_concurrent_calls(mut self, n: usize) -> Self {
        self.max_calls = n.max(1);
        self
    }

    /// How long in-flight calls may finish once shutdown starts (default 10 s).
    pub fn drain_timeout(mut self, drain: Duration) -> Self {
        self.drain = drain;
        self
    }

    /// Binds `endpoint`. A stale unix socket file is replaced.
    pub async fn bind(self, endpoint: &Endpoint) -> std::io::Result<Bound<E>> {
        // A unix socket's peer cannot speak TLS to us (the gateway refuses
        // https with unix://). A bad key was said when the TLS was read.
        if self.tls.is_some() && matches!(endpoint, Endpoint::Unix(_)) {
            return Err(std::io::Error::other("TLS is served over TCP only: --listen HOST:PORT with --tls-cert"));
        }
        let (listener, local) = match endpoint {
            Endpoint::Tcp(addr) => {
                let l = tokio::net::TcpListener::bind(addr).await?;
                let local = Endpoint::Tcp(l.local_addr()?);
                (Listener::Tcp(l), local)
            }
            Endpoint::Host(host, port) => {
                let l = tokio::net::TcpListener::bind((host.as_str(), *port)).await?;
                let local = Endpoint::Tcp(l.local_addr()?);
                (Listener::Tcp(l), local)
            }
            Endpoint::Unix(path) => {
                if tokio::fs::metadata(path).await.is_ok() {
                    tokio::fs::remove_file(path).await?;
                }
                let l = tokio::net::UnixListener::bind(path)?;
                (Listener::Unix(l, path.clone()), endpoint.clone())
            }
        };
        let reporter = tonic_health::server::HealthReporter::new();
        reporter.set_service_status(ENGINE_SERVICE, ServingStatus::Serving).await;
        let health = tonic_health::pb::health_server::HealthServer::new(
            tonic_health::server::HealthService::from_health_reporter(reporter.clone()),
        );
        let hangup = if self.tls.is_some() { hangup() } else { None };
        Ok(Bound { server: self, listener, local, reporter, health, hangup })
    }
}

impl<E: ContextEngine> Bound<E> {
    /// The health reporter: an engine can report NOT_SERVING itself (a lost
    /// backend, say) and SERVING again; the server also flips it on drain.
    pub fn health_reporter(&self) -> tonic_health::server::HealthReporter {
        self.reporter.clone()
    }

    /// The address actually bound (port 0 resolved).
    pub fn local_endpoint(&self) -> &Endpoint {
        &self.local
    }

    /// Serves until `shutdown` resolves, then reports NOT_SERVING, stops
    /// accepting, and gives in-flight calls the drain timeout to finish.
    /// With TLS, SIGHUP re-reads the certificate files meanwhile.
    pub async fn serve(self, shutdown: impl Future<Output = ()>) -> Result<(), tonic::transport::Error> {
        let reloads = self.server.tls.clone().zip(self.hangup);
        let _reloads = reloads.map(|(t, hup)| AbortOnDrop(tokio::spawn(reload_tls_on_sighup(t, hup)).abort_handle()));
        let (reporter, health) = (self.reporter, self.health);
        let reflection = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .build_v1()
            .expect("the contract's descriptor set is valid");
        let slots = Arc::new(tokio::sync::Semaphore::new(self.server.max_calls));
        let max_calls = self.server.max_calls;
        let hosts = Arc::new(HostChannels::new(self.server.hosts, self.server.host_tls.clone()));
        let spans = self.server.spans.clone();
        let service = EngineService { engine: self.server.engine, hosts, slots, max_calls, spans };
        let engine = raw::ContextEngineServer::new(service)
            .max_decoding_message_size(MAX_GRPC_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_GRPC_MESSAGE_BYTES);

        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let router =
            tonic::transport::Server::builder().add_service(health).add_service(reflection).add_service(engine);
        let stopped = async {
            let _ = stop_rx.await;
        };
        let (serving, unix_path): (Pin<Box<dyn Future<Output = _> + Send>>, _) = match self.listener {
            Listener::Tcp(l) => {
                // Nagle off on accepted sockets (the builder's tcp_nodelay only
                // covers sockets it binds itself).
                let incoming = tonic::transport::server::TcpIncoming::from(l).with_nodelay(Some(true));
                match &self.server.tls {
                    Some(tls) => (Box::pin(router.serve_with_incoming_shutdown(tls.incoming(incoming), stopped)), None),
                    None => (Box::pin(router.serve_with_incoming_shutdown(incoming, stopped)), None),
                }
            }
            Listener::Unix(l, path) => {
                (Box::pin(router.serve_with_incoming_shutdown(UnixListenerStream::new(l), stopped)), Some(path))
            }
        };
        tokio::pin!(serving);
        tokio::pin!(shutdown);
        let result = tokio::select! {
            r = &mut serving => r,
            () = &mut shutdown => {
                reporter.set_service_status("", ServingStatus::NotServing).await;
                reporter.set_service_status(ENGINE_SERVICE, ServingStatus::NotServing).await;
                let _ = stop_tx.send(());
                match tokio::time::timeout(self.server.drain, &mut serving).await {
                    Ok(r) => r,
                    Err(_) => {
                        tracing::warn!(drain = ?self.server.drain, "drain timed out; dropping remaining calls");
                        Ok(())
                    }
                }
            }
        };
        if let Some(path) = unix_path {
            let _ = std::fs::remove_file(path);
        }
        result
    }
}

/// The generated service trait implemented over a [`ContextEngine`].
struct EngineService<E> {
    engine: Arc<E>,
    hosts: Arc<HostChannels>,
    /// One permit per engine call in flight, `max_calls` in all.
    slots: Arc<tokio::sync::Semaphore>,
    max_calls: usize,
    spans: Option<crate::otlp::Exporter>,
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
    fn finish(hop: Option<Self>, spans: Option<&crate::otlp::Exporter>, method: Method, error: Option<String>) {
        let (Some(hop), Some(spans)) = (hop, spans) else { return };
        spans.record(crate::otlp::Span {
            name: format!("{ENGINE_SERVICE}/{method}"),
            kind: crate::otlp::Kind::Server,
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
        self.unary(Method::GetInfo, req, no_check, no_host, |e, ctx, _| async move { e.get_info(&ctx).await }).await
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
