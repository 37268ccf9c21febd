//! The engine's side of the `Host` service: callbacks into the gateway,
//! authorised by the grant that came with the current call.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio_stream::StreamExt;
use tonic::transport::Channel;

use crate::limits::MAX_GRPC_MESSAGE_BYTES;
use crate::pb::{self, host_client::HostClient as RawHostClient};
use crate::{CallContext, EngineError};
use ctxgate_runtime::endpoint::{Endpoint, channel};

/// Host operations a grant can allow.
pub const READ_TRANSCRIPT: &str = "read_transcript";
pub const LLM_COMPLETE: &str = "llm_complete";

/// Calls the gateway back during one engine call. Built by the server from
/// the request's `HostAccess`; every request carries the grant token and is
/// bounded by the engine call's own deadline.
#[derive(Clone, Debug)]
pub struct HostClient {
    client: RawHostClient<Channel>,
    grant: pb::Grant,
}

impl HostClient {
    /// Whether the grant allows `operation` and has not expired.
    pub fn allows(&self, operation: &str) -> bool {
        let now_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64);
        self.grant.operations.iter().any(|o| o == operation)
            && (self.grant.expires_at_unix_ms == 0 || self.grant.expires_at_unix_ms > now_ms)
    }

    /// The session the grant is scoped to.
    pub fn session_id(&self) -> &str {
        &self.grant.session_id
    }

    /// The whole transcript of the grant's session (or only its visible
    /// history), collected page by page. What a host sends is capped
    /// ([`MAX_READ_ENTRIES`], [`MAX_READ_BYTES`]): past either the call
    /// fails RESOURCE_EXHAUSTED rather than grow without bound, whatever the
    /// peer at the host endpoint streams. Bounded by the call's deadline,
    /// or [`DEFAULT_HOST_TIMEOUT`] when it has none.
    pub async fn read_transcript(
        &self,
        ctx: &CallContext,
        visible_only: bool,
    ) -> Result<Vec<pb::TranscriptEntry>, EngineError> {
        let mut read = Read::default();
        let mut cursor = String::new();
        loop {
            let before = read.entries.len();
            let next = self.read_page(ctx, visible_only, &cursor, 0, &mut read).await?;
            match next {
                // A page that brought nothing, or the cursor it was given,
                // would be read again for ever.
                Some(c) if !c.is_empty() && (read.entries.len() == before || c == cursor) => {
                    return Err(EngineError::Host {
                        operation: "ReadTranscript",
                        status: tonic::Status::unavailable(
                            "the host sent a page with no new entries and a cursor to more; stopped rather than read the same page again",
                        ),
                    });
                }
                Some(c) if !c.is_empty() => cursor = c,
                _ => return Ok(read.entries),
            }
        }
    }

    /// One page (at most `limit` entries; 0: as many as the host sends at
    /// once) after `cursor` (blank: from the start), and the cursor of the
    /// next page (blank: nothing follows). Capped as [`Self::read_transcript`].
    pub async fn read_transcript_page(
        &self,
        ctx: &CallContext,
        visible_only: bool,
        cursor: &str,
        limit: u32,
    ) -> Result<(Vec<pb::TranscriptEntry>, String), EngineError> {
        let mut read = Read::default();
        let next = self.read_page(ctx, visible_only, cursor, limit, &mut read).await?;
        Ok((read.entries, next.unwrap_or_default()))
    }

    /// Reads one ReadTranscript stream into `read`; the last chunk's cursor.
    async fn read_page(
        &self,
        ctx: &CallContext,
        visible_only: bool,
        cursor: &str,
        limit: u32,
        read: &mut Read,
    ) -> Result<Option<String>, EngineError> {
        const OP: &str = "ReadTranscript";
        if !self.allows(READ_TRANSCRIPT) {
            return Err(EngineError::NotGranted(READ_TRANSCRIPT));
        }
        let req = pb::ReadTranscriptRequest {
            grant: self.grant.token.clone(),
            session_id: self.grant.session_id.clone(),
            cursor: cursor.to_owned(),
            visible_only,
            limit,
        };
        let host_err = |status| host_error(ctx, OP, status);
        let within = ctx.remaining().unwrap_or(DEFAULT_HOST_TIMEOUT);
        let stream = async {
            let mut stream =
                self.client.clone().read_transcript(bounded(ctx, req)).await.map_err(host_err)?.into_inner();
            let mut last = None;
            while let Some(chunk) = stream.next().await {
                ctx.check()?;
                let chunk = chunk.map_err(host_err)?;
                read.take(chunk.entries)?;
                last = Some(chunk.next_cursor);
            }
            Ok(last)
        };
        tokio::time::timeout(within, stream).await.map_err(|_| EngineError::DeadlineExceeded)?
    }

    /// One completion from the host's model.
    pub async fn llm_complete(
        &self,
        ctx: &CallContext,
        mut req: pb::LlmCompleteRequest,
    ) -> Result<pb::LlmCompleteResult, EngineError> {
        if !self.allows(LLM_COMPLETE) {
            return Err(EngineError::NotGranted(LLM_COMPLETE));
        }
        req.grant = self.grant.token.clone();
        let mut client = self.client.clone();
        let call = client.llm_complete(bounded(ctx, req));
        // Dropping the call on cancellation resets the stream: the host sees it.
        tokio::select! {
            r = call => r.map(tonic::Response::into_inner).map_err(|status| host_error(ctx, "LlmComplete", status)),
            _ = ctx.cancellation().cancelled() => Err(EngineError::Cancelled),
        }
    }
}

