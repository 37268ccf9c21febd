//! `ctxgate health`: a `grpc.health.v1` check of the gateway, for container
//! health checks (the images have no shell).

use std::time::Duration;

use super::{CliError, Conn, ConnectError, channel};

/// `ctxgate health`: SERVING, or a sentence and exit code 1.
pub async fn run(conn: &Conn) -> Result<(), CliError> {
    let channel = channel(conn).await?;
    let req = tonic_health::pb::HealthCheckRequest { service: crate::api::server::GATEWAY_SERVICE.into() };
    let mut client = tonic_health::pb::health_client::HealthClient::new(channel);
    let status = match tokio::time::timeout(Duration::from_secs(3), client.check(req)).await {
        Err(_) => return Err(ConnectError::Silent { gateway: conn.gateway.clone(), secs: 3 }.into()),
        Ok(r) => r?.into_inner().status(),
    };
    match status {
        tonic_health::pb::health_check_response::ServingStatus::Serving => {
            println!("SERVING");
            Ok(())
        }
        other => Err(CliError::NotServing { gateway: conn.gateway.clone(), status: other.as_str_name() }),
    }
}
