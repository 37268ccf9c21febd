//! Configuration: one JSON5 file whose keys mirror OpenClaw's, then
//! `CTXGATE_*` environment overrides, then validation — all before any port
//! is bound. No file at all is fine: every key has a default.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ctxgate_engine_sdk::tls;
use ctxgate_proto::Method;
use serde::Deserialize;

/// A configuration problem, always naming the key path.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("config {key}: {message}")]
    Invalid { key: String, message: String },
}

fn invalid(key: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { key: key.to_owned(), message: message.into() }
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct Config {
    pub gateway: GatewaySection,
    /// Where the gateway keeps its SQLite store.
    pub state_dir: PathBuf,
    /// A shared store instead (several gateways on one state).
    pub store: StoreSection,
    pub models: ModelsSection,
    pub agents: AgentsSection,
    pub plugins: PluginsSection,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct GatewaySection {
    /// The client API (gRPC). Loopback by default.
    pub listen: String,
    /// Prometheus `/metrics` over HTTP; empty disables it.
    pub metrics_listen: String,
    pub auth: AuthSection,
    /// Where engines reach the gateway's Host service. Default: the API
    /// address (127.0.0.1 when listening on all interfaces). Set it when
    /// engines run in other containers.
    pub host_endpoint: Option<String>,
    pub limits: LimitsSection,
    /// TLS on the client API (and the Host service engines call back).
    pub tls: Option<TlsSection>,
    /// Spans exported over OTLP/gRPC (read at start).
    pub otlp: Option<OtlpSection>,
}

/// `gateway.otlp`: where the gateway sends its spans (each turn, each
/// engine call), continuing the client's `traceparent`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct OtlpSection {
    /// An OTLP/gRPC collector, `http://HOST:PORT` (usually port 4317).
    pub endpoint: String,
    /// The spans' `service.name`.
    #[serde(default = "default_service_name")]
    pub service_name: String,
}

fn default_service_name() -> String {
    "ctxgate".into()
}

/// `gateway.tls`: the API's certificate and key (PEM); with `clientCa`,
/// every client must present a certificate that CA signed (mTLS).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct TlsSection {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_ca: Option<PathBuf>,
}

impl TlsSection {
    /// The files, each named by its key.
    pub fn files(&self) -> ctxgate_engine_sdk::tls::ServerFiles {
        let named = |key: &str, path: &PathBuf| (key.to_owned(), path.clone());
        ctxgate_engine_sdk::tls::ServerFiles {
            cert: named("gateway.tls.cert", &self.cert),
            key: named("gateway.tls.key", &self.key),
            client_ca: self.client_ca.as_ref().map(|p| named("gateway.tls.clientCa", p)),
        }
    }

    /// The API's TLS, read now: a file that cannot be read, holds no PEM,
    /// or a key that does not match its certificate is a sentence naming
    /// its key. SIGHUP can replace it while the gateway serves.
    pub fn live(&self) -> Result<ctxgate_engine_sdk::tls::LiveServerTls, ConfigError> {
        ctxgate_engine_sdk::tls::LiveServerTls::new(self.files()).map_err(|m| invalid("gateway.tls", m))
    }
}

impl Default for GatewaySection {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:7300".into(),
            metrics_listen: String::new(),
            auth: AuthSection::default(),
            host_endpoint: None,
            limits: LimitsSection::default(),
            tls: None,
            otlp: None,
        }
    }
}

/// `gateway.limits`: what clients may hold at once.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct LimitsSection {
    /// Turns that may wait behind a session's running turn (busy policy
    /// enqueue); one more is RESOURCE_EXHAUSTED.
    pub queued_turns_per_session: usize,
    /// A harness stream that sends nothing for this long is ended (its
    /// turn aborted), so a silent client cannot hold a session.
    pub harness_idle_seconds: u64,
    /// Turns (running or waiting for their session) the gateway takes at
    /// once; one more is shed at once with RESOURCE_EXHAUSTED and a retry
    /// pushback, never queued.
    pub max_concurrent_turns: usize,
    /// HTTP/2 streams one client connection may have open at once; more
    /// are refused by the HTTP/2 layer (REFUSED_STREAM), not queued.
    pub max_concurrent_streams_per_connection: u32,
    /// The largest request message the client API decodes (bytes); over it
    /// is RESOURCE_EXHAUSTED.
    pub max_request_bytes: usize,
    /// HTTP/2 PING every this many seconds on idle connections, and the
    /// connection is closed when a ping is not answered within the timeout.
    pub http2_keepalive_seconds: u64,
    pub http2_keepalive_timeout_seconds: u64,
    /// TCP keepalive probes on accepted sockets (seconds).
    pub tcp_keepalive_seconds: u64,
    /// The turn limit follows measured latency below `maxConcurrentTurns`
    /// (`core::admission`).
    pub adaptive_concurrency: AdaptiveConcurrency,
}

/// `gateway.limits.adaptiveConcurrency`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct AdaptiveConcurrency {
    /// `false`: the limit is `maxConcurrentTurns`, fixed.
    pub enabled: bool,
    /// The limit at start (within minLimit..=maxConcurrentTurns).
    pub initial_limit: usize,
    /// The limit never goes below this (nor above maxConcurrentTurns).
    pub min_limit: usize,
    /// How much slower than the best seen a window's p90 gateway latency
    /// may be before the limit shrinks (1.1–10).
    pub tolerance: f64,
}

