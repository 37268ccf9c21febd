//! One health monitor per remote engine: attach (GetInfo + contract
//! validation), then `grpc.health.v1` Watch — periodic Check when Watch is
//! unimplemented, healthy when there is no health service at all — with
//! reconnect backoff, and re-admission once the engine is SERVING again
//! and its penalty is served.
//!
//! Every health RPC runs in a task of its own: tonic panics on some
//! malformed replies (a non-base64 `grpc-status-details-bin` trailer), and
//! such an engine must read as unhealthy, not kill its monitor.

use std::sync::Arc;
use std::time::Duration;

use ctxgate_proto::ENGINE_SERVICE;
use ctxgate_runtime::AbortOnDrop;
use tokio::sync::watch;
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;
use tonic::Code;
use tonic::transport::Channel;
use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient};

use super::Call;
use super::guarded::{Guarded, Health};

const BACKOFF_START: Duration = Duration::from_millis(100);
/// Reconnect attempts never wait longer than this, so an engine that comes
/// back is seen within about a second.
const BACKOFF_MAX: Duration = Duration::from_secs(1);
const CHECK_INTERVAL: Duration = Duration::from_millis(500);
/// While a Watch stream is open, a Check this often too: a Watch says only
/// when health changes, and an engine that hangs (a paused container, a
/// stopped process whose socket stays open) changes nothing — it would
/// read SERVING until a call with a long deadline (a summary's AfterTurn)
/// ran out. A Check it cannot answer within [`CHECK_TIMEOUT`] is
/// unreachable.
const LIVENESS_INTERVAL: Duration = Duration::from_secs(5);

fn status_health(status: i32) -> Health {
    if status == ServingStatus::Serving as i32 { Health::Serving } else { Health::NotServing }
}

/// How a Watch session ended.
enum WatchEnd {
    /// The engine has no Watch (or no health service): poll Check.
    Unimplemented,
    /// The stream broke, or never started: reconnect after a backoff.
    Broken,
    /// The engine does not know its own service name.
    NotFound,
}

/// One Watch call, forwarding every status it reports to `seen`.
/// Sends each status the engine reports to `seen`, which keeps only the
/// latest: an engine streaming statuses as fast as it can costs one slot,
/// and the monitor acts on where health is now.
async fn watch(channel: Channel, seen: watch::Sender<Option<Health>>) -> WatchEnd {
    let req = HealthCheckRequest { service: ENGINE_SERVICE.into() };
    let mut stream = match HealthClient::new(channel).watch(req).await {
        Ok(s) => s.into_inner(),
        Err(s) if s.code() == Code::Unimplemented => return WatchEnd::Unimplemented,
        Err(s) if s.code() == Code::NotFound => return WatchEnd::NotFound,
        Err(_) => return WatchEnd::Broken,
    };
    loop {
        match stream.next().await {
            Some(Ok(r)) => {
                seen.send_replace(Some(status_health(r.status)));
            }
            Some(Err(s)) if s.code() == Code::NotFound => return WatchEnd::NotFound,
            // A broken stream may be a blip: reconnect first; only a failed
            // reconnect marks it unreachable (so a call failing at the same
            // moment names the operation).
            _ => return WatchEnd::Broken,
        }
    }
}

/// How long one health Check may take: an engine that accepts the call and
/// never answers is unreachable, not a monitor stuck for ever.
const CHECK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// One Check call, in its own task, bounded by [`CHECK_TIMEOUT`].
async fn check(channel: Channel) -> Health {
    let task = tokio::spawn(async move {
        let mut req = tonic::Request::new(HealthCheckRequest { service: ENGINE_SERVICE.into() });
        req.set_timeout(CHECK_TIMEOUT);
        let answer = tokio::time::timeout(CHECK_TIMEOUT, HealthClient::new(channel).check(req)).await;
        let Ok(answer) = answer else { return Health::Unreachable };
        match answer {
            Ok(r) => status_health(r.into_inner().status),
            Err(s) if s.code() == Code::Unimplemented => Health::NoHealthService,
            Err(s) if s.code() == Code::NotFound => Health::NotServing,
            Err(_) => Health::Unreachable,
        }
    });
    let _abort = AbortOnDrop(task.abort_handle());
    // A panic inside tonic is a broken engine.
    task.await.unwrap_or(Health::Unreachable)
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
        Err(e) => {
            tracing::warn!(engine = %engine.id(), error = %e, "re-attach failed; the engine stays quarantined");
            engine.attach_failed(&e.to_string());
        }
    }
}

/// Runs until `stop` fires.
pub async fn monitor(engine: Arc<Guarded>, stop: CancellationToken) {
    let mut backoff = BACKOFF_START;
    while !stop.is_cancelled() {
        let (seen_tx, mut seen) = watch::channel(None);
        let session = tokio::spawn(watch(engine.remote.channel(), seen_tx));
        let _abort = AbortOnDrop(session.abort_handle());
        let mut session = Box::pin(session);
        let probe = |channel: Channel| async move {
            tokio::time::sleep(LIVENESS_INTERVAL).await;
            check(channel).await
        };
        let mut liveness = Box::pin(probe(engine.remote.channel()));
        let end = loop {
            tokio::select! {
                Ok(()) = seen.changed() => {
                    if let Some(h) = *seen.borrow_and_update() {
                        backoff = BACKOFF_START;
                        engine.set_health(h);
                    }
                }
                end = &mut session => break end.unwrap_or(WatchEnd::Broken),
                h = &mut liveness => {
                    if h == Health::Unreachable {
                        engine.set_health(h);
                        break WatchEnd::Broken;
                    }
                    liveness.set(probe(engine.remote.channel()));
                }
                () = readmit_if_due(&engine, &stop) => {}
                () = stop.cancelled() => return,
            }
        };
        // The status the session sent just before it ended.
        let last = {
            let r = seen.borrow_and_update();
            if r.has_changed() { *r } else { None }
        };
        if let Some(h) = last {
            engine.set_health(h);
        }
        match end {
            WatchEnd::NotFound => engine.set_health(Health::NotServing),
            WatchEnd::Broken => {}
            WatchEnd::Unimplemented => loop {
                // No Watch: poll Check; no health service at all counts as healthy.
                let h = check(engine.remote.channel()).await;
                engine.set_health(h);
                if h == Health::Unreachable {
                    break;
                }
                tokio::select! {
                    () = tokio::time::sleep(CHECK_INTERVAL) => {}
                    () = readmit_if_due(&engine, &stop) => {}
                    () = stop.cancelled() => return,
                }
            },
        }
        tokio::select! {
            () = tokio::time::sleep(backoff) => {}
            () = stop.cancelled() => return,
        }
        // A Watch that cannot even start again means the engine is gone.
        if matches!(end, WatchEnd::Broken) && check(engine.remote.channel()).await == Health::Unreachable {
            engine.set_health(Health::Unreachable);
        }
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}
