//! Endpoints: where an engine listens and how a client reaches it.
//! `http://host:port`, a bare `host:port`, or `unix:///path`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint as TonicEndpoint};

use ctxgate_proto::limits::MAX_GRPC_MESSAGE_BYTES;

/// A parsed endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    Tcp(SocketAddr),
    /// A host name and port, resolved when connecting (containers, meshes).
    Host(String, u16),
    Unix(PathBuf),
}

#[derive(Debug, thiserror::Error)]
#[error("invalid endpoint {input:?}: expected http://HOST:PORT, HOST:PORT or unix:///PATH")]
pub struct BadEndpoint {
    pub input: String,
}

impl FromStr for Endpoint {
    type Err = BadEndpoint;

    fn from_str(s: &str) -> Result<Self, BadEndpoint> {
        let bad = || BadEndpoint { input: s.to_owned() };
        if let Some(path) = s.strip_prefix("unix://") {
            if path.is_empty() {
                return Err(bad());
            }
            return Ok(Self::Unix(PathBuf::from(path)));
        }
        let hostport = s.strip_prefix("http://").unwrap_or(s).trim_end_matches('/');
        let hostport = if let Some(rest) = hostport.strip_prefix("localhost:") {
            format!("127.0.0.1:{rest}")
        } else {
            hostport.to_owned()
        };
        if let Ok(addr) = hostport.parse() {
            return Ok(Self::Tcp(addr));
        }
        let (host, port) = hostport.rsplit_once(':').ok_or_else(bad)?;
        let port: u16 = port.parse().map_err(|_| bad())?;
        let valid = !host.is_empty() && host.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.');
        if valid { Ok(Self::Host(host.to_owned(), port)) } else { Err(bad()) }
    }
}

impl Endpoint {
    /// Whether only this machine can reach it: a loopback address or a
    /// unix socket (a host name is not: it may resolve anywhere).
    pub fn is_local(&self) -> bool {
        match self {
            Self::Tcp(addr) => addr.ip().is_loopback(),
            Self::Host(..) => false,
            Self::Unix(_) => true,
        }
    }
}

impl std::fmt::Display for Endpoint {
    /// The form engines print after `listening on`: `HOST:PORT` or `unix:///PATH`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Tcp(addr) => write!(f, "{addr}"),
            Self::Host(host, port) => write!(f, "{host}:{port}"),
            Self::Unix(path) => write!(f, "unix://{}", path.display()),
        }
    }
}

/// A lazily connecting channel to an engine or host endpoint, with the
/// contract's message limit applied by the caller's generated client.
pub fn connect(endpoint: &str) -> Result<Channel, BadEndpoint> {
    let parsed: Endpoint = endpoint.parse()?;
    Ok(channel(&parsed))
}

/// Every channel's settings: connect timeout, no Nagle, keepalive.
fn tuned(e: TonicEndpoint) -> TonicEndpoint {
    e.connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(300))
        .keep_alive_timeout(Duration::from_secs(20))
        .keep_alive_while_idle(false)
}

/// A lazily connecting channel to `endpoint`: connect timeout 5 s, Nagle
/// off, and HTTP/2 keepalive pings no more often than every 5 minutes
/// without ever pinging an idle connection — what gRPC C-core, Java and Go
/// servers accept by default (more often earns a GOAWAY "too_many_pings").
pub fn channel(endpoint: &Endpoint) -> Channel {
    let base = |uri: String| tuned(TonicEndpoint::from_shared(uri).expect("a parsed endpoint is a valid URI"));
    match endpoint {
        Endpoint::Tcp(addr) => base(format!("http://{addr}")).connect_lazy(),
        Endpoint::Host(host, port) => base(format!("http://{host}:{port}")).connect_lazy(),
        Endpoint::Unix(path) => {
            let path = path.clone();
            base("http://[::]:0".to_owned()).connect_with_connector_lazy(tower::service_fn(move |_| {
                let path = path.clone();
                async move { Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(path).await?)) }
            }))
        }
    }
}

/// A TLS channel (rustls) to a TCP `endpoint`, not yet connected; a unix
/// socket takes no TLS.
pub fn tls_channel(
    endpoint: &Endpoint,
    tls: tonic::transport::ClientTlsConfig,
) -> Result<Channel, crate::tls::TlsError> {
    use crate::tls::TlsError::Settings;
    let uri = match endpoint {
        Endpoint::Tcp(addr) => format!("https://{addr}"),
        Endpoint::Host(host, port) => format!("https://{host}:{port}"),
        Endpoint::Unix(_) => return Err(Settings("a unix socket takes no TLS (use a file mode instead)".into())),
    };
    let e = tuned(TonicEndpoint::from_shared(uri).map_err(|e| Settings(e.to_string()))?);
    Ok(e.tls_config(tls).map_err(|e| Settings(e.to_string()))?.connect_lazy())
}

/// The generated engine client over `channel`, with the contract's limits.
pub fn engine_client(channel: Channel) -> ctxgate_proto::pb::context_engine_client::ContextEngineClient<Channel> {
    ctxgate_proto::pb::context_engine_client::ContextEngineClient::new(channel)
        .max_decoding_message_size(MAX_GRPC_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_GRPC_MESSAGE_BYTES)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_form() {
        assert_eq!("http://127.0.0.1:80".parse::<Endpoint>().unwrap(), Endpoint::Tcp("127.0.0.1:80".parse().unwrap()));
        assert_eq!("[::1]:9".parse::<Endpoint>().unwrap().to_string(), "[::1]:9");
        assert_eq!("localhost:7".parse::<Endpoint>().unwrap().to_string(), "127.0.0.1:7");
        assert_eq!("unix:///tmp/e.sock".parse::<Endpoint>().unwrap().to_string(), "unix:///tmp/e.sock");
        assert_eq!(
            "http://engine-window:7401".parse::<Endpoint>().unwrap(),
            Endpoint::Host("engine-window".into(), 7401)
        );
        assert!("ftp://x".parse::<Endpoint>().is_err());
        assert!("http://bad host:1".parse::<Endpoint>().is_err());
        assert!("unix://".parse::<Endpoint>().is_err());
    }
}