/// A callback that failed because the engine call's own deadline passed is
/// that deadline, not a host fault: the engine must not go on as if the
/// host had merely refused.
fn host_error(ctx: &CallContext, operation: &'static str, status: tonic::Status) -> EngineError {
    if ctx.remaining().is_some_and(|left| left.is_zero()) {
        EngineError::DeadlineExceeded
    } else if status.code() == tonic::Code::Unimplemented {
        // The host does not offer it (e.g. no model for summaries): the
        // engine does the work itself.
        EngineError::HostUnimplemented(operation)
    } else {
        EngineError::Host { operation, status }
    }
}

/// Entries one `read_transcript` takes from a host at most.
pub const MAX_READ_ENTRIES: usize = 20_000;
/// Encoded bytes one `read_transcript` takes from a host at most.
pub const MAX_READ_BYTES: usize = 16 * 1024 * 1024;
/// How long a host callback may take when the engine call has no deadline.
pub const DEFAULT_HOST_TIMEOUT: Duration = Duration::from_secs(60);

/// What a read took so far, against the caps.
#[derive(Default)]
struct Read {
    entries: Vec<pb::TranscriptEntry>,
    bytes: usize,
}

impl Read {
    fn take(&mut self, entries: Vec<pb::TranscriptEntry>) -> Result<(), EngineError> {
        use prost::Message as _;
        self.bytes = entries.iter().fold(self.bytes, |n, e| n.saturating_add(e.encoded_len()));
        if self.entries.len().saturating_add(entries.len()) > MAX_READ_ENTRIES {
            return Err(EngineError::OverLimit(format!(
                "ReadTranscript: the host sent more than {MAX_READ_ENTRIES} entries; read it in pages"
            )));
        }
        if self.bytes > MAX_READ_BYTES {
            return Err(EngineError::OverLimit(format!(
                "ReadTranscript: the host sent more than {MAX_READ_BYTES} bytes; read it in pages"
            )));
        }
        self.entries.extend(entries);
        Ok(())
    }
}

fn bounded<T>(ctx: &CallContext, msg: T) -> tonic::Request<T> {
    let mut req = tonic::Request::new(msg);
    req.set_timeout(ctx.remaining().unwrap_or(DEFAULT_HOST_TIMEOUT));
    // The callback continues the call's trace, under this method's span.
    if let Some(t) = ctx.span()
        && let Ok(v) = t.to_string().parse()
    {
        req.metadata_mut().insert(ctxgate_proto::trace::HEADER, v);
    }
    req
}

