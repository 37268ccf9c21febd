//! One health monitor per remote engine: attach (GetInfo + contract
//! validation), then `grpc.health.v1` Watch — periodic Check when Watch is
//! unimplemented, healthy when there is no health service at all — with
//! reconnect backoff, and re-admission once the engine is SERVING again
//! and its penalty is served.

use std::sync::Arc;
use std::time::Duration;

use ctxgate_proto::ENGINE_SERVICE;
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;
use tonic::Code;
use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient};

use super::Call;
use super::guarded::{Guarded, Health};

const BACKOFF_START: Duration = Duration::from_millis(100);
/// Reconnect attempts never wait longer than this, so an engine that comes
/// back is seen within about a second.
const BACKOFF_MAX: Duration = Duration::from_secs(1);
const CHECK_INTERVAL: Duration = Duration::from_millis(500);

fn status_health(status: i32) -> Health {
    if status == ServingStatus::Serving as i32 { Health::Serving } else { Health::NotServing }
}

/// Re-attaches (GetInfo is re-validated after every reconnect) and lifts
/// the quarantine, if re-admission is due.
async fn readmit_if_due(engine: &Guarded, stop: &CancellationToken) {
    // Registered before the check, so no change slips between the two.
    let changed = engine.changed.notified();
    let Some(at) = engine.readmit_at() else {
        // Nothing due: wait for a change (or the stop).
        tokio::select! { () = changed => {}, () = stop.cancelled() => {} }
        return;
    };
    tokio::select! {
        () = tokio::time::sleep_until(at) => {}
        () = stop.cancelled() => return,
        // Something changed (a new quarantine, a health flip): re-evaluate.
        () = changed => return,
    }
    if engine.readmit_at().is_none() {
        return;
    }
    match engine.remote.attach(&Call::new(stop.child_token())).await {
        Ok(_) => {
            engine.readmit("health reports SERVING");
        }
        Err(e) => tracing::warn!(engine = %engine.id(), error = %e, "re-attach failed; the engine stays quarantined"),
    }
}

/// Runs until `stop` fires.
pub async fn monitor(engine: Arc<Guarded>, stop: CancellationToken) {
    let mut backoff = BACKOFF_START;
    while !stop.is_cancelled() {
        let mut health = HealthClient::new(engine.remote.channel());
        let watch = health.watch(HealthCheckRequest { service: ENGINE_SERVICE.into() }).await;
        match watch {
            Ok(stream) => {
                backoff = BACKOFF_START;
                let mut stream = stream.into_inner();
                loop {
                    tokio::select! {
                        item = stream.next() => match item {
                            Some(Ok(r)) => engine.set_health(status_health(r.status)),
                            // NOT_FOUND: the engine does not know the service name.
                            Some(Err(s)) if s.code() == Code::NotFound => { engine.set_health(Health::NotServing); break; }
                            // A broken stream may be a blip: reconnect first;
                            // only a failed reconnect marks it unreachable (so a
                            // call failing at the same moment names the operation).
                            _ => break,
                        },
                        () = readmit_if_due(&engine, &stop) => {}
                        () = stop.cancelled() => return,
                    }
                }
            }
            Err(s) if s.code() == Code::Unimplemented => {
                // No Watch: poll Check; no health service at all counts as healthy.
                loop {
                    let h = match health.check(HealthCheckRequest { service: ENGINE_SERVICE.into() }).await {
                        Ok(r) => status_health(r.into_inner().status),
                        Err(s) if s.code() == Code::Unimplemented => Health::NoHealthService,
                        Err(s) if s.code() == Code::NotFound => Health::NotServing,
                        Err(_) => Health::Unreachable,
                    };
                    engine.set_health(h);
                    if h == Health::Unreachable {
                        break;
                    }
                    tokio::select! {
                        () = tokio::time::sleep(CHECK_INTERVAL) => {}
                        () = readmit_if_due(&engine, &stop) => {}
                        () = stop.cancelled() => return,
                    }
                }
            }
            Err(_) => engine.set_health(Health::Unreachable),
        }
        tokio::select! {
            () = tokio::time::sleep(backoff) => {}
            () = stop.cancelled() => return,
        }
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}
