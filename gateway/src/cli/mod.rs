//! The `ctxgate` command line: `serve`, and the client commands that talk
//! to a running gateway (`chat`, `compact`, `sessions`, `status`).
//!
//! One file per command (`serve`, `chat`, `compact`, `sessions`, `status`,
//! `health`, `engines`, `outbox`, `doctor`); this one holds the clap
//! definitions, [`Command::run`], and the client plumbing every client
//! command shares: [`Conn`], the bearer interceptor, `connect`/`channel`,
//! and the one wording of connection and TLS failures ([`ConnectError`],
//! `explain`, `tls_hint`); [`CliError`] is what any command fails with.
//! `render` has the engine and outbox renderings `status` shares.

use std::error::Error as _;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use ctxgate_proto::gateway::{self as api, gateway_client::GatewayClient};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::{Code, Request, Status};

use self::doctor::DoctorError;
use crate::api::server::ServeError;
use crate::config::ConfigError;

pub mod chat;
pub mod compact;
pub mod doctor;
pub mod engines;
pub mod health;
pub mod outbox;
mod render;
pub mod serve;
pub mod sessions;
pub mod status;

pub use engines::EnginesCommand;
pub use outbox::OutboxCommand;
pub use sessions::SessionsCommand;

#[derive(Parser, Debug)]
#[command(name = "ctxgate", version, about = "A gateway that hosts context engines for AI agents")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run the gateway (works with no config file: state in ./ctxgate-state).
    Serve {
        /// A JSON5 config file.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Overrides gateway.listen.
        #[arg(long)]
        listen: Option<String>,
        /// Overrides stateDir.
        #[arg(long)]
        state_dir: Option<PathBuf>,
    },
    /// Talk to an agent: interactive, or one message with -m.
    Chat {
        #[command(flatten)]
        conn: Conn,
        #[command(flatten)]
        session: SessionArg,
        /// Send one message, print the reply, exit.
        #[arg(short, long)]
        message: Option<String>,
    },
    /// Compact a session's history now (/compact).
    Compact {
        #[command(flatten)]
        conn: Conn,
        #[command(flatten)]
        session: SessionArg,
        /// What the summary should focus on.
        #[arg(long)]
        instructions: Option<String>,
    },
    /// List or show sessions.
    Sessions {
        #[command(subcommand)]
        command: SessionsCommand,
    },
    /// Context engines: list them, or lift a quarantine.
    Engines {
        #[command(subcommand)]
        command: EnginesCommand,
    },
    /// Durable-turn commits waiting for their engine: list, retry, drop.
    Outbox {
        #[command(subcommand)]
        command: OutboxCommand,
    },
    /// Check the configured context engine before running: reachable,
    /// contract valid, host requirements met. --fix resets the slot when
    /// no configured host can run the engine.
    Doctor {
        /// The JSON5 config file to check (and, with --fix, to edit).
        #[arg(long)]
        config: Option<PathBuf>,
        #[arg(long)]
        fix: bool,
    },
    /// The gateway's model, engines and sessions.
    Status {
        #[command(flatten)]
        conn: Conn,
        #[arg(long)]
        json: bool,
    },
    /// A grpc.health.v1 check of the gateway: exit 0 when it is SERVING,
    /// 1 otherwise (container health checks: the images have no shell).
    Health {
        #[command(flatten)]
        conn: Conn,
    },
}

impl Command {
    /// Runs the command; `Err` is the sentence `main` prints before exiting 1.
    pub async fn run(self) -> Result<(), CliError> {
        match self {
            Command::Serve { config, listen, state_dir } => serve::run(config, listen, state_dir).await,
            Command::Chat { conn, session, message } => chat::run(&conn, &session, message).await,
            Command::Compact { conn, session, instructions } => compact::run(&conn, &session, instructions).await,
            Command::Sessions { command } => sessions::run(command).await,
            Command::Status { conn, json } => status::run(&conn, json).await,
            Command::Health { conn } => health::run(&conn).await,
            Command::Engines { command } => engines::run(command).await,
            Command::Outbox { command } => outbox::run(command).await,
            Command::Doctor { config, fix } => Ok(doctor::run(config.as_deref(), fix).await?),
        }
    }
}