/// Which host endpoints an engine calls back. A request names its host
/// endpoint, and whoever reaches the engine's port can send a request: an
/// engine that dialled whatever it was told could be made to connect
/// anywhere and hand over the grant. So an endpoint is called only when it
/// is on the allow-list (`--host-allow`) or, with no list, when it is the
/// address of the peer that made the call (a name is resolved first); a
/// caller on a unix socket is a local process, so loopback endpoints are
/// its. A unix socket named by a request is never dialled unless listed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostPolicy {
    allow: Vec<HostEndpoint>,
}

/// A host endpoint as requests and `--host-allow` name it: `http://`,
/// `https://` (TLS) or bare `HOST:PORT`, or `unix:///PATH`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostEndpoint {
    pub https: bool,
    pub endpoint: Endpoint,
    /// The host as written (the TLS server name: `localhost` stays a name).
    pub host: String,
}

impl std::str::FromStr for HostEndpoint {
    type Err = ctxgate_runtime::endpoint::BadEndpoint;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (https, rest) = match s.strip_prefix("https://") {
            Some(rest) => (true, rest),
            None => (false, s),
        };
        let endpoint: Endpoint = rest.parse()?;
        let bare = rest.strip_prefix("http://").unwrap_or(rest).trim_end_matches('/');
        let host = bare.rsplit_once(':').map_or(bare, |(h, _)| h).trim_matches(['[', ']']).to_owned();
        Ok(Self { https, endpoint, host })
    }
}

impl std::fmt::Display for HostEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (&self.endpoint, self.https) {
            (Endpoint::Unix(_), _) | (_, false) => write!(f, "{}", self.endpoint),
            (e, true) => write!(f, "https://{e}"),
        }
    }
}

/// A host endpoint the policy allows: where to dial (an address that was
/// checked, never a name resolved again later), and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checked {
    pub dial: Endpoint,
    pub https: bool,
    /// The name the gateway's certificate must carry, with TLS.
    pub server_name: String,
}

impl Checked {
    fn key(&self) -> String {
        format!("{}|{}|{}", self.https, self.dial, self.server_name)
    }
}

/// Why a host endpoint was not called.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("host endpoint {0} is not on this engine's --host-allow list")]
    NotListed(String),
    #[error(
        "host endpoint {endpoint} is not the calling peer ({peer}); start the engine with --host-allow {endpoint} to trust it"
    )]
    NotThePeer { endpoint: String, peer: String },
    #[error("host endpoint {0} is a unix socket named by a request; only --host-allow can name one")]
    UnixSocket(String),
    #[error("host endpoint {0} is not a valid endpoint")]
    Invalid(String),
}

/// Where the call came from: an IP address, or a local process on a unix
/// socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peer {
    Ip(std::net::IpAddr),
    Local,
}

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Ip(ip) => write!(f, "{ip}"),
            Self::Local => f.write_str("a local process on a unix socket"),
        }
    }
}

/// The same address however it is written (`::ffff:127.0.0.1` is 127.0.0.1).
fn canonical(ip: std::net::IpAddr) -> std::net::IpAddr {
    match ip {
        std::net::IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, std::net::IpAddr::V4),
        v4 => v4,
    }
}

impl HostPolicy {
    /// Only these endpoints (scheme included); none: the calling peer's
    /// address.
    pub fn allow(allow: Vec<HostEndpoint>) -> Self {
        Self { allow }
    }

