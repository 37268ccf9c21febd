//! `ctxgate-runtime`: what the gateway and the Rust engine SDK share at run
//! time, apart from the SDK an engine author uses: endpoints and the
//! channels to them ([`endpoint`]), TLS read from PEM files and replaced on
//! reload ([`tls`]), the accept loop that bounds what a peer's connections
//! cost ([`accept`]) and the descriptor limit they count against
//! ([`descriptors`]), OTLP span export ([`otlp`]) and, with the `sqlite`
//! feature, the group-commit SQLite worker ([`sqlite`]).

pub mod accept;
pub mod descriptors;
pub mod endpoint;
pub mod otlp;
#[cfg(feature = "sqlite")]
pub mod sqlite;
pub mod tls;

pub use endpoint::{Endpoint, channel, connect, engine_client, tls_channel};

/// Streams a connection may make a server reset for its own errors before
/// the connection is closed (GOAWAY, ENHANCE_YOUR_CALM): h2's default.
pub const MAX_LOCAL_ERROR_RESETS: usize = 1024;

/// A gRPC server as every ctxgate listener starts: tonic passes no
/// local-error-reset cap to h2 unless told, which turns its protection
/// off, so a client that makes the server reset stream after stream
/// (MadeYouReset) would cost it work for ever.
pub fn server() -> tonic::transport::Server {
    tonic::transport::Server::builder().http2_max_local_error_reset_streams(Some(MAX_LOCAL_ERROR_RESETS))
}

/// Aborts a spawned task when dropped: work that must not outlive the
/// call, stream or server it belongs to.
pub struct AbortOnDrop(pub tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