impl Default for AdaptiveConcurrency {
    fn default() -> Self {
        // Tolerance 2, measured with `loadgen overload` (docs/benchmarks.md):
        // under 4× overload it kept admitted p99 within 1.1× (legacy) and
        // 1.9× (window engine) of unloaded; 4 let the window engine's reach
        // 4×. 4 keeps more closed-loop throughput (legacy 1058 vs 863
        // turns/s at 64 sessions): a choice for operators who prefer it.
        Self { enabled: true, initial_limit: 32, min_limit: 4, tolerance: 2.0 }
    }
}

impl Default for LimitsSection {
    fn default() -> Self {
        Self {
            queued_turns_per_session: 8,
            harness_idle_seconds: 300,
            max_concurrent_turns: 1024,
            max_concurrent_streams_per_connection: 256,
            max_request_bytes: 4 * 1024 * 1024,
            http2_keepalive_seconds: 30,
            http2_keepalive_timeout_seconds: 10,
            tcp_keepalive_seconds: 60,
            adaptive_concurrency: AdaptiveConcurrency::default(),
        }
    }
}

/// `store`: unset, the gateway keeps SQLite in `stateDir`; a
/// `postgres://` URL shares one PostgreSQL among several gateways.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct StoreSection {
    /// `postgres://user[:password]@host[:port]/database` (env
    /// `CTXGATE_STORE_URL`).
    pub url: Option<String>,
    /// How long a session lease lasts unless renewed (renewed every third
    /// of it while a turn runs): how soon a dead gateway's sessions are
    /// taken over.
    pub lease_seconds: f64,
    /// PostgreSQL connections this gateway keeps at most.
    pub pool_size: usize,
    /// PEM certificates to trust for the server when the URL asks for TLS
    /// (`sslmode=require`); default: the public web roots.
    pub ca_file: Option<PathBuf>,
}

impl Default for StoreSection {
    fn default() -> Self {
        Self { url: None, lease_seconds: 10.0, pool_size: 16, ca_file: None }
    }
}

