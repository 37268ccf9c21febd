//! The SDK server's guarantees, seen from a real gRPC client: cancellation
//! and deadlines reach the engine, panics become INTERNAL without killing
//! the connection, Compact streams end with one terminal event, shutdown
//! reports NOT_SERVING and drains, and host callbacks need a grant.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::sync::Arc;
use std::time::Duration;

use ctxgate_engine_sdk::pb::{self, compact_event::Event};
use ctxgate_engine_sdk::testkit::{TestEngine, TestHost, msg};
use ctxgate_engine_sdk::{
    CallContext, CompactOutcome, ContextEngine, Endpoint, EngineError, HostPolicy, Progress, READ_TRANSCRIPT, Server,
};
use ctxgate_runtime::{connect, engine_client};
use tokio::sync::{Notify, mpsc};
use tokio::time::Instant;
use tokio_stream::StreamExt;
use tonic::Code;
use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient};

/// What the probe engine saw.
#[derive(Debug)]
enum Seen {
    Deadline(Option<Duration>),
    Cancelled,
    Transcript(Result<usize, String>),
}

/// An engine whose methods misbehave on request, keyed by the session id:
/// "wait" blocks until cancelled, "panic" panics, "slow" answers after
/// 300 ms, "read" reads the transcript through the host.
struct Probe {
    seen: mpsc::UnboundedSender<Seen>,
    started: Arc<Notify>,
}

impl ContextEngine for Probe {
    async fn get_info(&self, _: &CallContext) -> Result<pb::EngineInfo, EngineError> {
        Ok(pb::EngineInfo {
            id: "probe".into(),
            name: "probe".into(),
            contract_version: "1.0".into(),
            ..Default::default()
        })
    }

    async fn ingest(&self, _: &CallContext, _: pb::IngestRequest) -> Result<pb::IngestResult, EngineError> {
        Ok(pb::IngestResult { ingested: true })
    }

