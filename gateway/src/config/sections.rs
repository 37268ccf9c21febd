//! The config's sections other than `plugins`: `gateway` (listeners, TLS,
//! limits, OTLP, auth), `store`, `models` and `agents`.

use std::path::PathBuf;

use serde::Deserialize;

use super::{ConfigError, invalid};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct GatewaySection {
    /// The client API (gRPC: Gateway, Harness, health). Loopback by
    /// default; anywhere else it needs client authentication (`auth.token`
    /// or `tls.clientCa`) or `allowUnauthenticated`.
    pub listen: String,
    /// The Host service engines call back, on a listener of its own so an
    /// engine never reaches the client API. Default: `listen`'s address
    /// (127.0.0.1 when that is all interfaces) on a free port.
    pub host_listen: Option<String>,
    /// Serve a non-loopback client API with no client authentication:
    /// only where something in front (a mesh) authenticates clients.
    pub allow_unauthenticated: bool,
    /// Prometheus `/metrics` over HTTP; empty disables it.
    pub metrics_listen: String,
    pub auth: AuthSection,
    /// Where engines reach the gateway's Host service. Default: the Host
    /// listener's address (127.0.0.1 when it listens on all interfaces).
    /// Set it when engines run in other containers.
    pub host_endpoint: Option<String>,
    pub limits: LimitsSection,
    /// TLS on the client API and the Host listener (there without client
    /// certificates: engines authenticate with their grants).
    pub tls: Option<TlsSection>,
    /// Spans exported over OTLP/gRPC (read at start).
    pub otlp: Option<OtlpSection>,
}

/// `gateway.otlp`: where the gateway sends its spans (each turn, each
/// engine call), continuing the client's `traceparent`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct OtlpSection {
    /// An OTLP/gRPC collector, `http://HOST:PORT` or `https://HOST:PORT`
    /// (usually port 4317).
    pub endpoint: String,
    /// For an https:// collector: the CA (PEM) its certificate must chain
    /// to (default: the public web roots).
    #[serde(default)]
    pub ca: Option<PathBuf>,
    /// The spans' `service.name`.
    #[serde(default = "default_service_name")]
    pub service_name: String,
}

pub(super) fn default_service_name() -> String {
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
    pub fn files(&self) -> ctxgate_runtime::tls::ServerFiles {
        let named = |key: &str, path: &PathBuf| (key.to_owned(), path.clone());
        ctxgate_runtime::tls::ServerFiles {
            cert: named("gateway.tls.cert", &self.cert),
            key: named("gateway.tls.key", &self.key),
            client_ca: self.client_ca.as_ref().map(|p| named("gateway.tls.clientCa", p)),
            client_names: Vec::new(),
        }
    }

    /// The API's TLS, read now: a file that cannot be read, holds no PEM,
    /// or a key that does not match its certificate is a sentence naming
    /// its key. SIGHUP can replace it while the gateway serves.
    pub fn live(&self) -> Result<ctxgate_runtime::tls::LiveServerTls, ConfigError> {
        ctxgate_runtime::tls::LiveServerTls::new(self.files()).map_err(|m| invalid("gateway.tls", m))
    }
}

impl Default for GatewaySection {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:7300".into(),
            host_listen: None,
            allow_unauthenticated: false,
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
    /// A harness stream whose first request (`begin`) does not come within
    /// this long is ended: before `begin` there is no turn and no
    /// admission, so the stream is held on nothing but this clock.
    pub harness_begin_seconds: u64,
    /// Maintenance rewrites applied to one session an hour at most; more
    /// are refused (the transcript unchanged). Each copies the branch
    /// from the first message it replaces.
    pub maintain_rewrites_per_session_per_hour: u32,
    /// Turns (running or waiting for their session) the gateway takes at
    /// once; one more is shed at once with RESOURCE_EXHAUSTED and a retry
    /// pushback, never queued.
    pub max_concurrent_turns: usize,
    /// Turns admitted and not started yet — waiting behind their session's
    /// running turn, or for a work slot (`core::admission`) — at once; one
    /// more is shed at once with RESOURCE_EXHAUSTED and a retry pushback.
    pub max_waiting_turns: usize,
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
    /// What an engine's host callbacks may use.
    pub host_callbacks: HostCallbacks,
    /// What one peer address may hold on each listener.
    pub connections: Connections,
}

/// `gateway.limits.hostCallbacks`: an engine calls back with the grant of
/// one engine call; these bound what that grant can spend. Over a limit:
/// RESOURCE_EXHAUSTED naming it.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct HostCallbacks {
    /// Callbacks of one engine call running at once.
    pub in_flight_per_call: usize,
    /// Callbacks one engine call may make in all.
    pub per_call: u32,
    /// LlmComplete calls one engine call may make.
    pub llm_per_call: u32,
    /// LlmComplete calls one engine (all its sessions) may have running.
    pub llm_concurrent_per_engine: usize,
    /// Model tokens (prompt and output) one engine may spend an hour
    /// through LlmComplete (`model_spend`).
    pub llm_tokens_per_engine_per_hour: u64,
}

impl Default for HostCallbacks {
    fn default() -> Self {
        Self {
            in_flight_per_call: 2,
            per_call: 256,
            llm_per_call: 8,
            llm_concurrent_per_engine: 4,
            // A summary of a 100,000-token history costs about 105,000:
            // about a hundred an hour.
            llm_tokens_per_engine_per_hour: 10_000_000,
        }
    }
}

