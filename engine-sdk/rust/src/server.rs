//! Serving an engine: contract checks, per-call context, panic containment,
//! health, reflection and graceful drain.

use std::future::Future;
use std::io::Write;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use ctxgate_proto::{ENGINE_SERVICE, FILE_DESCRIPTOR_SET};
use tokio::task::AbortHandle;
use tokio_stream::wrappers::UnixListenerStream;
use tonic_health::ServingStatus;

use crate::engine::ContextEngine;
use crate::host::{HostChannels, HostPolicy};
use crate::limits::MAX_GRPC_MESSAGE_BYTES;
use crate::pb::context_engine_server as raw;
use crate::service::EngineService;
use ctxgate_runtime::endpoint::Endpoint;

/// Command-line options every engine binary shares; `#[command(flatten)]`
/// them into the engine's own parser.
#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    /// Where to listen: HOST:PORT (port 0 picks one) or unix:///PATH.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: Endpoint,
    /// The permissions of a unix:///PATH socket, in octal (default 600:
    /// only this user; 660 lets a gateway in the same group connect).
    #[arg(long, default_value = "600", value_parser = parse_mode)]
    pub socket_mode: u32,
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
    /// With `--tls-client-ca`: serve only a client whose certificate names
    /// NAME (a DNS subjectAltName), such as the gateway's service name;
    /// repeatable. Others fail the handshake. None: any client the CA signed.
    #[arg(long = "tls-client-name", value_name = "NAME", requires = "tls_client_ca", value_parser = parse_client_name)]
    pub tls_client_names: Vec<String>,
    /// Also serve grpc.health.v1, and nothing else, in plaintext here: a
    /// loopback HOST:PORT or unix:///PATH, for a container's own health
    /// check when `--tls-client-ca` serves only the gateway on `--listen`.
    #[arg(long, value_name = "ADDR")]
    pub health_listen: Option<Endpoint>,
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
    pub fn tls(&self) -> Result<Option<ctxgate_runtime::tls::LiveServerTls>, ctxgate_runtime::tls::TlsError> {
        let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) else { return Ok(None) };
        let named = |option: &str, path: &std::path::PathBuf| (option.to_owned(), path.clone());
        let files = ctxgate_runtime::tls::ServerFiles {
            cert: named(TLS_PAIR.0, cert),
            key: named(TLS_PAIR.1, key),
            client_ca: self.tls_client_ca.as_ref().map(|p| named("--tls-client-ca", p)),
            client_names: self.tls_client_names.clone(),
        };
        ctxgate_runtime::tls::LiveServerTls::new(files).map(Some)
    }

    /// The client TLS for https:// host endpoints.
    pub fn host_tls(&self) -> Result<tonic::transport::ClientTlsConfig, ctxgate_runtime::tls::TlsError> {
        let ca = self.host_ca.as_deref().map(|p| ctxgate_runtime::tls::Pem::new("--host-ca", p));
        ctxgate_runtime::tls::client(
            ca,
            ctxgate_runtime::tls::pair(self.tls_cert.as_ref(), self.tls_key.as_ref(), TLS_PAIR),
        )
    }
}

/// A `--tls-client-name`: a DNS name (see [`ctxgate_runtime::tls::client_name_problem`]).
fn parse_client_name(s: &str) -> Result<String, String> {
    ctxgate_runtime::tls::client_name_problem(s).map_or_else(|| Ok(s.to_owned()), Err)
}

/// An octal file mode of at most 777.
fn parse_mode(s: &str) -> Result<u32, String> {
    u32::from_str_radix(s, 8)
        .ok()
        .filter(|m| *m <= 0o777)
        .ok_or_else(|| format!("{s:?}: expected an octal mode such as 600 or 660"))
}

/// The options a certificate and its key come from.
const TLS_PAIR: (&str, &str) = ("--tls-cert", "--tls-key");