    async fn assemble(&self, ctx: &CallContext, req: pb::AssembleRequest) -> Result<pb::AssembleResult, EngineError> {
        let _ = self.seen.send(Seen::Deadline(ctx.remaining()));
        match req.session_id.as_str() {
            "wait" => {
                // Work the engine spawned itself: it stops through the token.
                let token = ctx.cancellation().clone();
                let seen = self.seen.clone();
                tokio::spawn(async move {
                    token.cancelled().await;
                    let _ = seen.send(Seen::Cancelled);
                });
                self.started.notify_one();
                std::future::pending::<()>().await;
                unreachable!()
            }
            "panic" => panic!("engine bug"),
            "slow" => {
                self.started.notify_one();
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            "read" => {
                let r = match ctx.host() {
                    None => Err("no host".to_owned()),
                    Some(h) => h
                        .read_transcript(ctx, false)
                        .await
                        .map(|e| e.len())
                        .map_err(|e| tonic::Status::from(e).code().to_string()),
                };
                let _ = self.seen.send(Seen::Transcript(r));
            }
            _ => {}
        }
        Ok(pb::AssembleResult { estimated_tokens: 1, messages: req.messages, ..Default::default() })
    }

    async fn compact(
        &self,
        _: &CallContext,
        req: pb::CompactRequest,
        progress: Progress,
    ) -> Result<CompactOutcome, EngineError> {
        progress.report("one", 1, 2, "half").await?;
        match req.session_id.as_str() {
            "panic" => panic!("compaction bug"),
            "delegate" => Ok(CompactOutcome::DelegateToHost(pb::DelegateToHost {
                reason: Some("use yours".into()),
                custom_instructions: None,
            })),
            _ => Ok(CompactOutcome::Done(pb::CompactResult {
                ok: true,
                compacted: true,
                tokens_before: 10,
                ..Default::default()
            })),
        }
    }
}

fn probe() -> (Probe, mpsc::UnboundedReceiver<Seen>, Arc<Notify>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let started = Arc::new(Notify::new());
    (Probe { seen: tx, started: started.clone() }, rx, started)
}

fn assemble(session: &str) -> pb::AssembleRequest {
    pb::AssembleRequest { session_id: session.into(), messages: vec![msg::user("m", "hi")], ..Default::default() }
}

async fn next_seen(rx: &mut mpsc::UnboundedReceiver<Seen>) -> Seen {
    tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("the engine reports in time")
        .expect("engine alive")
}

#[tokio::test]
async fn a_client_cancel_fires_the_engines_token() {
    let (engine, mut seen, started) = probe();
    let e = TestEngine::start(engine).await.unwrap();
    let mut c = e.client.clone();
    let call = tokio::spawn(async move { c.assemble(assemble("wait")).await });
    started.notified().await;
    assert!(matches!(next_seen(&mut seen).await, Seen::Deadline(None)), "no grpc-timeout, no deadline");
    let cancelled_at = Instant::now();
    call.abort();
    assert!(matches!(next_seen(&mut seen).await, Seen::Cancelled));
    eprintln!("engine saw the cancel after {:?}", cancelled_at.elapsed());
}

#[tokio::test]
async fn the_deadline_reaches_the_engine_and_fires_the_token() {
    let (engine, mut seen, _) = probe();
    let e = TestEngine::start(engine).await.unwrap();
    let mut req = tonic::Request::new(assemble("wait"));
    req.set_timeout(Duration::from_millis(400));
    let err = e.client.clone().assemble(req).await.unwrap_err();
    // tonic's client reports its own expired timeout as CANCELLED "Timeout expired".
    assert!(matches!(err.code(), Code::DeadlineExceeded | Code::Cancelled), "{err:?}");
    let Seen::Deadline(Some(left)) = next_seen(&mut seen).await else { panic!("deadline not seen") };
    assert!(left <= Duration::from_millis(400) && !left.is_zero(), "{left:?}");
    assert!(matches!(next_seen(&mut seen).await, Seen::Cancelled));
}

#[tokio::test]
async fn a_panicking_method_is_internal_and_the_connection_keeps_serving() {
    let (engine, _seen, _) = probe();
    let e = TestEngine::start(engine).await.unwrap();
    let mut c = e.client.clone();
    let err = c.assemble(assemble("panic")).await.unwrap_err();
    assert_eq!(err.code(), Code::Internal);
    assert!(!err.message().contains("engine bug"), "panic text is not sent: {err:?}");
    let mut stream = c
        .compact(pb::CompactRequest { session_id: "panic".into(), session_key: "k".into(), ..Default::default() })
        .await
        .unwrap()
        .into_inner();
    assert!(matches!(stream.next().await, Some(Ok(pb::CompactEvent { event: Some(Event::Progress(_)) }))));
    assert_eq!(stream.next().await.unwrap().unwrap_err().code(), Code::Internal);
    assert!(stream.next().await.is_none());
    c.get_info(pb::GetInfoRequest {}).await.expect("same channel still serves");
}

#[tokio::test]
async fn compact_streams_progress_then_one_terminal_event() {
    let (engine, _seen, _) = probe();
    let e = TestEngine::start(engine).await.unwrap();
    for (session, want_delegate) in [("ok", false), ("delegate", true)] {
        let req = pb::CompactRequest { session_id: session.into(), session_key: "k".into(), ..Default::default() };
        let events: Vec<_> =
            e.client.clone().compact(req).await.unwrap().into_inner().collect::<Result<_, _>>().await.unwrap();
        assert_eq!(events.len(), 2);
        assert!(matches!(&events[0].event, Some(Event::Progress(p)) if p.done == 1 && p.total == 2));
        match &events[1].event {
            Some(Event::DelegateToHost(d)) => assert!(want_delegate && d.reason.as_deref() == Some("use yours")),
            Some(Event::Result(r)) => assert!(!want_delegate && r.compacted),
            other => panic!("{other:?}"),
        }
    }
}

#[tokio::test]
async fn invalid_requests_never_reach_the_engine() {
    let (engine, mut seen, _) = probe();
    let e = TestEngine::start(engine).await.unwrap();
    let mut bad = assemble("s");
    bad.messages.push(msg::user("m", "duplicate id"));
    let err = e.client.clone().assemble(bad).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().starts_with("messages[1].id"), "{}", err.message());
    let err = e
        .client
        .clone()
        .compact(pb::CompactRequest { session_id: "s".into(), ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!((err.code(), err.message()), (Code::InvalidArgument, "session_key: is required"));
    assert!(seen.try_recv().is_err(), "the engine was not called");
}

#[tokio::test]
async fn host_callbacks_need_a_grant_for_the_same_session() {
    let (engine, mut seen, _) = probe();
    let e = TestEngine::start(engine).await.unwrap();
    let host = TestHost::start().await.unwrap();
    host.set_transcript("read", vec![pb::TranscriptEntry { id: "m".into(), ..Default::default() }]);
    let mut c = e.client.clone();

    let outcome = |grant: Option<pb::HostAccess>| {
        let mut req = assemble("read");
        req.host = grant;
        let mut c = c.clone();
        async move {
            c.assemble(req).await.unwrap();
        }
    };
    outcome(None).await;
    assert!(matches!(next_seen(&mut seen).await, Seen::Deadline(_)));
    assert!(matches!(next_seen(&mut seen).await, Seen::Transcript(Err(e)) if e == "no host"));

    outcome(Some(host.grant("read", &[READ_TRANSCRIPT], Duration::from_secs(30)))).await;
    next_seen(&mut seen).await;
    assert!(matches!(next_seen(&mut seen).await, Seen::Transcript(Ok(1))));

    // A grant for another session: the host refuses, the engine reads nothing.
    let mut other = host.grant("other", &[READ_TRANSCRIPT], Duration::from_secs(30));
    other.grant.as_mut().unwrap().session_id = "read".into(); // a forged copy of the scope
    outcome(Some(other)).await;
    next_seen(&mut seen).await;
    assert!(matches!(next_seen(&mut seen).await, Seen::Transcript(Err(_))));

    // An expired grant is refused before any call is made.
    outcome(Some(host.grant("read", &[READ_TRANSCRIPT], Duration::ZERO))).await;
    next_seen(&mut seen).await;
    assert!(
        matches!(next_seen(&mut seen).await, Seen::Transcript(Err(e)) if e == Code::FailedPrecondition.to_string())
    );
    c.get_info(pb::GetInfoRequest {}).await.unwrap();
}

#[tokio::test]
async fn a_host_endpoint_that_is_not_the_caller_is_never_dialled_unless_allowed() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    // A canary on another loopback address: any connection to it is a dial.
    let canary = tokio::net::TcpListener::bind("127.0.0.2:0").await.unwrap();
    let foreign = canary.local_addr().unwrap().to_string();
    let dials = Arc::new(AtomicUsize::new(0));
    let counted = dials.clone();
    tokio::spawn(async move {
        while let Ok((socket, _)) = canary.accept().await {
            counted.fetch_add(1, Ordering::SeqCst);
            drop(socket);
        }
    });
    let host = TestHost::start().await.unwrap();
    let mut access = host.grant("read", &[READ_TRANSCRIPT], Duration::from_secs(30));
    access.endpoint = foreign.clone();

    let allowed = HostPolicy::allow(vec![foreign.parse().unwrap()]);
    for (policy, dialled) in [(HostPolicy::default(), false), (allowed, true)] {
        let (engine, mut seen, _) = probe();
        let e = TestEngine::start_server(Server::new(engine).host_policy(policy)).await.unwrap();
        let mut req = tonic::Request::new(pb::AssembleRequest { host: Some(access.clone()), ..assemble("read") });
        req.set_timeout(Duration::from_secs(5));
        e.client.clone().assemble(req).await.unwrap();
        next_seen(&mut seen).await;
        let read = next_seen(&mut seen).await;
        if dialled {
            assert!(matches!(read, Seen::Transcript(Err(ref e)) if e != "no host"), "{read:?}");
            assert!(dials.load(Ordering::SeqCst) > 0, "a listed endpoint is called");
        } else {
            assert!(matches!(read, Seen::Transcript(Err(ref e)) if e == "no host"), "{read:?}");
            assert_eq!(dials.load(Ordering::SeqCst), 0, "the engine never connected to {foreign}");
        }
    }
}

#[tokio::test]
async fn shutdown_reports_not_serving_and_drains_in_flight_calls() {
    let (engine, _seen, started) = probe();
    let bound = Server::new(engine)
        .drain_timeout(Duration::from_secs(5))
        .bind(&Endpoint::Tcp(([127, 0, 0, 1], 0).into()))
        .await
        .unwrap();
    let endpoint = format!("http://{}", bound.local_endpoint());
    let stop = Arc::new(Notify::new());
    let stopping = stop.clone();
    let server = tokio::spawn(bound.serve(async move { stopping.notified().await }));
    let channel = connect(&endpoint).unwrap();

    let mut watch = HealthClient::new(channel.clone())
        .watch(HealthCheckRequest { service: ctxgate_engine_sdk::proto::ENGINE_SERVICE.into() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(watch.next().await.unwrap().unwrap().status, ServingStatus::Serving as i32);

    let mut c = engine_client(channel);
    let in_flight = tokio::spawn(async move { c.assemble(assemble("slow")).await });
    started.notified().await;
    stop.notify_one();
    assert_eq!(watch.next().await.unwrap().unwrap().status, ServingStatus::NotServing as i32);
    in_flight.await.unwrap().expect("the in-flight call finishes during the drain");
    drop(watch);
    tokio::time::timeout(Duration::from_secs(10), server).await.expect("server stops after draining").unwrap().unwrap();
}