    /// Whether `endpoint` may be called for a call from `peer`, and where to
    /// dial it. A name is resolved once, here, bounded by `within`, and the
    /// address that matched is what gets dialled: a name that resolves to
    /// the peer and to somewhere else, or that changes after the check,
    /// cannot steer the engine elsewhere.
    pub async fn check(&self, endpoint: &str, peer: Peer, within: Duration) -> Result<Checked, Refused> {
        // A request's endpoint is logged with every refusal: never a
        // megabyte of it, never a forged log line.
        if endpoint.len() > MAX_ENDPOINT_BYTES || endpoint.chars().any(char::is_control) {
            return Err(Refused::Invalid(format!("({} bytes, or control characters)", endpoint.len())));
        }
        let h: HostEndpoint = endpoint.parse().map_err(|_| Refused::Invalid(endpoint.into()))?;
        let checked = |dial: Endpoint| Checked { dial, https: h.https, server_name: h.host.clone() };
        if !self.allow.is_empty() {
            if !self.allow.iter().any(|a| a.https == h.https && a.endpoint == h.endpoint) {
                return Err(Refused::NotListed(endpoint.into()));
            }
            // Listed by the operator: dialled as written.
            return Ok(checked(h.endpoint.clone()));
        }
        let candidates: Vec<SocketAddr> = match &h.endpoint {
            Endpoint::Unix(_) => return Err(Refused::UnixSocket(endpoint.into())),
            Endpoint::Tcp(addr) => vec![*addr],
            Endpoint::Host(name, port) => {
                let lookup = tokio::net::lookup_host((name.as_str(), *port));
                match tokio::time::timeout(within.min(Duration::from_secs(2)), lookup).await {
                    Ok(Ok(addrs)) => addrs.collect(),
                    _ => Vec::new(),
                }
            }
        };
        let matched = candidates.into_iter().find(|a| match peer {
            Peer::Ip(p) => canonical(a.ip()) == canonical(p),
            Peer::Local => a.ip().is_loopback(),
        });
        match matched {
            Some(addr) => Ok(checked(Endpoint::Tcp(addr))),
            None => Err(Refused::NotThePeer { endpoint: endpoint.into(), peer: peer.to_string() }),
        }
    }
}

/// The longest host endpoint a request may name.
const MAX_ENDPOINT_BYTES: usize = 1024;

/// Host endpoints remembered at most (channels to the hosts this engine
/// serves; more means something sends many: start over).
const MAX_HOST_CHANNELS: usize = 64;

/// Channels to host endpoints, shared by all calls of one server so each
/// call does not open a new connection; only endpoints the policy allows.
#[derive(Default, Debug)]
pub(crate) struct HostChannels {
    policy: HostPolicy,
    /// For `https://` host endpoints: what to trust and present.
    tls: Option<tonic::transport::ClientTlsConfig>,
    channels: Mutex<HashMap<String, Channel>>,
}

impl HostChannels {
    pub(crate) fn new(policy: HostPolicy, tls: Option<tonic::transport::ClientTlsConfig>) -> Self {
        Self { policy, tls, channels: Mutex::default() }
    }

    fn open(&self, c: &Checked) -> Result<Channel, ctxgate_runtime::tls::TlsError> {
        if !c.https {
            return Ok(channel(&c.dial));
        }
        let tls = self.tls.clone().unwrap_or_else(|| tonic::transport::ClientTlsConfig::new().with_webpki_roots());
        // Dialled by address, verified by the name the endpoint was written with.
        ctxgate_runtime::endpoint::tls_channel(&c.dial, tls.domain_name(c.server_name.clone()))
    }