/// The default cap on engine calls in flight.
pub const DEFAULT_MAX_CONCURRENT_CALLS: usize = 1024;

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
async fn reload_tls_on_sighup(tls: ctxgate_runtime::tls::LiveServerTls, mut hup: Hangup) {
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
    tls: Option<ctxgate_runtime::tls::LiveServerTls>,
    host_tls: Option<tonic::transport::ClientTlsConfig>,
    spans: Option<ctxgate_runtime::otlp::Exporter>,
    socket_mode: u32,
    health_listen: Option<Endpoint>,
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
    /// `--health-listen`: health alone, in plaintext.
    health_listener: Option<(Listener, Endpoint)>,
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
            socket_mode: 0o600,
            health_listen: None,
        }
    }

    /// Every option of `args` but `--listen` (bind to it): drain, call
    /// limit, host allow-list, TLS, span export. An engine that builds its
    /// own server calls this, so that no option it accepts goes unused.
    /// Starts the span exporter, so it runs inside a tokio runtime.
    pub fn options(self, args: &ServeArgs) -> Result<Self, String> {
        let spans = match &args.otlp_endpoint {
            Some(e) => Some(
                ctxgate_runtime::otlp::Exporter::start(e, &args.otlp_service_name, None)
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
            .socket_mode(args.socket_mode)
            .health_listen(args.health_listen.clone())
            .spans(spans))
    }

    /// Also serves grpc.health.v1 alone, in plaintext, at `endpoint`: a
    /// loopback address or a unix socket (`bind` refuses any other, since
    /// nothing there is authenticated).
    pub fn health_listen(mut self, endpoint: Option<Endpoint>) -> Self {
        self.health_listen = endpoint;
        self
    }

    /// The permissions a unix socket is given (default 0o600).
    pub fn socket_mode(mut self, mode: u32) -> Self {
        self.socket_mode = mode & 0o777;
        self
    }

    /// Exports a span per engine method (see [`crate::otlp`]).
    pub fn spans(mut self, spans: Option<ctxgate_runtime::otlp::Exporter>) -> Self {
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
    /// ([`ctxgate_runtime::tls::LiveServerTls::reload`]).
    pub fn tls(mut self, tls: Option<ctxgate_runtime::tls::LiveServerTls>) -> Self {
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
        if let Some(at) = self.health_listen.as_ref().filter(|at| !at.is_local()) {
            return Err(std::io::Error::other(format!(
                "--health-listen {at}: health is served there without TLS or authentication, so only on a \
                 loopback address or a unix socket"
            )));
        }
        let (listener, local) = listen(endpoint, self.socket_mode).await?;
        let health_listener = match &self.health_listen {
            None => None,
            Some(at) => match listen(at, self.socket_mode).await {
                Ok(l) => Some(l),
                Err(e) => {
                    if let Endpoint::Unix(path) = endpoint {
                        let _ = std::fs::remove_file(path);
                    }
                    return Err(e);
                }
            },
        };
        let reporter = tonic_health::server::HealthReporter::new();
        reporter.set_service_status(ENGINE_SERVICE, ServingStatus::Serving).await;
        let health = tonic_health::pb::health_server::HealthServer::new(
            tonic_health::server::HealthService::from_health_reporter(reporter.clone()),
        );
        let hangup = if self.tls.is_some() { hangup() } else { None };
        Ok(Bound { server: self, listener, local, health_listener, reporter, health, hangup })
    }
}

/// Binds `endpoint`; a unix socket gets `mode` before anything is accepted.
async fn listen(endpoint: &Endpoint, mode: u32) -> std::io::Result<(Listener, Endpoint)> {
    Ok(match endpoint {
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
            // Before anything is accepted: a socket created with the
            // umask's permissions would let every local user in.
            use std::os::unix::fs::PermissionsExt;
            tokio::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).await?;
            (Listener::Unix(l, path.clone()), endpoint.clone())
        }
    })
}

/// Serves `router` on `listener` (with TLS when given) until `stopped`.
fn serve_on<F>(
    router: tonic::transport::server::Router,
    listener: Listener,
    tls: Option<&ctxgate_runtime::tls::LiveServerTls>,
    stopped: F,
) -> Pin<Box<dyn Future<Output = Result<(), tonic::transport::Error>> + Send>>
where
    F: Future<Output = ()> + Send + 'static,
{
    match listener {
        Listener::Tcp(l) => {
            // Nagle off on accepted sockets (the builder's tcp_nodelay only
            // covers sockets it binds itself).
            let incoming = tonic::transport::server::TcpIncoming::from(l).with_nodelay(Some(true));
            let limits = ctxgate_runtime::accept::Limits::default().fitted(1);
            match tls {
                Some(tls) => Box::pin(router.serve_with_incoming_shutdown(
                    ctxgate_runtime::accept::tls(incoming, limits, tls.clone()),
                    stopped,
                )),
                None => Box::pin(
                    router.serve_with_incoming_shutdown(ctxgate_runtime::accept::plain(incoming, limits), stopped),
                ),
            }
        }
        Listener::Unix(l, _) => Box::pin(router.serve_with_incoming_shutdown(UnixListenerStream::new(l), stopped)),
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

    /// Where `--health-listen` serves health alone (port 0 resolved).
    pub fn health_endpoint(&self) -> Option<&Endpoint> {
        self.health_listener.as_ref().map(|(_, at)| at)
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

        let unix_paths: Vec<_> = [Some(&self.listener), self.health_listener.as_ref().map(|(l, _)| l)]
            .into_iter()
            .flatten()
            .filter_map(|l| match l {
                Listener::Unix(_, path) => Some(path.clone()),
                Listener::Tcp(_) => None,
            })
            .collect();
        // Health alone, in plaintext, until this server returns (it reads
        // NOT_SERVING through the drain).
        let _health_only = self.health_listener.map(|(l, _)| {
            let router = ctxgate_runtime::server().add_service(health.clone());
            AbortOnDrop(tokio::spawn(serve_on(router, l, None, std::future::pending())).abort_handle())
        });
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let router = ctxgate_runtime::server().add_service(health).add_service(reflection).add_service(engine);
        let stopped = async move {
            let _ = stop_rx.await;
        };
        let serving = serve_on(router, self.listener, self.server.tls.as_ref(), stopped);
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
        for path in unix_paths {
            let _ = std::fs::remove_file(path);
        }
        result
    }
}
