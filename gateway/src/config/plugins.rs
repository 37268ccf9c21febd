//! `plugins`: the remote engines (`plugins.entries.<id>`: where each runs,
//! its timeouts, limits and TLS) and the slot that selects one.

use std::path::PathBuf;

use ctxgate_runtime::tls;
use serde::Deserialize;

use super::{ConfigError, invalid};

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
    /// What a turn does when this engine cannot serve it (quarantined, or
    /// a call failed): answer through legacy (OpenClaw's default), or fail
    /// with a clear error naming the engine (openclaw#116716).
    pub on_failure: OnFailure,
}

/// `plugins.entries.<id>.onFailure`.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum OnFailure {
    #[default]
    Legacy,
    Fail,
}

/// Where an entry's engine runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// One address, dialled as written.
    One(ctxgate_runtime::Endpoint),
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
    pub fn by_name(&self) -> ctxgate_runtime::Endpoint {
        match self {
            Self::One(e) => e.clone(),
            Self::Static(addrs) => ctxgate_runtime::Endpoint::Tcp(addrs[0]),
            Self::Dns { host, port } => match host.parse::<std::net::IpAddr>() {
                Ok(ip) => ctxgate_runtime::Endpoint::Tcp(std::net::SocketAddr::new(ip, *port)),
                Err(_) => ctxgate_runtime::Endpoint::Host(host.clone(), *port),
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
            on_failure: OnFailure::Legacy,
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
