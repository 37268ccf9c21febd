//! `ctxgate health`: a `grpc.health.v1` check of the gateway, for container
//! health checks (the images have no shell).

use std::time::Duration;

use super::{CliError, Conn, channel, explain};

/// `ctxgate health`: SERVING, or a sentence and exit code 1.
pub async fn run(conn: &Conn) -> Result<(), CliError> {
    let channel = channel(conn).await?;
    let req = tonic_health::pb::HealthCheckRequest { service: crate::server::GATEWAY_SERVICE.into() };
    let mut client = tonic_health::pb::health_client::HealthClient::new(channel);
    let status = match tokio::time::timeout(Duration::from_secs(3), client.check(req)).await {
        Err(_) => return Err(CliError(format!("The gateway at {} did not answer within 3 s.", conn.gateway))),
        Ok(r) => r.map_err(explain)?.into_inner().status(),
    };
    match status {
        tonic_health::pb::health_check_response::ServingStatus::Serving => {
            println!("SERVING");
            Ok(())
        }
        other => Err(CliError(format!("The gateway at {} reports {}.", conn.gateway, other.as_str_name()))),
    }
}
