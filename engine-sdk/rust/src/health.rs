//! `<engine> health --endpoint ADDR`: a grpc.health.v1 check of the engine
//! service that exits 0 when it is SERVING and 1 otherwise, for container
//! health checks in images with no shell or other tools.

use std::process::ExitCode;
use std::time::Duration;

use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient};

use ctxgate_runtime::endpoint::channel;

/// The `health` subcommand's options.
#[derive(clap::Parser, Debug)]
#[command(about = "Checks a running engine: exit 0 when it is SERVING, 1 otherwise")]
pub struct HealthArgs {
    /// The engine to check: HOST:PORT, https://HOST:PORT (TLS) or
    /// unix:///PATH.
    #[arg(long)]
    pub endpoint: crate::host::HostEndpoint,
    /// How long the check may take.
    #[arg(long, default_value_t = 3.0)]
    pub timeout_seconds: f64,
    /// With https://: the CA (PEM) the engine's certificate chains to
    /// (default: the public web roots).
    #[arg(long)]
    pub tls_ca: Option<std::path::PathBuf>,
    /// With https://: a client certificate and key (PEM), for an engine
    /// that requires one.
    #[arg(long, requires = "tls_key")]
    pub tls_cert: Option<std::path::PathBuf>,
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<std::path::PathBuf>,
}

impl HealthArgs {
    fn channel(&self) -> Result<tonic::transport::Channel, ctxgate_runtime::tls::TlsError> {
        let e = &self.endpoint;
        if !e.https {
            return Ok(channel(&e.endpoint));
        }
        let ca = self.tls_ca.as_deref().map(|p| ctxgate_runtime::tls::Pem::new("--tls-ca", p));
        let identity =
            ctxgate_runtime::tls::pair(self.tls_cert.as_ref(), self.tls_key.as_ref(), ("--tls-cert", "--tls-key"));
        let tls = ctxgate_runtime::tls::client(ca, identity)?.domain_name(e.host.clone());
        ctxgate_runtime::endpoint::tls_channel(&e.endpoint, tls)
    }
}

/// Whether the engine on `channel` (at `endpoint`) reports SERVING; else
/// why not, as a sentence.
pub async fn check(
    channel: tonic::transport::Channel,
    endpoint: &impl std::fmt::Display,
    timeout: Duration,
) -> Result<(), String> {
    let req = HealthCheckRequest { service: ctxgate_proto::ENGINE_SERVICE.into() };
    let mut client = HealthClient::new(channel);
    match tokio::time::timeout(timeout, client.check(req)).await {
        Err(_) => Err(format!("the engine at {endpoint} did not answer a health check within {timeout:?}")),
        Ok(Err(s)) => Err(format!("the engine at {endpoint} cannot be checked: {}", s.message())),
        Ok(Ok(r)) => match r.into_inner().status() {
            ServingStatus::Serving => Ok(()),
            other => Err(format!("the engine at {endpoint} reports {}", other.as_str_name())),
        },
    }
}

/// Runs `health` when it is the process's first argument (the engine's
/// own options are not parsed then); `None` otherwise. Engine binaries
/// call it first thing in `main`.
pub async fn subcommand(program: &str) -> Option<ExitCode> {
    let mut args = std::env::args_os();
    let bin = args.next()?;
    if args.next()? != "health" {
        return None;
    }
    let parsed = <HealthArgs as clap::Parser>::parse_from(std::iter::once(bin).chain(args));
    let secs = parsed.timeout_seconds;
    let timeout = Duration::from_secs_f64(if secs.is_finite() { secs.clamp(0.1, 60.0) } else { 3.0 });
    let checked = match parsed.channel() {
        Ok(c) => check(c, &parsed.endpoint, timeout).await,
        Err(e) => Err(e.to_string()),
    };
    Some(match checked {
        Ok(()) => {
            println!("SERVING");
            ExitCode::SUCCESS
        }
        Err(why) => {
            eprintln!("{program}: {why}");
            ExitCode::FAILURE
        }
    })
}