/// A failure of a command, worded for the user: `main` prints it after
/// `ctxgate: ` and exits 1.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// The gateway could not be reached, or not as asked (TLS).
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// The gateway refused a call; worded by `explain`.
    #[error("{}", explain(.0))]
    Call(#[from] Status),
    /// A turn the gateway ran and reported failed, in its own words.
    #[error("{0}")]
    TurnFailed(String),
    /// The turn's stream ended with neither `Completed` nor `Failed`.
    #[error("The gateway ended the turn without an answer.")]
    TurnUnanswered,
    /// The compaction's stream ended without its `Done`.
    #[error("The gateway ended the compaction without a result.")]
    CompactionUnfinished,
    /// `ctxgate engines tools ID` for an id the gateway does not know.
    #[error("No engine {0:?} is configured (ctxgate engines ls lists them).")]
    NoSuchEngine(String),
    /// `ctxgate health`: the gateway answered, and is not SERVING.
    #[error("The gateway at {gateway} reports {status}.")]
    NotServing { gateway: String, status: &'static str },
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Serve(#[from] ServeError),
    #[error(transparent)]
    Doctor(#[from] DoctorError),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// Why a client command could not talk to the gateway: the one wording of
/// connection and TLS failures.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("{0:?} is not a gateway URL (expected http://HOST:PORT)")]
    NotAUrl(String),
    /// `--tls-*` with an http:// gateway: never plaintext (with the bearer
    /// token) when TLS was asked for.
    #[error("--tls-ca/--tls-cert are for an https:// gateway; {0} is plaintext (use https://)")]
    TlsOverPlaintext(String),
    /// The `--tls-*` files, unreadable or unusable (worded by the SDK).
    #[error(transparent)]
    TlsFiles(ctxgate_runtime::tls::TlsError),
    /// tonic refused the client TLS settings.
    #[error("TLS: {}", crate::causes(.0))]
    TlsSettings(tonic::transport::Error),
    /// The connection failed, and `tls_hint` says why.
    #[error("The connection to the gateway at {gateway} failed: {hint}.")]
    Tls { gateway: String, hint: &'static str },
    #[error(
        "Cannot reach the gateway at {gateway} ({detail}). Is `ctxgate serve` running? (--gateway or CTXGATE_GATEWAY picks another)"
    )]
    Unreachable { gateway: String, detail: String },
    #[error("The gateway at {gateway} did not answer within {secs} s.")]
    Silent { gateway: String, secs: u64 },
    #[error("the token has characters a header cannot carry")]
    TokenNotAHeader,
    #[error("--token-file {}: {source}", .path.display())]
    TokenFile { path: std::path::PathBuf, source: std::io::Error },
}

#[derive(Args, Debug, Clone)]
pub struct Conn {
    /// The gateway to talk to.
    #[arg(long, env = "CTXGATE_GATEWAY", default_value = "http://127.0.0.1:7300")]
    pub gateway: String,
    /// Bearer token, when the gateway requires one. A flag shows in `ps`
    /// to every user of the machine: prefer CTXGATE_AUTH_TOKEN or
    /// --token-file.
    #[arg(long, env = "CTXGATE_AUTH_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// A file holding the bearer token (surrounding whitespace ignored);
    /// it wins over --token and CTXGATE_AUTH_TOKEN.
    #[arg(long, env = "CTXGATE_AUTH_TOKEN_FILE")]
    pub token_file: Option<std::path::PathBuf>,
    /// For an https:// gateway: the CA (PEM) its certificate must chain to
    /// (default: the public web roots).
    #[arg(long, env = "CTXGATE_TLS_CA")]
    pub tls_ca: Option<std::path::PathBuf>,
    /// A client certificate (PEM) for a gateway that requires one (mTLS),
    /// with `--tls-key`.
    #[arg(long, env = "CTXGATE_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<std::path::PathBuf>,
    #[arg(long, env = "CTXGATE_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<std::path::PathBuf>,
}

impl Conn {
    /// The client TLS settings for an https:// gateway.
    fn tls(&self) -> Result<tonic::transport::ClientTlsConfig, ConnectError> {
        use ctxgate_runtime::tls;
        let ca = self.tls_ca.as_deref().map(|p| tls::Pem::new("--tls-ca", p));
        let identity = tls::pair(self.tls_cert.as_ref(), self.tls_key.as_ref(), ("--tls-cert", "--tls-key"));
        tls::client(ca, identity).map_err(ConnectError::TlsFiles)
    }
}

/// What a failed connection means, when TLS is why (from the error text:
/// rustls' certificate errors and alerts; the rest is a guess, said so).
fn tls_hint(detail: &str, https: bool) -> Option<&'static str> {
    let hints: &[(&[&str], &str)] = &[
        (&["UnknownIssuer"], "its certificate is not signed by a CA you trust (--tls-ca)"),
        (&["certificate expired", "Expired"], "its certificate has expired"),
        (&["not valid for name", "NotValidForName"], "its certificate is not for that host name"),
        (&["CertificateRequired"], "it requires a client certificate (--tls-cert and --tls-key)"),
        (&["UnknownCA", "BadCertificate", "DecryptError"], "it refused your client certificate"),
        (&["InvalidContentType", "CorruptMessage"], "it does not speak TLS at that address (use http://)"),
    ];
    if let Some((_, hint)) = hints.iter().find(|(keys, _)| keys.iter().any(|k| detail.contains(k))) {
        return Some(hint);
    }
    // Connected, then dropped at once (or TLS bytes read as HTTP/2): a guess.
    // hyper words a drop before the HTTP/2 handshake ended as a request
    // cancelled on a "connection was not ready".
    let dropped =
        ["frame with invalid size", "connection closed", "broken pipe", "reset by peer", "connection was not ready"]
            .iter()
            .any(|k| detail.contains(k));
    match (dropped, https) {
        (true, false) => Some(
            "it dropped the connection at once: it may expect TLS (use https:// and --tls-ca), or not be a ctxgate gateway",
        ),
        // With TLS 1.3 a refused client certificate shows only as the
        // gateway closing the connection right after the handshake.
        (true, true) => Some(
            "it closed the connection after the TLS handshake: it may require a client certificate its CA signed (--tls-cert and --tls-key)",
        ),
        (false, _) => None,
    }
}

#[derive(Args, Debug, Clone)]
pub struct SessionArg {
    /// The session key.
    #[arg(long, default_value = "default")]
    pub session: String,
    #[arg(long, default_value = "main")]
    pub agent: String,
}

impl SessionArg {
    fn as_ref(&self) -> api::SessionRef {
        api::SessionRef { agent_id: self.agent.clone(), session_key: self.session.clone() }
    }
}

type Client = GatewayClient<InterceptedService<Channel, Bearer>>;

#[derive(Clone)]
pub struct Bearer(Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>);

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

async fn connect(conn: &Conn) -> Result<Client, ConnectError> {
    let channel = channel(conn).await?;
    let token = match &conn.token_file {
        Some(path) => {
            let read = std::fs::read_to_string(path)
                .map_err(|source| ConnectError::TokenFile { path: path.clone(), source })?;
            match read.trim() {
                "" => {
                    return Err(ConnectError::TokenFile {
                        path: path.clone(),
                        source: std::io::Error::other("it is empty"),
                    });
                }
                t => Some(t.to_owned()),
            }
        }
        None => conn.token.clone(),
    };
    let token = match token {
        Some(t) => Some(format!("Bearer {t}").parse().map_err(|_| ConnectError::TokenNotAHeader)?),
        None => None,
    };
    Ok(GatewayClient::with_interceptor(channel, Bearer(token))
        .max_decoding_message_size(ctxgate_proto::limits::MAX_GRPC_MESSAGE_BYTES))
}

/// A checked connection to the gateway (TLS when https://).
async fn channel(conn: &Conn) -> Result<Channel, ConnectError> {
    let mut endpoint = Channel::from_shared(conn.gateway.clone())
        .map_err(|_| ConnectError::NotAUrl(conn.gateway.clone()))?
        .connect_timeout(Duration::from_secs(5));
    let https = conn.gateway.starts_with("https://");
    if !https && (conn.tls_ca.is_some() || conn.tls_cert.is_some()) {
        // Never plaintext (with the bearer token) when TLS was asked for.
        return Err(ConnectError::TlsOverPlaintext(conn.gateway.clone()));
    }
    if https {
        endpoint = endpoint.tls_config(conn.tls()?).map_err(ConnectError::TlsSettings)?;
    }
    let unreachable = |detail: String| match tls_hint(&detail, https) {
        Some(hint) => ConnectError::Tls { gateway: conn.gateway.clone(), hint },
        None => ConnectError::Unreachable { gateway: conn.gateway.clone(), detail },
    };
    let channel = endpoint.connect().await.map_err(|e| unreachable(crate::causes(&e)))?;
    // One health check (not behind the bearer token): a TLS mismatch shows
    // on the first call, and is worded here where the connection is known.
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
    let check = health.check(tonic_health::pb::HealthCheckRequest { service: String::new() });
    match tokio::time::timeout(Duration::from_secs(5), check).await {
        Err(_) => return Err(ConnectError::Silent { gateway: conn.gateway.clone(), secs: 5 }),
        Ok(Err(s)) if s.source().is_some() => return Err(unreachable(crate::causes(&s))),
        Ok(_) => {}
    }
    Ok(channel)
}

/// Words a status for the user.
fn explain(s: &Status) -> String {
    match s.code() {
        Code::Unavailable if s.message().is_empty() => {
            "The gateway went away. Is `ctxgate serve` still running?".into()
        }
        Code::Unauthenticated => format!("The gateway refused the call: {}.", s.message()),
        _ => format!("{}.", s.message().trim_end_matches('.')),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Users (and scripts) read these sentences: the typed errors must word
    // them exactly as the strings they replaced did.
    #[test]
    fn errors_keep_their_wording() {
        let gateway = "http://127.0.0.1:1".to_owned();
        let cases: Vec<(CliError, &str)> = vec![
            (ConnectError::NotAUrl("nope".into()).into(), r#""nope" is not a gateway URL (expected http://HOST:PORT)"#),
            (
                ConnectError::TlsOverPlaintext(gateway.clone()).into(),
                "--tls-ca/--tls-cert are for an https:// gateway; http://127.0.0.1:1 is plaintext (use https://)",
            ),
            (
                ConnectError::Tls { gateway: gateway.clone(), hint: "its certificate has expired" }.into(),
                "The connection to the gateway at http://127.0.0.1:1 failed: its certificate has expired.",
            ),
            (
                ConnectError::Unreachable { gateway: gateway.clone(), detail: "refused".into() }.into(),
                "Cannot reach the gateway at http://127.0.0.1:1 (refused). Is `ctxgate serve` running? (--gateway or CTXGATE_GATEWAY picks another)",
            ),
            (
                ConnectError::Silent { gateway: gateway.clone(), secs: 3 }.into(),
                "The gateway at http://127.0.0.1:1 did not answer within 3 s.",
            ),
            (ConnectError::TokenNotAHeader.into(), "the token has characters a header cannot carry"),
            (Status::unavailable("").into(), "The gateway went away. Is `ctxgate serve` still running?"),
            (Status::unauthenticated("bad token").into(), "The gateway refused the call: bad token."),
            (Status::not_found("no such session.").into(), "no such session."),
            (CliError::TurnUnanswered, "The gateway ended the turn without an answer."),
            (CliError::CompactionUnfinished, "The gateway ended the compaction without a result."),
            (
                CliError::NotServing { gateway, status: "NOT_SERVING" },
                "The gateway at http://127.0.0.1:1 reports NOT_SERVING.",
            ),
            (DoctorError::NeedsAttention.into(), "the context engine needs attention (see above)"),
            (
                DoctorError::File { path: "/etc/ctxgate.json5".into(), source: std::io::Error::other("gone") }.into(),
                "/etc/ctxgate.json5: gone",
            ),
        ];
        for (e, want) in cases {
            assert_eq!(e.to_string(), want);
        }
    }

    /// The ways a plaintext client has seen a TLS gateway drop it (the
    /// last one from a CI run where the drop beat the HTTP/2 handshake).
    #[test]
    fn a_dropped_plaintext_connection_hints_at_tls() {
        for detail in [
            "transport error: frame with invalid size",
            "transport error: connection closed before message completed",
            "transport error: operation was canceled: connection was not ready",
        ] {
            let hint = tls_hint(detail, false).unwrap_or_default();
            assert!(hint.contains("may expect TLS"), "{detail}: {hint:?}");
        }
        assert_eq!(tls_hint("transport error: Connection refused (os error 111)", false), None);
    }
}
