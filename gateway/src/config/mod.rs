//! Configuration: one JSON5 file whose keys mirror OpenClaw's, then
//! `CTXGATE_*` environment overrides, then validation — all before any port
//! is bound. No file at all is fine: every key has a default.

//!
//! The sections live in [`sections`] (gateway, store, models, agents) and
//! [`plugins`] (the engines and the slot that selects one); this file reads,
//! overrides and validates them.

mod plugins;
mod sections;
#[cfg(test)]
mod tests;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ctxgate_proto::Method;
use serde::Deserialize;

pub use plugins::*;
pub use sections::*;

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

/// The shortest client token accepted (`gateway.auth.token`).
pub const MIN_TOKEN_CHARS: usize = 16;

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

/// The environment variables read as overrides, with the key each replaces.
pub const ENV_OVERRIDES: &[(&str, &str)] = &[
    ("CTXGATE_LISTEN", "gateway.listen"),
    ("CTXGATE_HOST_LISTEN", "gateway.hostListen"),
    ("CTXGATE_HOST_ENDPOINT", "gateway.hostEndpoint"),
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
                "CTXGATE_HOST_LISTEN" => self.gateway.host_listen = Some(v).filter(|v| !v.is_empty()),
                "CTXGATE_HOST_ENDPOINT" => self.gateway.host_endpoint = Some(v).filter(|v| !v.is_empty()),
                "CTXGATE_METRICS_LISTEN" => self.gateway.metrics_listen = v,
                "CTXGATE_AUTH_TOKEN" => self.gateway.auth.token = Some(v),
                "CTXGATE_OTLP_ENDPOINT" => {
                    self.gateway.otlp = Some(v).filter(|v| !v.is_empty()).map(|endpoint| OtlpSection {
                        endpoint,
                        ..self.gateway.otlp.take().unwrap_or_else(|| OtlpSection {
                            endpoint: String::new(),
                            ca: None,
                            service_name: default_service_name(),
                        })
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
        self.check_listeners()?;
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
            // As the driver reads it: `pr%65fer` is `prefer` too.
            let decoded = percent_encoding::percent_decode_str(url).decode_utf8_lossy();
            if decoded.contains("sslmode=prefer") {
                return Err(invalid(
                    "store.url",
                    "sslmode=prefer falls back to plaintext and cannot be verified: use sslmode=require (TLS, \
                     verified against store.caFile or the public roots), or sslmode=disable where the network is trusted",
                ));
            }
        }
        if let Some(tls) = &self.gateway.tls {
            tls.live()?;
        }
        if let Some(o) = &self.gateway.otlp {
            let https = o.endpoint.strip_prefix("https://");
            let ok = matches!(
                https.unwrap_or(&o.endpoint).parse::<ctxgate_runtime::Endpoint>(),
                Ok(ctxgate_runtime::Endpoint::Tcp(_) | ctxgate_runtime::Endpoint::Host(..))
            );
            if !ok {
                return Err(invalid(
                    "gateway.otlp.endpoint",
                    format!("{:?}: expected http://HOST:PORT or https://HOST:PORT", o.endpoint),
                ));
            }
            if o.ca.is_some() && https.is_none() {
                return Err(invalid("gateway.otlp.ca", "is for an https:// endpoint"));
            }
            if o.service_name.trim().is_empty() {
                return Err(invalid("gateway.otlp.serviceName", "must not be empty"));
            }
        }
        let lease = self.store.lease_seconds;
        if !(lease.is_finite() && (1.0..=3600.0).contains(&lease)) {
            return Err(invalid("store.leaseSeconds", format!("{lease} is outside 1–3600")));
        }
        let days = self.store.audit_retention_days;
        if !(1..=36_500).contains(&days) {
            return Err(invalid("store.auditRetentionDays", format!("{days} is outside 1–36500")));
        }
        let tails = self.store.tail_cache_mib;
        if !(1..=65_536).contains(&tails) {
            return Err(invalid("store.tailCacheMiB", format!("{tails} is outside 1–65536")));
        }
        let hold = self.store.hold_commit_after_failures;
        if !(1..=100).contains(&hold) {
            return Err(invalid("store.holdCommitAfterFailures", format!("{hold} is outside 1–100")));
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
            && e.strip_prefix("https://").unwrap_or(e).parse::<ctxgate_runtime::Endpoint>().is_err()
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
        if l.harness_begin_seconds == 0 {
            return Err(invalid("gateway.limits.harnessBeginSeconds", "must be positive"));
        }
        if l.maintain_rewrites_per_session_per_hour > 100_000 {
            return Err(invalid("gateway.limits.maintainRewritesPerSessionPerHour", "is over 100000"));
        }
        if l.max_concurrent_turns == 0 || l.max_concurrent_turns > 1_000_000 {
            return Err(invalid("gateway.limits.maxConcurrentTurns", "must be between 1 and 1000000"));
        }
        if l.max_waiting_turns == 0 || l.max_waiting_turns > 1_000_000 {
            return Err(invalid("gateway.limits.maxWaitingTurns", "must be between 1 and 1000000"));
        }
        let a = &l.adaptive_concurrency;
        if a.min_limit == 0 {
            return Err(invalid("gateway.limits.adaptiveConcurrency.minLimit", "must be positive"));
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
        let h = &l.host_callbacks;
        for (key, ok) in [
            ("inFlightPerCall", (1..=64).contains(&h.in_flight_per_call)),
            ("perCall", (1..=100_000).contains(&h.per_call)),
            ("llmPerCall", (1..=1_000).contains(&h.llm_per_call)),
            ("llmConcurrentPerEngine", (1..=10_000).contains(&h.llm_concurrent_per_engine)),
            ("llmTokensPerEnginePerHour", (1_000..=1_000_000_000_000).contains(&h.llm_tokens_per_engine_per_hour)),
        ] {
            if !ok {
                return Err(invalid(
                    &format!("gateway.limits.hostCallbacks.{key}"),
                    "is out of range (see docs/operations.md)",
                ));
            }
        }
        let c = &l.connections;
        for (key, v) in [
            ("openPerPeer", c.open_per_peer),
            ("openTotal", c.open_total),
            ("pendingPerPeer", c.pending_per_peer),
            ("pendingTotal", c.pending_total),
        ] {
            if !(1..=1_000_000).contains(&v) {
                return Err(invalid(&format!("gateway.limits.connections.{key}"), "must be between 1 and 1000000"));
            }
        }
        if !(c.handshake_timeout_seconds.is_finite() && (0.1..=120.0).contains(&c.handshake_timeout_seconds)) {
            return Err(invalid("gateway.limits.connections.handshakeTimeoutSeconds", "must be between 0.1 and 120"));
        }
        if c.max_age_seconds > 0 && c.max_age_seconds < 10 {
            return Err(invalid("gateway.limits.connections.maxAgeSeconds", "must be 0 (no limit) or at least 10"));
        }
        if let Some(t) = &self.gateway.auth.token {
            if t.trim().is_empty() {
                return Err(invalid("gateway.auth.token", "is blank; remove it to disable auth"));
            }
            // A short token is guessed, not authenticated: every call may try one.
            if t.chars().count() < MIN_TOKEN_CHARS {
                return Err(invalid(
                    "gateway.auth.token",
                    format!(
                        "is {} characters; a token needs at least {MIN_TOKEN_CHARS} (e.g. `openssl rand -hex 24`)",
                        t.chars().count()
                    ),
                ));
            }
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
        if !(1..=64).contains(&self.agents.defaults.max_tool_rounds) {
            return Err(invalid("agents.defaults.maxToolRounds", "must be between 1 and 64"));
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
                if matches!(target, Target::One(ctxgate_runtime::Endpoint::Unix(_))) {
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

    /// The listen addresses parse, and a client API other hosts can reach
    /// authenticates its clients (or says, with `allowUnauthenticated`,
    /// that something in front does).
    fn check_listeners(&self) -> Result<(), ConfigError> {
        let listen = self.listen_addr()?;
        let host = self.host_listen_addr()?;
        if host.port() != 0 && host == listen {
            return Err(invalid(
                "gateway.hostListen",
                "must differ from gateway.listen: engines get a listener of their own",
            ));
        }
        let authenticated =
            self.gateway.auth.token.is_some() || self.gateway.tls.as_ref().is_some_and(|t| t.client_ca.is_some());
        if !listen.ip().is_loopback() && !authenticated && !self.gateway.allow_unauthenticated {
            return Err(invalid(
                "gateway.listen",
                format!(
                    "{listen} is reachable from other hosts and no client is authenticated: set gateway.auth.token \
                     (CTXGATE_AUTH_TOKEN) or gateway.tls.clientCa, or gateway.allowUnauthenticated: true where a mesh \
                     authenticates clients in front of the gateway"
                ),
            ));
        }
        Ok(())
    }

    pub fn listen_addr(&self) -> Result<SocketAddr, ConfigError> {
        self.gateway
            .listen
            .parse()
            .map_err(|_| invalid("gateway.listen", format!("{:?} is not HOST:PORT", self.gateway.listen)))
    }

    /// `gateway.metricsListen`: off when empty; a port alone (`9464` or
    /// `:9464`) is on loopback — metrics name engines and load, for the
    /// operator's scraper, not for whoever reaches the gateway's host.
    pub fn metrics_addr(&self) -> Result<Option<SocketAddr>, ConfigError> {
        let listen = self.gateway.metrics_listen.as_str();
        if listen.is_empty() {
            return Ok(None);
        }
        let port = listen.strip_prefix(':').unwrap_or(listen).parse::<u16>().ok();
        let addr = port.map(|p| SocketAddr::from((std::net::Ipv4Addr::LOCALHOST, p))).or_else(|| listen.parse().ok());
        addr.map(Some).ok_or_else(|| invalid("gateway.metricsListen", format!("{listen:?} is not HOST:PORT or PORT")))
    }

    /// The Host listener's address: `gateway.hostListen`, or the client
    /// API's address (loopback for all interfaces) on a free port.
    pub fn host_listen_addr(&self) -> Result<SocketAddr, ConfigError> {
        match &self.gateway.host_listen {
            Some(a) => a.parse().map_err(|_| invalid("gateway.hostListen", format!("{a:?} is not HOST:PORT"))),
            None => {
                let ip = loopback_if_unspecified(self.listen_addr()?.ip());
                Ok(SocketAddr::new(ip, 0))
            }
        }
    }

    /// Where engines reach the Host service, given the Host listener's
    /// bound address.
    pub fn host_endpoint(&self, bound: SocketAddr) -> String {
        if let Some(e) = &self.gateway.host_endpoint {
            return e.clone();
        }
        let ip = loopback_if_unspecified(bound.ip());
        // The Host listener serves the API's certificate.
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

/// 127.0.0.1 (or ::1) for an all-interfaces address: the one address of
/// this host every local process reaches.
fn loopback_if_unspecified(ip: std::net::IpAddr) -> std::net::IpAddr {
    match ip {
        std::net::IpAddr::V4(a) if a.is_unspecified() => std::net::Ipv4Addr::LOCALHOST.into(),
        std::net::IpAddr::V6(a) if a.is_unspecified() => std::net::Ipv6Addr::LOCALHOST.into(),
        other => other,
    }
}