impl StoreSection {
    pub fn lease(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.lease_seconds)
    }
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct AuthSection {
    /// When set, every client call needs `authorization: Bearer <token>`.
    pub token: Option<String>,
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ProviderKind {
    /// Deterministic, local, no key: the embedded default.
    Offline,
    /// Any OpenAI-compatible chat-completions endpoint.
    Openai,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct ModelsSection {
    pub provider: ProviderKind,
    /// e.g. `https://api.openai.com/v1` (the provider appends `/chat/completions`).
    pub base_url: String,
    pub api_key: Option<String>,
    pub model: String,
    /// Tokens the model accepts (prompt + output).
    pub context_window: u64,
    pub max_output_tokens: u64,
    /// One model request may take this long before it counts as a timeout.
    pub request_timeout_seconds: u64,
}

impl Default for ModelsSection {
    fn default() -> Self {
        Self {
            provider: ProviderKind::Offline,
            base_url: String::new(),
            api_key: None,
            model: "offline".into(),
            context_window: 32_000,
            max_output_tokens: 1024,
            request_timeout_seconds: 120,
        }
    }
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct AgentsSection {
    pub defaults: AgentDefaults,
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct AgentDefaults {
    pub compaction: CompactionConfig,
}

/// `agents.defaults.compaction.*` (OpenClaw's names and defaults).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct CompactionConfig {
    /// The safety timeout: one window per model request of built-in
    /// compaction, one for an engine's whole Compact.
    pub timeout_seconds: u64,
    /// Recent history kept verbatim.
    pub keep_recent_tokens: u64,
    /// Tokens kept free for the reply; unset: min(16384, window / 4).
    pub reserve_tokens: Option<u64>,
    /// Whole recent turns always kept verbatim, whatever their size.
    pub recent_turns_preserve: u32,
    pub quality_guard: QualityGuard,
    pub identifier_policy: IdentifierPolicy,
}

impl Default for CompactionConfig {
    fn default() -> Self {
        Self {
            timeout_seconds: 180,
            keep_recent_tokens: 20_000,
            reserve_tokens: None,
            recent_turns_preserve: 0,
            quality_guard: QualityGuard::default(),
            identifier_policy: IdentifierPolicy::Strict,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct QualityGuard {
    pub enabled: bool,
    /// Regenerations after a failed audit.
    pub max_retries: u32,
}

impl Default for QualityGuard {
    fn default() -> Self {
        Self { enabled: true, max_retries: 1 }
    }
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum IdentifierPolicy {
    /// Summaries must keep every identifier of the history they replace.
    Strict,
    Off,
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct PluginsSection {
    pub slots: Slots,
    /// Remote context engines by id (`legacy` is reserved).
    pub entries: std::collections::BTreeMap<String, EngineEntry>,
    /// Engine ids that may not be selected (the slot falls back to legacy).
    pub deny: Vec<String>,
}

/// `plugins.entries.<id>`: one remote engine.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct EngineEntry {
    pub enabled: bool,
    /// `http://HOST:PORT`, `https://HOST:PORT`, `unix:///PATH`, or
    /// `dns:///NAME:PORT` (every address NAME resolves to is a replica).
    pub endpoint: EngineEndpoint,
    /// Per-method call timeouts in seconds: `default` and RPC names in
    /// camelCase (`assemble`, `compact`, …). `compact` defaults to
    /// `agents.defaults.compaction.timeoutSeconds`.
    pub timeouts: std::collections::BTreeMap<String, f64>,
    /// Largest reply accepted from this engine.
    pub max_message_bytes: usize,
    /// Calls in flight to this engine at once; one more is shed (legacy
    /// answers it) without quarantine.
    pub max_concurrent_calls: usize,
    /// TLS to the engine (the endpoint is then `https://HOST:PORT`, or
    /// `dns:///NAME:PORT` with this set).
    pub tls: Option<EngineTls>,
}

/// Where an entry's engine runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// One address, dialled as written.
    One(ctxgate_engine_sdk::Endpoint),
    /// `dns:///NAME:PORT`: every A/AAAA record of NAME is a replica
    /// (a Kubernetes headless service, a compose service with replicas).
    Dns { host: String, port: u16 },
    /// gRPC's static lists, `ipv4:ADDR:PORT,ADDR:PORT` and
    /// `ipv6:[ADDR]:PORT,…`: each address is a replica. Sorted, no repeats.
    Static(Vec<std::net::SocketAddr>),
}

impl Target {
    /// The address to dial when one connection will do (doctor, the
    /// placeholder replica while NAME resolves to nothing): the name,
    /// resolved when connecting.
    pub fn by_name(&self) -> ctxgate_engine_sdk::Endpoint {
        match self {
            Self::One(e) => e.clone(),
            Self::Static(addrs) => ctxgate_engine_sdk::Endpoint::Tcp(addrs[0]),
            Self::Dns { host, port } => match host.parse::<std::net::IpAddr>() {
                Ok(ip) => ctxgate_engine_sdk::Endpoint::Tcp(std::net::SocketAddr::new(ip, *port)),
                Err(_) => ctxgate_engine_sdk::Endpoint::Host(host.clone(), *port),
            },
        }
    }
}

const ENDPOINT_FORMS: &str = "expected http://HOST:PORT, https://HOST:PORT, dns:///NAME:PORT, ipv4:ADDR:PORT,… , ipv6:[ADDR]:PORT,… or unix:///PATH";

/// The most replicas one entry may name (a static list, or the addresses
/// kept from one resolution): a name is not a way to make the gateway open
/// unbounded connections.
pub const MAX_REPLICAS: usize = 64;

/// `plugins.entries.<id>.tls`: what the gateway trusts and presents.
#[derive(Debug, Clone, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct EngineTls {
    /// The CA (PEM) the engine's certificate must chain to (default: the
    /// public web roots).
    pub ca: Option<PathBuf>,
    /// The gateway's client certificate and key (PEM), for engines that
    /// require one (mTLS).
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    /// The name the engine's certificate must carry (default: the
    /// endpoint's host).
    pub server_name: Option<String>,
}

impl EngineEntry {
    /// Whether calls to this engine use TLS: `https://`, or `dns:///` with
    /// a `tls` section.
    pub fn uses_tls(&self) -> bool {
        let replicas = matches!(self.endpoint.target, Ok(Target::Dns { .. } | Target::Static(_)));
        self.endpoint.text.starts_with("https://") || (replicas && self.tls.is_some())
    }

    /// Where the engine runs, as parsed when the config was read.
    pub fn target(&self) -> Result<Target, String> {
        self.endpoint.target.clone()
    }

    /// The client TLS files of an https:// engine, checked now (read, and
    /// made into a client configuration once, so that a key that is not
    /// one, or does not match, is said at start).
    pub fn client_tls(&self, id: &str) -> Result<tls::ClientFiles, ConfigError> {
        let key = |k: &str| format!("plugins.entries.{id}.tls.{k}");
        let t = self.tls.clone().unwrap_or_default();
        if t.cert.is_some() != t.key.is_some() {
            return Err(invalid(&key("cert"), "cert and key go together"));
        }
        // A replica is dialled at its address: its certificate must name
        // the service (the DNS name) unless serverName says otherwise.
        let dns_host = match &self.endpoint.target {
            Ok(Target::Dns { host, .. }) => Some(host.clone()),
            _ => None,
        };
        let files = tls::ClientFiles {
            ca: t.ca.map(|p| (key("ca"), p)),
            identity: t.cert.zip(t.key).map(|(cert, k)| ((key("cert"), cert), (key("key"), k))),
            server_name: t.server_name.or(dns_host),
        };
        // The message names the key and the file: "plugins.entries.ID.tls.ca /path: …".
        let tls = tls::client_config(&files).map_err(|e| invalid(&format!("plugins.entries.{id}.tls"), e))?;
        tls::check_client(tls).map_err(|e| invalid(&key("cert"), e))?;
        Ok(files)
    }
}

/// `plugins.entries.<id>.endpoint`: the text as written and where it
/// points, parsed once when the config is read. A text that does not parse
/// is kept with its error, which validation reports under the entry's key.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(from = "String")]
pub struct EngineEndpoint {
    text: String,
    target: Result<Target, String>,
}

impl EngineEndpoint {
    pub fn as_str(&self) -> &str {
        &self.text
    }
}

impl From<String> for EngineEndpoint {
    fn from(text: String) -> Self {
        let target = parse_target(&text);
        Self { text, target }
    }
}

impl From<&str> for EngineEndpoint {
    fn from(text: &str) -> Self {
        text.to_owned().into()
    }
}

impl Default for EngineEndpoint {
    fn default() -> Self {
        String::new().into()
    }
}

impl std::fmt::Display for EngineEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

/// Where `endpoint` points: one address, a name of replicas, or a list.
fn parse_target(endpoint: &str) -> Result<Target, String> {
    let bad = || format!("{endpoint:?}: {ENDPOINT_FORMS}");
    if let Some(rest) = endpoint.strip_prefix("dns:///") {
        // An IP literal is a name that resolves to itself.
        let (host, port) = rest.rsplit_once(':').ok_or_else(bad)?;
        let port: u16 = port.parse().map_err(|_| bad())?;
        let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
        let name = host.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.');
        if host.is_empty() || !(name || host.parse::<std::net::IpAddr>().is_ok()) {
            return Err(bad());
        }
        return Ok(Target::Dns { host: host.to_owned(), port });
    }
    for (prefix, v6) in [("ipv4:", false), ("ipv6:", true)] {
        let Some(list) = endpoint.strip_prefix(prefix) else { continue };
        let mut addrs = Vec::new();
        for a in list.split(',') {
            let a: std::net::SocketAddr =
                a.trim().parse().map_err(|_| format!("{endpoint:?}: {a:?} is not ADDR:PORT"))?;
            if a.is_ipv6() != v6 {
                return Err(format!("{endpoint:?}: {a} is not an {} address", &prefix[..4]));
            }
            addrs.push(a);
        }
        addrs.sort();
        addrs.dedup();
        if addrs.len() > MAX_REPLICAS {
            return Err(format!("{endpoint:?}: at most {MAX_REPLICAS} replicas"));
        }
        return Ok(Target::Static(addrs));
    }
    let address = endpoint.strip_prefix("https://").unwrap_or(endpoint);
    address.parse().map(Target::One).map_err(|_| bad())
}

impl Default for EngineEntry {
    fn default() -> Self {
        Self {
            enabled: true,
            endpoint: EngineEndpoint::default(),
            timeouts: Default::default(),
            max_message_bytes: ctxgate_proto::limits::MAX_GRPC_MESSAGE_BYTES,
            max_concurrent_calls: 256,
            tls: None,
        }
    }
}

/// The key of `plugins.entries.<id>.timeouts` that applies to every
/// method without a key of its own (the others are `Method::config_key`s).
pub const DEFAULT_TIMEOUT_KEY: &str = "default";

/// Default per-call timeout for engine methods other than compact.
pub const DEFAULT_ENGINE_TIMEOUT_SECONDS: f64 = 10.0;

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct Slots {
    /// Unset, "", "legacy" or "none" select the in-process legacy engine.
    pub context_engine: Option<String>,
}

impl Slots {
    /// What `contextEngine` names.
    pub fn context_engine(&self) -> EngineSlot<'_> {
        match self.context_engine.as_deref().map(str::trim) {
            Some(id) if !EngineSlot::reserved(id) => EngineSlot::Named(id),
            _ => EngineSlot::Legacy,
        }
    }
}

/// What an engine slot names: the in-process legacy engine, or an entry.
/// The one place that knows which ids are legacy's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineSlot<'a> {
    Legacy,
    Named(&'a str),
}

impl EngineSlot<'_> {
    /// Ids that name the legacy engine ("", "legacy", "none"), which no
    /// entry may take.
    pub fn reserved(id: &str) -> bool {
        matches!(id.trim(), "" | "none") || id.trim() == ctxgate_proto::LEGACY_ENGINE_ID
    }
}

/// The environment variables read as overrides, with the key each replaces.
pub const ENV_OVERRIDES: &[(&str, &str)] = &[
    ("CTXGATE_LISTEN", "gateway.listen"),
    ("CTXGATE_METRICS_LISTEN", "gateway.metricsListen"),
    ("CTXGATE_AUTH_TOKEN", "gateway.auth.token"),
    ("CTXGATE_OTLP_ENDPOINT", "gateway.otlp.endpoint"),
    ("CTXGATE_STATE_DIR", "stateDir"),
    ("CTXGATE_STORE_URL", "store.url"),
    ("CTXGATE_MODEL_PROVIDER", "models.provider"),
    ("CTXGATE_MODEL_BASE_URL", "models.baseUrl"),
    ("CTXGATE_MODEL_API_KEY", "models.apiKey"),
    ("CTXGATE_MODEL", "models.model"),
    ("CTXGATE_CONTEXT_WINDOW", "models.contextWindow"),
];

impl Config {
    /// Loads `path` (or defaults when `None`), applies `env`, validates.
    pub fn load(path: Option<&Path>, env: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let mut config = match path {
            Some(p) => Self::parse(p)?,
            None => Self::default(),
        };
        config.apply_env(env)?;
        config.validate()?;
        Ok(config)
    }

    fn parse(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.into(), source })?;
        Self::parse_text(&text, path)
    }

    /// The config in `text` (errors name `path`), validated; no
    /// environment overrides.
    pub fn from_text(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let mut config = Self::parse_text(text, path)?;
        config.validate()?;
        Ok(config)
    }

    fn parse_text(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let parse_err = |message: String| ConfigError::Parse { path: path.into(), message };
        let mut de = json5::Deserializer::from_str(text).map_err(|e| parse_err(e.to_string()))?;
        serde_path_to_error::deserialize(&mut de).map_err(|e| {
            let at = e.path().to_string();
            parse_err(format!("at {at}: {}", e.into_inner()))
        })
    }

    fn apply_env(&mut self, env: impl Fn(&str) -> Option<String>) -> Result<(), ConfigError> {
        for (var, key) in ENV_OVERRIDES {
            let Some(v) = env(var) else { continue };
            let number = || v.parse::<u64>().map_err(|_| invalid(key, format!("{var}={v:?} is not a whole number")));
            match *var {
                "CTXGATE_LISTEN" => self.gateway.listen = v,
                "CTXGATE_METRICS_LISTEN" => self.gateway.metrics_listen = v,
                "CTXGATE_AUTH_TOKEN" => self.gateway.auth.token = Some(v),
                "CTXGATE_OTLP_ENDPOINT" => {
                    self.gateway.otlp = Some(v).filter(|v| !v.is_empty()).map(|endpoint| OtlpSection {
                        endpoint,
                        service_name: self.gateway.otlp.take().map_or_else(default_service_name, |o| o.service_name),
                    })
                }
                "CTXGATE_STATE_DIR" => self.state_dir = v.into(),
                "CTXGATE_STORE_URL" => self.store.url = Some(v).filter(|v| !v.is_empty()),
                "CTXGATE_MODEL_PROVIDER" => {
                    self.models.provider = match v.as_str() {
                        "offline" => ProviderKind::Offline,
                        "openai" => ProviderKind::Openai,
                        _ => return Err(invalid(key, format!("{var}={v:?}: expected offline or openai"))),
                    }
                }
                "CTXGATE_MODEL_BASE_URL" => self.models.base_url = v,
                "CTXGATE_MODEL_API_KEY" => self.models.api_key = Some(v),
                "CTXGATE_MODEL" => self.models.model = v,
                "CTXGATE_CONTEXT_WINDOW" => self.models.context_window = number()?,
                _ => {}
            }
        }
        Ok(())
    }

    fn validate(&mut self) -> Result<(), ConfigError> {
        self.listen_addr()?;
        self.metrics_addr()?;
        if self.state_dir.as_os_str().is_empty() {
            self.state_dir = PathBuf::from("ctxgate-state");
        }
        if let Some(url) = &self.store.url {
            if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
                return Err(invalid(
                    "store.url",
                    "expected a postgres:// URL (leave it unset for SQLite in stateDir)".to_string(),
                ));
            }
            if let Err(e) = url.parse::<tokio_postgres::Config>() {
                return Err(invalid("store.url", format!("not a PostgreSQL URL: {e}")));
            }
        }
        if let Some(tls) = &self.gateway.tls {
            tls.live()?;
        }
        if let Some(o) = &self.gateway.otlp {
            let ok = matches!(
                o.endpoint.parse::<ctxgate_engine_sdk::Endpoint>(),
                Ok(ctxgate_engine_sdk::Endpoint::Tcp(_) | ctxgate_engine_sdk::Endpoint::Host(..))
            );
            if !ok || o.endpoint.starts_with("https://") {
                return Err(invalid("gateway.otlp.endpoint", format!("{:?}: expected http://HOST:PORT", o.endpoint)));
            }
            if o.service_name.trim().is_empty() {
                return Err(invalid("gateway.otlp.serviceName", "must not be empty"));
            }
        }
        let lease = self.store.lease_seconds;
        if !(lease.is_finite() && (1.0..=3600.0).contains(&lease)) {
            return Err(invalid("store.leaseSeconds", format!("{lease} is outside 1–3600")));
        }
        if !(1..=1024).contains(&self.store.pool_size) {
            return Err(invalid("store.poolSize", format!("{} is outside 1–1024", self.store.pool_size)));
        }
        if let Some(e) = &self.gateway.host_endpoint
            && self.gateway.tls.is_some()
            && !e.starts_with("https://")
        {
            return Err(invalid("gateway.hostEndpoint", "with gateway.tls the Host service is TLS too: use https://"));
        }
        if let Some(e) = &self.gateway.host_endpoint
            && e.strip_prefix("https://").unwrap_or(e).parse::<ctxgate_engine_sdk::Endpoint>().is_err()
        {
            return Err(invalid(
                "gateway.hostEndpoint",
                format!("{e:?}: expected http://HOST:PORT, https://HOST:PORT or unix:///PATH"),
            ));
        }
        if self.gateway.limits.queued_turns_per_session > 10_000 {
            return Err(invalid("gateway.limits.queuedTurnsPerSession", "is over 10000"));
        }
        let l = &self.gateway.limits;
        if l.harness_idle_seconds == 0 {
            return Err(invalid("gateway.limits.harnessIdleSeconds", "must be positive"));
        }
        if l.max_concurrent_turns == 0 || l.max_concurrent_turns > 1_000_000 {
            return Err(invalid("gateway.limits.maxConcurrentTurns", "must be between 1 and 1000000"));
        }
        let a = &l.adaptive_concurrency;
        if a.min_limit == 0 || a.initial_limit == 0 {
            let key = if a.min_limit == 0 { "minLimit" } else { "initialLimit" };
            return Err(invalid(&format!("gateway.limits.adaptiveConcurrency.{key}"), "must be positive"));
        }
        if !(1.1..=10.0).contains(&a.tolerance) {
            return Err(invalid("gateway.limits.adaptiveConcurrency.tolerance", "must be between 1.1 and 10"));
        }
        if l.max_concurrent_streams_per_connection == 0 {
            return Err(invalid("gateway.limits.maxConcurrentStreamsPerConnection", "must be positive"));
        }
        // The harness carries whole turns: the contract's gRPC limit bounds it too.
        if l.max_request_bytes < 64 * 1024 || l.max_request_bytes > ctxgate_proto::limits::MAX_GRPC_MESSAGE_BYTES {
            return Err(invalid(
                "gateway.limits.maxRequestBytes",
                format!("must be between 65536 and {}", ctxgate_proto::limits::MAX_GRPC_MESSAGE_BYTES),
            ));
        }
        for (key, v) in [
            ("gateway.limits.http2KeepaliveSeconds", l.http2_keepalive_seconds),
            ("gateway.limits.http2KeepaliveTimeoutSeconds", l.http2_keepalive_timeout_seconds),
            ("gateway.limits.tcpKeepaliveSeconds", l.tcp_keepalive_seconds),
        ] {
            if v == 0 {
                return Err(invalid(key, "must be positive"));
            }
        }
        if self.gateway.auth.token.as_deref().is_some_and(|t| t.trim().is_empty()) {
            return Err(invalid("gateway.auth.token", "is blank; remove it to disable auth"));
        }
        let m = &self.models;
        if m.context_window < 2_000 {
            return Err(invalid("models.contextWindow", format!("{} is too small (at least 2000)", m.context_window)));
        }
        if m.max_output_tokens == 0 || m.max_output_tokens >= m.context_window {
            return Err(invalid("models.maxOutputTokens", "must be positive and below models.contextWindow"));
        }
        if m.request_timeout_seconds == 0 {
            return Err(invalid("models.requestTimeoutSeconds", "must be positive"));
        }
        if m.provider == ProviderKind::Openai {
            let url = reqwest::Url::parse(&m.base_url)
                .map_err(|e| invalid("models.baseUrl", format!("{:?} is not a URL ({e})", m.base_url)))?;
            if !matches!(url.scheme(), "http" | "https") {
                return Err(invalid("models.baseUrl", "must be http:// or https://"));
            }
            if m.model.trim().is_empty() || m.model == "offline" {
                return Err(invalid("models.model", "name the provider's model"));
            }
        }
        let c = &self.agents.defaults.compaction;
        if !(1..=3600).contains(&c.timeout_seconds) {
            return Err(invalid("agents.defaults.compaction.timeoutSeconds", "must be between 1 and 3600"));
        }
        if let Some(r) = c.reserve_tokens
            && r + 1_000 > m.context_window
        {
            return Err(invalid(
                "agents.defaults.compaction.reserveTokens",
                format!("{r} leaves less than 1000 tokens of the {}-token window", m.context_window),
            ));
        }
        for (id, e) in &self.plugins.entries {
            let key = |k: &str| format!("plugins.entries.{id}.{k}");
            if EngineSlot::reserved(id) {
                return Err(invalid(
                    &format!("plugins.entries.{id}"),
                    "this id is reserved for the core-owned legacy engine",
                ));
            }
            ctxgate_proto::validate::id(id, "id").map_err(|v| invalid(&format!("plugins.entries.{id}"), v.problem))?;
            let target = e.target().map_err(|m| invalid(&key("endpoint"), m))?;
            for (m, secs) in &e.timeouts {
                if m != DEFAULT_TIMEOUT_KEY && Method::from_config_key(m).is_none() {
                    let keys: Vec<&str> = Method::ALL.iter().map(|m| m.config_key()).collect();
                    return Err(invalid(
                        &key("timeouts"),
                        format!("unknown method {m:?} (expected one of {DEFAULT_TIMEOUT_KEY}, {})", keys.join(", ")),
                    ));
                }
                if !(secs.is_finite() && *secs > 0.0 && *secs <= 3600.0) {
                    return Err(invalid(&key(&format!("timeouts.{m}")), "must be between 0 and 3600 seconds"));
                }
            }
            if e.max_message_bytes < 1024 {
                return Err(invalid(&key("maxMessageBytes"), "must be at least 1024"));
            }
            if !(1..=100_000).contains(&e.max_concurrent_calls) {
                return Err(invalid(&key("maxConcurrentCalls"), "must be between 1 and 100000"));
            }
            if e.tls.is_some() && !e.uses_tls() {
                return Err(invalid(&key("tls"), "TLS needs an https://HOST:PORT or dns:///NAME:PORT endpoint"));
            }
            if e.uses_tls() {
                if matches!(target, Target::One(ctxgate_engine_sdk::Endpoint::Unix(_))) {
                    return Err(invalid(&key("endpoint"), "a unix socket takes no TLS"));
                }
                e.client_tls(id)?;
            }
        }
        Ok(())
    }

    /// The engine the slot selects, if it is a usable remote entry. Unset,
    /// "", "legacy", "none", a disabled, denied or missing entry → `None`
    /// (legacy). A missing entry is what removing the selected entry leaves
    /// behind: the slot resets to legacy.
    pub fn selected_engine(&self) -> Option<(&str, &EngineEntry)> {
        let EngineSlot::Named(id) = self.plugins.slots.context_engine() else { return None };
        if self.plugins.deny.iter().any(|d| d == id) {
            return None;
        }
        let (id, entry) = self.plugins.entries.get_key_value(id)?;
        entry.enabled.then_some((id.as_str(), entry))
    }

    pub fn listen_addr(&self) -> Result<SocketAddr, ConfigError> {
        self.gateway
            .listen
            .parse()
            .map_err(|_| invalid("gateway.listen", format!("{:?} is not HOST:PORT", self.gateway.listen)))
    }

    pub fn metrics_addr(&self) -> Result<Option<SocketAddr>, ConfigError> {
        if self.gateway.metrics_listen.is_empty() {
            return Ok(None);
        }
        self.gateway.metrics_listen.parse().map(Some).map_err(|_| {
            invalid("gateway.metricsListen", format!("{:?} is not HOST:PORT", self.gateway.metrics_listen))
        })
    }

    /// Where engines reach the Host service, given the bound API address.
    pub fn host_endpoint(&self, bound: SocketAddr) -> String {
        if let Some(e) = &self.gateway.host_endpoint {
            return e.clone();
        }
        let ip = if bound.ip().is_unspecified() { std::net::IpAddr::from([127, 0, 0, 1]) } else { bound.ip() };
        // The Host service shares the API port, and its TLS.
        let scheme = if self.gateway.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}", SocketAddr::new(ip, bound.port()))
    }

    /// Tokens kept free for the reply.
    pub fn reserve_tokens(&self) -> u64 {
        self.agents.defaults.compaction.reserve_tokens.unwrap_or_else(|| (self.models.context_window / 4).min(16_384))
    }

    pub fn compaction_timeout(&self) -> Duration {
        Duration::from_secs(self.agents.defaults.compaction.timeout_seconds)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load_str(text: &str) -> Result<Config, ConfigError> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.json5");
        std::fs::write(&p, text).unwrap();
        Config::load(Some(&p), |_| None)
    }

    #[test]
    fn no_file_gives_working_defaults() {
        let c = Config::load(None, |_| None).unwrap();
        assert_eq!(c.listen_addr().unwrap().to_string(), "127.0.0.1:7300");
        assert_eq!(c.models.provider, ProviderKind::Offline);
        assert_eq!(c.agents.defaults.compaction.timeout_seconds, 180);
        assert_eq!(c.reserve_tokens(), 8_000);
    }

    #[test]
    fn json5_with_comments_and_openclaw_keys() {
        let c = load_str(
            "{ // comment\n agents: { defaults: { compaction: { keepRecentTokens: 500, timeoutSeconds: 5 } } },\n plugins: { slots: { contextEngine: 'legacy' } }, }",
        )
        .unwrap();
        assert_eq!(c.agents.defaults.compaction.keep_recent_tokens, 500);
    }

    #[test]
    fn unknown_keys_and_bad_values_name_their_path() {
        let e = load_str("{ agents: { defaults: { compaction: { keepRecentTokenz: 5 } } } }").unwrap_err().to_string();
        assert!(e.contains("agents.defaults.compaction") && e.contains("keepRecentTokenz"), "{e}");
        let e = load_str("{ models: { contextWindow: 'big' } }").unwrap_err().to_string();
        assert!(e.contains("models.contextWindow"), "{e}");
        let e = load_str("{ gateway: { listen: 'nowhere' } }").unwrap_err().to_string();
        assert!(e.contains("gateway.listen"), "{e}");
        let e = load_str("{ plugins: { entries: { legacy: { endpoint: 'http://127.0.0.1:1' } } } }")
            .unwrap_err()
            .to_string();
        assert!(e.contains("plugins.entries.legacy") && e.contains("reserved"), "{e}");
        let e = load_str("{ plugins: { entries: { w: { endpoint: 'ftp://x' } } } }").unwrap_err().to_string();
        assert!(e.contains("plugins.entries.w.endpoint"), "{e}");
        for bad in [
            "dns:///",
            "dns:///name",
            "dns:///na me:1",
            "dns:///unix:///x",
            "dns://name:1",
            "ipv4:",
            "ipv4:1.2.3.4",
            "ipv4:[::1]:1",
            "ipv6:127.0.0.1:1",
        ] {
            let e = load_str(&format!("{{ plugins: {{ entries: {{ w: {{ endpoint: '{bad}' }} }} }} }}"))
                .unwrap_err()
                .to_string();
            assert!(e.contains("plugins.entries.w.endpoint") && e.contains(&format!("{bad:?}")), "{bad}: {e}");
        }
        for bad in ["unix:///tmp/c.sock", "https://collector:4317", "not an endpoint"] {
            let e = load_str(&format!("{{ gateway: {{ otlp: {{ endpoint: '{bad}' }} }} }}")).unwrap_err().to_string();
            assert!(e.contains("gateway.otlp.endpoint") && e.contains("http://HOST:PORT"), "{bad}: {e}");
        }
        let c = load_str("{ gateway: { otlp: { endpoint: 'http://collector:4317' } } }").unwrap();
        assert_eq!(c.gateway.otlp.map(|o| o.service_name).as_deref(), Some("ctxgate"));
        let c = load_str("{ plugins: { entries: { w: { endpoint: 'dns:///engine-window:7401' } } } }").unwrap();
        let w = &c.plugins.entries["w"];
        assert_eq!(w.target(), Ok(Target::Dns { host: "engine-window".into(), port: 7401 }));
        assert!(!w.uses_tls());
        let c = load_str("{ plugins: { entries: { w: { endpoint: 'ipv4:127.0.0.1:2, 127.0.0.1:1,127.0.0.1:2' } } } }")
            .unwrap();
        let two = ["127.0.0.1:1".parse().unwrap(), "127.0.0.1:2".parse().unwrap()];
        assert_eq!(c.plugins.entries["w"].target(), Ok(Target::Static(two.to_vec())));
        let e =
            load_str("{ plugins: { entries: { w: { endpoint: 'http://127.0.0.1:1', timeouts: { asemble: 1 } } } } }")
                .unwrap_err()
                .to_string();
        assert!(e.contains("plugins.entries.w.timeouts") && e.contains("asemble"), "{e}");
        let e = load_str("{ plugins: { entries: { w: { endpoint: 'http://127.0.0.1:1', tls: { ca: 'x' } } } } }")
            .unwrap_err()
            .to_string();
        assert!(e.contains("plugins.entries.w.tls"), "{e}");
        let e =
            load_str("{ models: { provider: 'openai', baseUrl: 'not a url', model: 'm' } }").unwrap_err().to_string();
        assert!(e.contains("models.baseUrl"), "{e}");
    }

    #[test]
    fn the_slot_selects_enabled_allowed_entries_only() {
        let base = "entries: { w: { endpoint: 'http://127.0.0.1:7401' }, off: { endpoint: 'unix:///tmp/x.sock', enabled: false } }";
        let pick = |slot: &str, deny: &str| {
            let c =
                load_str(&format!("{{ plugins: {{ slots: {{ contextEngine: '{slot}' }}, deny: [{deny}], {base} }} }}"))
                    .unwrap();
            c.selected_engine().map(|(id, _)| id.to_owned())
        };
        assert_eq!(pick("w", ""), Some("w".into()));
        assert_eq!(pick("legacy", ""), None);
        assert_eq!(pick("none", ""), None);
        assert_eq!(pick("off", ""), None, "disabled: legacy, silently");
        assert_eq!(pick("w", "'w'"), None, "denied: legacy, silently");
        assert_eq!(pick("gone", ""), None, "a removed entry resets the slot to legacy");
    }

    #[test]
    fn the_documented_examples_load() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/examples");
        // compose.json5 names certificates only the stack has: tests/tls.rs
        // loads it with certificates of its own.
        for name in ["small-window.json5", "openai.json5", "remote-window.json5"] {
            Config::load(Some(&dir.join(name)), |_| None).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
    }

    #[test]
    fn env_overrides_win_and_are_validated() {
        let env = |k: &str| match k {
            "CTXGATE_LISTEN" => Some("127.0.0.1:9999".to_owned()),
            "CTXGATE_CONTEXT_WINDOW" => Some("64000".to_owned()),
            _ => None,
        };
        let c = Config::load(None, env).unwrap();
        assert_eq!(c.listen_addr().unwrap().port(), 9999);
        assert_eq!(c.models.context_window, 64_000);
        let e = Config::load(None, |k| (k == "CTXGATE_CONTEXT_WINDOW").then(|| "lots".to_owned())).unwrap_err();
        assert!(e.to_string().contains("models.contextWindow"));
        let c =
            Config::load(None, |k| (k == "CTXGATE_OTLP_ENDPOINT").then(|| "http://127.0.0.1:4317".to_owned())).unwrap();
        assert_eq!(c.gateway.otlp.unwrap().endpoint, "http://127.0.0.1:4317");
        let e = Config::load(None, |k| (k == "CTXGATE_OTLP_ENDPOINT").then(|| "ftp://x".to_owned())).unwrap_err();
        assert!(e.to_string().contains("gateway.otlp.endpoint"), "{e}");
    }
}