    /// A client for `access` from `peer`, or `None` when the call carries no
    /// usable grant or names a host endpoint the policy refuses (logged:
    /// the engine then works without host callbacks). `within`: the call's
    /// time left, which bounds a name lookup.
    pub(crate) async fn client(
        self: &Arc<Self>,
        access: Option<&pb::HostAccess>,
        peer: Peer,
        within: Duration,
    ) -> Option<HostClient> {
        let access = access?;
        let grant = access.grant.clone().filter(|g| !g.token.is_empty())?;
        let checked = match self.policy.check(&access.endpoint, peer, within).await {
            Ok(c) => c,
            Err(refused) => {
                tracing::warn!(%refused, "host callbacks refused for this call");
                return None;
            }
        };
        let key = checked.key();
        let channel = {
            let mut map = self.channels.lock().unwrap_or_else(|e| e.into_inner());
            if map.len() >= MAX_HOST_CHANNELS && !map.contains_key(&key) {
                map.clear();
            }
            match map.get(&key) {
                Some(c) => c.clone(),
                None => match self.open(&checked) {
                    Ok(c) => map.entry(key).or_insert(c).clone(),
                    Err(e) => {
                        tracing::warn!(endpoint = access.endpoint, error = %e, "host callbacks refused for this call");
                        return None;
                    }
                },
            }
        };
        let client = RawHostClient::new(channel)
            .max_decoding_message_size(MAX_GRPC_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_GRPC_MESSAGE_BYTES);
        Some(HostClient { client, grant })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_name_is_dialled_at_the_address_that_matched_and_verified_by_its_name() {
        let p = HostPolicy::default();
        // `localhost` resolves (here) to the loopback: dialled by address, TLS name kept.
        let c = p.check_now("https://localhost:7300", ip("127.0.0.1")).await.unwrap();
        assert_eq!(c.dial, Endpoint::Tcp("127.0.0.1:7300".parse().unwrap()));
        assert_eq!((c.https, c.server_name.as_str()), (true, "localhost"));
        let c = p.check_now("http://127.0.0.1:7300", ip("127.0.0.1")).await.unwrap();
        assert_eq!((c.https, c.server_name.as_str()), (false, "127.0.0.1"));
    }

    fn ip(s: &str) -> Peer {
        Peer::Ip(s.parse().unwrap())
    }

    impl HostPolicy {
        async fn check_now(&self, endpoint: &str, peer: Peer) -> Result<Checked, Refused> {
            self.check(endpoint, peer, Duration::from_secs(2)).await
        }
    }

    #[tokio::test]
    async fn by_default_only_the_calling_peer_is_called_back() {
        let p = HostPolicy::default();
        assert!(p.check_now("127.0.0.1:7300", ip("127.0.0.1")).await.is_ok());
        assert!(p.check_now("http://127.0.0.1:7300", ip("127.0.0.1")).await.is_ok());
        assert!(p.check_now("localhost:7300", ip("127.0.0.1")).await.is_ok());
        assert!(p.check_now("127.0.0.1:7300", ip("::ffff:127.0.0.1")).await.is_ok(), "the same address, v4-mapped");
        assert!(matches!(p.check_now("10.1.2.3:7300", ip("127.0.0.1")).await, Err(Refused::NotThePeer { .. })));
        assert!(matches!(p.check_now("127.0.0.2:7300", ip("127.0.0.1")).await, Err(Refused::NotThePeer { .. })));
        assert!(matches!(p.check_now("unix:///run/gw.sock", Peer::Local).await, Err(Refused::UnixSocket(_))));
        assert!(matches!(p.check_now("name.invalid:7300", ip("127.0.0.1")).await, Err(Refused::NotThePeer { .. })));
        assert!(matches!(p.check_now("not an endpoint", ip("127.0.0.1")).await, Err(Refused::Invalid(_))));
        let huge = format!("http://127.0.0.1:7300/{}", "x".repeat(16 << 20));
        let refused = p.check_now(&huge, ip("127.0.0.1")).await.unwrap_err();
        assert!(refused.to_string().len() < 200, "a 16 MiB endpoint is not echoed");
        let forged = p.check_now("127.0.0.1:7300\nERROR forged", ip("127.0.0.1")).await.unwrap_err();
        assert!(!forged.to_string().contains('\n'), "{forged}");
        // A caller on the unix socket is local: loopback is its.
        assert!(p.check_now("127.0.0.1:7300", Peer::Local).await.is_ok());
        assert!(p.check_now("10.1.2.3:7300", Peer::Local).await.is_err());
    }

    #[tokio::test]
    async fn an_allow_list_is_all_that_is_called_back() {
        let p = HostPolicy::allow(vec![
            "10.0.0.5:7300".parse().unwrap(),
            "unix:///run/gw.sock".parse().unwrap(),
            "https://gateway:7300".parse().unwrap(),
        ]);
        assert!(p.check_now("http://10.0.0.5:7300", ip("192.168.1.1")).await.is_ok());
        assert!(p.check_now("https://gateway:7300", ip("192.168.1.1")).await.is_ok());
        assert!(p.check_now("gateway:7300", ip("192.168.1.1")).await.is_err(), "the scheme is part of what is listed");
        assert!(p.check_now("https://10.0.0.5:7300", ip("192.168.1.1")).await.is_err());
        assert!(p.check_now("unix:///run/gw.sock", Peer::Local).await.is_ok());
        let e = p.check_now("127.0.0.1:7300", ip("127.0.0.1")).await.unwrap_err();
        assert_eq!(e, Refused::NotListed("127.0.0.1:7300".into()), "the peer is not trusted by itself then");
        assert!(e.to_string().contains("--host-allow"), "{e}");
    }

    /// A peer at the host endpoint: one that streams transcript chunks for
    /// ever, or one that pages as the gateway does (2,500 entries, 1,000 a
    /// call).
    #[derive(Clone, Copy)]
    enum FakeHost {
        Endless,
        Paged,
    }

    #[tonic::async_trait]
    impl pb::host_server::Host for FakeHost {
        type ReadTranscriptStream =
            std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::TranscriptChunk, tonic::Status>> + Send>>;

        async fn read_transcript(
            &self,
            req: tonic::Request<pb::ReadTranscriptRequest>,
        ) -> Result<tonic::Response<Self::ReadTranscriptStream>, tonic::Status> {
            let entry = |id: String| pb::TranscriptEntry { id, ..Default::default() };
            match self {
                Self::Endless => {
                    let chunk =
                        pb::TranscriptChunk { entries: vec![entry("x".repeat(200)); 128], next_cursor: "more".into() };
                    Ok(tonic::Response::new(Box::pin(tokio_stream::iter(std::iter::repeat(chunk).map(Ok)))))
                }
                Self::Paged => {
                    let r = req.into_inner();
                    let start = if r.cursor.is_empty() { 0 } else { r.cursor[1..].parse::<usize>().unwrap() + 1 };
                    let end = (start + 1_000).min(2_500);
                    let entries = (start..end).map(|i| entry(format!("e{i}"))).collect();
                    let next_cursor = if end < 2_500 { format!("e{}", end - 1) } else { String::new() };
                    let chunk = pb::TranscriptChunk { entries, next_cursor };
                    Ok(tonic::Response::new(Box::pin(tokio_stream::iter([Ok(chunk)]))))
                }
            }
        }

        async fn llm_complete(
            &self,
            _: tonic::Request<pb::LlmCompleteRequest>,
        ) -> Result<tonic::Response<pb::LlmCompleteResult>, tonic::Status> {
            Err(tonic::Status::unimplemented("no model"))
        }
    }

    /// A client with a read grant for `host`, served on loopback.
    async fn client_of(host: FakeHost) -> HostClient {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(
            ctxgate_runtime::server()
                .add_service(pb::host_server::HostServer::new(host))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        let grant = pb::Grant {
            token: "t".into(),
            session_id: "s".into(),
            operations: vec![READ_TRANSCRIPT.into()],
            expires_at_unix_ms: 0,
        };
        HostClient { client: RawHostClient::new(channel(&Endpoint::Tcp(addr))), grant }
    }

    #[tokio::test]
    async fn a_host_that_streams_for_ever_is_cut_off_at_the_read_caps() {
        let client = client_of(FakeHost::Endless).await;
        let ctx = CallContext::detached();
        let started = std::time::Instant::now();
        let err = client.read_transcript(&ctx, false).await.unwrap_err();
        assert!(matches!(&err, EngineError::OverLimit(m) if m.contains("20000 entries")), "{err:?}");
        assert_eq!(tonic::Status::from(err).code(), tonic::Code::ResourceExhausted);
        assert!(started.elapsed() < Duration::from_secs(30), "cut off at the cap, not at a timeout");
        // A page is capped the same way: one stream that never ends.
        let err = client.read_transcript_page(&ctx, false, "", 10).await.unwrap_err();
        assert!(matches!(err, EngineError::OverLimit(_)), "{err:?}");
    }

    #[tokio::test]
    async fn a_read_follows_the_hosts_pages_to_the_end_in_order() {
        let client = client_of(FakeHost::Paged).await;
        let ctx = CallContext::detached();
        let all = client.read_transcript(&ctx, false).await.unwrap();
        let ids: Vec<String> = all.iter().map(|e| e.id.clone()).collect();
        assert_eq!(ids, (0..2_500).map(|i| format!("e{i}")).collect::<Vec<_>>());
        let (page, next) = client.read_transcript_page(&ctx, false, "e999", 0).await.unwrap();
        assert_eq!((page.len(), next.as_str()), (1_000, "e1999"));
    }
}