/// `gateway.limits.connections`: on each listener, per peer (an IPv4
/// address or an IPv6 /64) and over all.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct Connections {
    /// Established connections one peer may hold; more are closed.
    pub open_per_peer: usize,
    /// Established connections over all peers; more are closed. Lowered
    /// at start to what the descriptor limit leaves
    /// (`ctxgate_runtime::accept::Limits::fit`).
    pub open_total: usize,
    /// Connections one peer may have pending (in their TLS handshake or
    /// before their HTTP/2 preface); a new one evicts the oldest.
    pub pending_per_peer: usize,
    /// The same over all peers.
    pub pending_total: usize,
    /// How long a connection may stay pending (and the metrics listener
    /// wait for a request's header).
    pub handshake_timeout_seconds: f64,
    /// A connection this old is asked to go (GOAWAY: clients reconnect;
    /// the calls on it finish first). 0: never.
    pub max_age_seconds: u64,
}

impl Default for Connections {
    fn default() -> Self {
        let d = ctxgate_runtime::accept::Limits::default();
        Self {
            open_per_peer: d.open_per_peer,
            open_total: d.open_total,
            pending_per_peer: d.pending_per_peer,
            pending_total: d.pending_total,
            handshake_timeout_seconds: d.handshake_timeout.as_secs_f64(),
            max_age_seconds: 2 * 3600,
        }
    }
}

impl Connections {
    pub fn limits(&self) -> ctxgate_runtime::accept::Limits {
        ctxgate_runtime::accept::Limits {
            open_per_peer: self.open_per_peer,
            open_total: self.open_total,
            pending_per_peer: self.pending_per_peer,
            pending_total: self.pending_total,
            handshake_timeout: std::time::Duration::from_secs_f64(self.handshake_timeout_seconds),
        }
    }
}

/// `gateway.limits.adaptiveConcurrency`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct AdaptiveConcurrency {
    /// `false`: only `maxConcurrentTurns` bounds turns.
    pub enabled: bool,
    /// The limit never goes below this; a slowdown with no more work than
    /// this is not load (`core::admission`).
    pub min_limit: usize,
    /// How much slower than the baseline a window's p90 gateway latency
    /// may be before the gateway starts limiting (1.1–10).
    pub tolerance: f64,
}

impl Default for AdaptiveConcurrency {
    fn default() -> Self {
        // Tolerance 2, measured with `loadgen overload` (docs/benchmarks-history.md, "Adaptive concurrency"):
        // under 4× overload it kept admitted p99 within 1.1× (legacy) and
        // 1.9× (window engine) of unloaded; 4 let the window engine's reach
        // 4×. 4 keeps more closed-loop throughput (legacy 1058 vs 863
        // turns/s at 64 sessions): a choice for operators who prefer it.
        Self { enabled: true, min_limit: 4, tolerance: 2.0 }
    }
}

impl Default for LimitsSection {
    fn default() -> Self {
        Self {
            queued_turns_per_session: 8,
            harness_idle_seconds: 300,
            harness_begin_seconds: 10,
            maintain_rewrites_per_session_per_hour: 60,
            max_concurrent_turns: 1024,
            max_waiting_turns: 1024,
            max_concurrent_streams_per_connection: 256,
            max_request_bytes: 4 * 1024 * 1024,
            http2_keepalive_seconds: 30,
            http2_keepalive_timeout_seconds: 10,
            tcp_keepalive_seconds: 60,
            adaptive_concurrency: AdaptiveConcurrency::default(),
            host_callbacks: HostCallbacks::default(),
            connections: Connections::default(),
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
    /// A queued commit the engine fails on this many times in a row (it
    /// crashes, answers UNAVAILABLE or UNKNOWN, times out) is held as refused:
    /// it blocks its session only, until `ctxgate outbox retry|drop`,
    /// instead of quarantining the engine at every retry.
    pub hold_commit_after_failures: u32,
    /// Days the audit of dropped commits and forgets (`ctxgate outbox
    /// drops`) is kept.
    pub audit_retention_days: u32,
    /// MiB of estimated heap for the store's cache of visible tails (see
    /// docs/operations.md: sessions whose histories do not fit are read
    /// from the store whole every turn).
    #[serde(rename = "tailCacheMiB")]
    pub tail_cache_mib: u32,
}

/// The visible-tail cache's size when `store.tailCacheMiB` is not set:
/// 64 sessions with a full context window's history (~400 KiB each
/// decoded) fit; many short messages cost more per token
/// (docs/operations.md).
pub const DEFAULT_TAIL_CACHE_MIB: u32 = 32;

impl Default for StoreSection {
    fn default() -> Self {
        Self {
            url: None,
            lease_seconds: 10.0,
            pool_size: 16,
            ca_file: None,
            hold_commit_after_failures: 3,
            audit_retention_days: 90,
            tail_cache_mib: DEFAULT_TAIL_CACHE_MIB,
        }
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

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct AgentDefaults {
    pub compaction: CompactionConfig,
    /// Model calls a managed turn may spend on the engine's tools before it
    /// stops with a clear message (each round: the model calls tools, they
    /// answer, the context is assembled again).
    pub max_tool_rounds: u32,
}

impl Default for AgentDefaults {
    fn default() -> Self {
        Self { compaction: CompactionConfig::default(), max_tool_rounds: 8 }
    }
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
