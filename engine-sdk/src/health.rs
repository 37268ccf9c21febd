//! `<engine> health --endpoint ADDR`: a grpc.health.v1 check of the engine
//! service that exits 0 when it is SERVING and 1 otherwise, for container
//! health checks in images with no shell or other tools.

use std::process::ExitCode;
use std::time::Duration;

use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient};

use crate::endpoint::{Endpoint, channel};

/// The `health` subcommand's options.
#[derive(clap::Parser, Debug)]
#[command(about = "Checks a running engine: exit 0 when it is SERVING, 1 otherwise")]
pub struct HealthArgs {
    /// The engine to check (HOST:PORT or unix:///PATH).
    #[arg(long)]
    pub endpoint: Endpoint,
    /// How long the check may take.
    #[arg(long, default_value_t = 3.0)]
    pub timeout_seconds: f64,
}

/// Whether `endpoint` reports the engine service SERVING; else why not, as
/// a sentence.
pub async fn check(endpoint: &Endpoint, timeout: Duration) -> Result<(), String> {
    let req = HealthCheckRequest { service: ctxgate_proto::ENGINE_SERVICE.into() };
    let mut client = HealthClient::new(channel(endpoint));
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
    let timeout = Duration::from_secs_f64(parsed.timeout_seconds.clamp(0.1, 60.0));
    Some(match check(&parsed.endpoint, timeout).await {
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
