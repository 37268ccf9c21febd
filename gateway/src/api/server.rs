//! `run(config, listeners, shutdown)`: the whole gateway, the same code for
//! the binary and for tests.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use ctxgate_proto::gateway::gateway_server::GatewayServer;
use ctxgate_proto::gateway::harness_server::HarnessServer;
use ctxgate_runtime::accept;
use ctxgate_runtime::tls::LiveServerTls;
use tokio::net::TcpListener;
use tonic::{Request, Status};
use tonic_health::ServingStatus;

use crate::api::Api;
use crate::api::errors::ErrorResponses;
use crate::api::harness::HarnessApi;
use crate::api::host::HostService;
use crate::config::Config;
use crate::core::Core;

pub const GATEWAY_SERVICE: &str = "ctxgate.v1.Gateway";
pub const HARNESS_SERVICE: &str = "ctxgate.v1.Harness";

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot listen on {addr}: {source}")]
    Bind { addr: SocketAddr, source: std::io::Error },
    #[error(transparent)]
    Store(#[from] crate::store::OpenError),
    #[error(transparent)]
    Start(#[from] crate::core::StartError),
    #[error("{0}")]
    Config(String),
    #[error("{0}")]
    Tls(String),
    #[error("serving failed: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error("metrics endpoint failed: {0}")]
    Metrics(std::io::Error),
}

/// The sockets the gateway serves on, bound before anything else starts:
/// the client API, the Host service engines call back (a listener of its
/// own, so no engine reaches the client API), and metrics.
pub struct Listeners {
    pub api: TcpListener,
    pub host: TcpListener,
    pub metrics: Option<TcpListener>,
}

impl Listeners {
    pub async fn bind(config: &Config) -> Result<Self, ServeError> {
        async fn one(addr: SocketAddr) -> Result<TcpListener, ServeError> {
            TcpListener::bind(addr).await.map_err(|source| ServeError::Bind { addr, source })
        }
        let config_err = |e: crate::config::ConfigError| ServeError::Config(e.to_string());
        let api = one(config.listen_addr().map_err(config_err)?).await?;
        let host = one(config.host_listen_addr().map_err(config_err)?).await?;
        let metrics = match config.metrics_addr().map_err(config_err)? {
            Some(a) => Some(one(a).await?),
            None => None,
        };
        Ok(Self { api, host, metrics })
    }
}

/// Checks `authorization: Bearer <token>` when a token is configured.
#[derive(Clone)]
struct Auth(Option<Arc<str>>);

impl tonic::service::Interceptor for Auth {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        let Some(want) = &self.0 else { return Ok(req) };
        let got =
            req.metadata().get("authorization").and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
        // Constant-time comparison: the token is a secret.
        let ok = got.is_some_and(|g| {
            g.len() == want.len() && g.bytes().zip(want.bytes()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
        });
        if ok {
            Ok(req)
        } else {
            Err(Status::unauthenticated("missing or wrong bearer token: pass --token or set CTXGATE_AUTH_TOKEN"))
        }
    }
}

/// Serves until `shutdown` resolves; then reports NOT_SERVING, cancels
/// running turns and compactions, and drains.
pub async fn run(config: Config, listeners: Listeners, shutdown: impl Future<Output = ()>) -> Result<(), ServeError> {
    let (_keep, reloads) = tokio::sync::mpsc::channel(1);
    let store = crate::store::open(&config).await?;
    run_with_reloads(config, store, listeners, shutdown, reloads).await
}

/// The TLS of both listeners: the client API's (with `clientCa`, if set)
/// and the Host listener's (the same certificate; engines authenticate
/// with their grants, not certificates).
#[derive(Clone)]
struct ListenerTls {
    api: LiveServerTls,
    host: LiveServerTls,
}

impl ListenerTls {
    fn new(t: &crate::config::TlsSection) -> Result<Self, ServeError> {
        let tls = |files| LiveServerTls::new(files).map_err(|e| ServeError::Tls(e.to_string()));
        Ok(Self { api: tls(t.files())?, host: tls(host_files(t))? })
    }

    /// A new `gateway.tls` (SIGHUP): the certificate is replaced for new
    /// connections; a mistake keeps the running one.
    fn reload(&self, t: &crate::config::TlsSection) {
        match self.api.reload(t.files()).and_then(|()| self.host.reload(host_files(t))) {
            Ok(()) => tracing::info!("gateway.tls re-read; new connections use it"),
            Err(e) => tracing::error!(error = %e, "gateway.tls not re-read; keeping the running certificate"),
        }
    }
}

fn host_files(t: &crate::config::TlsSection) -> ctxgate_runtime::tls::ServerFiles {
    ctxgate_runtime::tls::ServerFiles { client_ca: None, ..t.files() }
}

/// Adding or removing TLS takes a restart.
fn reload_tls(live: Option<&ListenerTls>, next: &Config) {
    match (live, &next.gateway.tls) {
        (Some(live), Some(t)) => live.reload(t),
        (None, None) => {}
        _ => tracing::warn!("gateway.tls was added or removed: that takes a restart; the API serves as it started"),
    }
}

/// [`run`] on an opened store, applying every configuration received on
/// `reloads` to the engines (new clients, quarantines cleared, the slot
/// re-resolved).
pub async fn run_with_reloads(
    config: Config,
    store: crate::store::Opened,
    listeners: Listeners,
    shutdown: impl Future<Output = ()>,
    mut reloads: tokio::sync::mpsc::Receiver<Config>,
) -> Result<(), ServeError> {
    let config = Arc::new(config);
    let host_bound = listeners.host.local_addr().map_err(|e| ServeError::Config(e.to_string()))?;
    let core = Core::start(config.clone(), store, config.host_endpoint(host_bound)).await?;
    let metrics = core.metrics().clone();

    // The listeners' TLS (read and checked with the config), swappable on reload.
    let tls = config.gateway.tls.as_ref().map(ListenerTls::new).transpose()?;
    let reloader = {
        let (core, tls) = (core.clone(), tls.clone());
        tokio::spawn(async move {
            while let Some(next) = reloads.recv().await {
                core.reload_engines(&next);
                reload_tls(tls.as_ref(), &next);
            }
        })
    };
    let upkeep = core.spawn_upkeep();
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter.set_service_status(GATEWAY_SERVICE, ServingStatus::Serving).await;
    reporter.set_service_status(HARNESS_SERVICE, ServingStatus::Serving).await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(ctxgate_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .expect("the descriptor sets are valid");
    let auth = Auth(config.gateway.auth.token.as_deref().map(Arc::from));
    let limits = &config.gateway.limits;
    let api = tonic::service::interceptor::InterceptedService::new(
        GatewayServer::new(Api { core: core.clone() }).max_decoding_message_size(limits.max_request_bytes),
        auth.clone(),
    );
    // A harness request carries whole messages (1 MiB of content each).
    let harness = tonic::service::interceptor::InterceptedService::new(
        HarnessServer::new(HarnessApi { core: core.clone() })
            .max_decoding_message_size(ctxgate_proto::limits::MAX_GRPC_MESSAGE_BYTES)
            .max_encoding_message_size(ctxgate_proto::limits::MAX_GRPC_MESSAGE_BYTES),
        auth,
    );

    let connections = limits.connections.limits().fitted(2 + usize::from(listeners.metrics.is_some()));
    let metrics_stop = tokio_util::sync::CancellationToken::new();
    let metrics_task = listeners.metrics.map(|l| {
        let stop = metrics_stop.clone();
        tokio::spawn(crate::metrics::serve(metrics, l, connections, async move { stop.cancelled().await }))
    });

    let stop = tokio_util::sync::CancellationToken::new();
    let serve = Serve { limits, connections, stop: stop.clone() };
    let client_api = serve.router().add_service(health).add_service(reflection).add_service(api).add_service(harness);
    // Engines call back with grants; nothing else is served there.
    let host_api = serve.router().add_service(
        ctxgate_proto::pb::host_server::HostServer::new(HostService { core: core.clone() })
            .max_decoding_message_size(ctxgate_proto::limits::MAX_GRPC_MESSAGE_BYTES)
            .max_encoding_message_size(ctxgate_proto::limits::MAX_GRPC_MESSAGE_BYTES),
    );
    let serving = futures_util::future::try_join(
        serve.on(client_api, listeners.api, tls.as_ref().map(|t| t.api.clone())),
        serve.on(host_api, listeners.host, tls.as_ref().map(|t| t.host.clone())),
    );
    tokio::pin!(serving);
    tokio::pin!(shutdown);
    let result = tokio::select! {
        r = &mut serving => r,
        () = &mut shutdown => {
            tracing::info!("shutting down: cancelling running turns, draining");
            reporter.set_service_status(GATEWAY_SERVICE, ServingStatus::NotServing).await;
            reporter.set_service_status(HARNESS_SERVICE, ServingStatus::NotServing).await;
            core.shutdown();
            stop.cancel();
            tokio::time::timeout(Duration::from_secs(10), &mut serving).await.unwrap_or(Ok(((), ())))
        }
    };
    reloader.abort();
    upkeep.abort();
    metrics_stop.cancel();
    if let Some(t) = metrics_task {
        t.await.map_err(|e| ServeError::Metrics(std::io::Error::other(e)))?.map_err(ServeError::Metrics)?;
    }
    result?;
    Ok(())
}

/// How each listener is served: the same HTTP/2 settings and limits, until
/// `stop`.
struct Serve<'a> {
    limits: &'a crate::config::LimitsSection,
    /// `gateway.limits.connections`, fitted to the descriptor limit.
    connections: ctxgate_runtime::accept::Limits,
    stop: tokio_util::sync::CancellationToken,
}

type Layered = tower::layer::util::Stack<ErrorResponses, tower::layer::util::Identity>;

impl Serve<'_> {
    /// A listener's server, with its own budget of error lines. Peers that
    /// stop answering are closed by the keepalive; idle ones that answer
    /// are bounded by the connection caps and their maximum age.
    fn router(&self) -> tonic::transport::Server<Layered> {
        let l = self.limits;
        let server = ctxgate_runtime::server()
            .max_concurrent_streams(Some(l.max_concurrent_streams_per_connection))
            .http2_keepalive_interval(Some(Duration::from_secs(l.http2_keepalive_seconds)))
            .http2_keepalive_timeout(Some(Duration::from_secs(l.http2_keepalive_timeout_seconds)));
        // No grace: tonic 0.14 with a grace skips the GOAWAY at the age and
        // closes the connection by force at age + grace.
        let server = match l.connections.max_age_seconds {
            0 => server,
            age => server.max_connection_age(Duration::from_secs(age)),
        };
        server.layer(ErrorResponses::default())
    }

    /// Serves `router` on `listener` (TLS when given), each connection
    /// admitted under `gateway.limits.connections`.
    fn on(
        &self,
        router: tonic::transport::server::Router<Layered>,
        listener: TcpListener,
        tls: Option<LiveServerTls>,
    ) -> std::pin::Pin<Box<dyn Future<Output = Result<(), tonic::transport::Error>> + Send>> {
        // Nagle off on accepted sockets: otherwise small streamed events wait
        // for delayed ACKs (measured: ~40 ms a turn).
        let incoming = tonic::transport::server::TcpIncoming::from(listener)
            .with_nodelay(Some(true))
            .with_keepalive(Some(Duration::from_secs(self.limits.tcp_keepalive_seconds)));
        let limits = self.connections;
        let stop = self.stop.clone();
        let stopped = async move { stop.cancelled().await };
        match tls {
            Some(tls) => Box::pin(router.serve_with_incoming_shutdown(accept::tls(incoming, limits, tls), stopped)),
            None => Box::pin(router.serve_with_incoming_shutdown(accept::plain(incoming, limits), stopped)),
        }
    }
}
