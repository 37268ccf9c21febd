//! The client API's bounds: a request over `gateway.limits.maxRequestBytes`
//! is RESOURCE_EXHAUSTED (tonic alone says OUT_OF_RANGE), one under it runs,
//! and a DriveTurn message over the decode limit ends its stream so;
//! ListSessions and GetTranscript answer in bounded pages; turns over the
//! admission limit are shed with a pushback; a connection's streams over
//! its limit wait at the client.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use ctxgate::config::Config;
use ctxgate_proto::gateway as api;
use ctxgate_tests::TestGateway;
use tokio_stream::StreamExt;
use tonic::Code;

use crate::limited_gateway;

fn request(text: String) -> api::RunTurnRequest {
    api::RunTurnRequest {
        session: Some(api::SessionRef { agent_id: String::new(), session_key: "limits".into() }),
        message: text,
        ..Default::default()
    }
}

#[tokio::test]
async fn a_request_over_max_request_bytes_is_resource_exhausted_and_one_under_it_runs() {
    let g = limited_gateway(|l| l.max_request_bytes = 64 * 1024).await;
    let over = g.client.clone().run_turn(request("x".repeat(70 * 1024))).await.unwrap_err();
    assert_eq!(over.code(), Code::ResourceExhausted, "{over:?}");

    let mut stream = g.client.clone().run_turn(request("y".repeat(30 * 1024))).await.unwrap().into_inner();
    let mut last = None;
    while let Some(e) = stream.next().await {
        last = e.unwrap().event;
    }
    assert!(matches!(last, Some(api::turn_event::Event::Completed(_))), "{last:?}");
    g.stop().await;
}

#[tokio::test]
async fn a_drive_turn_message_over_the_decode_limit_ends_its_stream_resource_exhausted() {
    use ctxgate_proto::gateway::harness_request::Request as R;
    use ctxgate_tests::harness::{Drive, begin, client, text};
    let g = limited_gateway(|_| {}).await;
    let hc = client(&g.endpoint);
    let mut d = Drive::admitted(&hc, begin("big", "hello")).await;
    // 20 MiB: over the harness service's 16 MiB decode limit.
    let huge = text(ctxgate_proto::pb::Role::Assistant, &"x".repeat(20 * 1024 * 1024));
    d.send(R::Append(api::Append { messages: vec![huge] })).await;
    let status = d.status().await;
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    // The turn was lost, nothing else: the session takes the next one.
    let mut next = Drive::admitted(&hc, begin("big", "again")).await;
    next.append(vec![text(ctxgate_proto::pb::Role::Assistant, "a normal answer")]).await.unwrap();
    next.end(api::TurnOutcome::Accepted).await.unwrap();
    g.stop().await;
}

#[test]
fn limits_that_cannot_work_are_refused_with_their_key() {
    for (json, key) in [
        ("{ gateway: { limits: { maxRequestBytes: 10 } } }", "gateway.limits.maxRequestBytes"),
        (
            "{ gateway: { limits: { maxConcurrentStreamsPerConnection: 0 } } }",
            "gateway.limits.maxConcurrentStreamsPerConnection",
        ),
        ("{ gateway: { limits: { http2KeepaliveSeconds: 0 } } }", "gateway.limits.http2KeepaliveSeconds"),
        (
            "{ gateway: { limits: { adaptiveConcurrency: { tolerance: 0.5 } } } }",
            "gateway.limits.adaptiveConcurrency.tolerance",
        ),
        (
            "{ gateway: { limits: { adaptiveConcurrency: { minLimit: 0 } } } }",
            "gateway.limits.adaptiveConcurrency.minLimit",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("c.json5");
        std::fs::write(&file, json).unwrap();
        let err = Config::load(Some(&file), |_| None).unwrap_err().to_string();
        assert!(err.contains(key), "{json}: {err}");
    }
}

async fn run(g: &TestGateway, key: &str, text: &str) {
    let mut r = request(text.into());
    r.session = Some(api::SessionRef { agent_id: String::new(), session_key: key.into() });
    let mut stream = g.client.clone().run_turn(r).await.unwrap().into_inner();
    while stream.next().await.is_some() {}
}

#[tokio::test]
async fn sessions_and_transcripts_come_in_bounded_pages_that_add_up() {
    let g = TestGateway::start(Config::default()).await;
    for i in 0..5 {
        run(&g, &format!("page-{i}"), "hello").await;
    }
    for i in 0..2 {
        run(&g, "page-0", &format!("more {i}")).await;
    }
    let mut keys = Vec::new();
    let mut token = String::new();
    let mut pages = 0;
    loop {
        let req = api::ListSessionsRequest { page_size: 2, page_token: token, ..Default::default() };
        let page = g.client.clone().list_sessions(req).await.unwrap().into_inner();
        assert!(page.sessions.len() <= 2);
        keys.extend(page.sessions.into_iter().map(|s| s.session_key));
        pages += 1;
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    assert_eq!(keys, (0..5).map(|i| format!("page-{i}")).collect::<Vec<_>>());
    assert_eq!(pages, 3);

    let session = Some(api::SessionRef { agent_id: String::new(), session_key: "page-0".into() });
    let whole = api::GetTranscriptRequest { session: session.clone(), ..Default::default() };
    let all = g.client.clone().get_transcript(whole).await.unwrap().into_inner();
    assert_eq!((all.entries.len(), all.next_page_token.as_str()), (6, ""));
    let mut ids = Vec::new();
    let mut token = String::new();
    loop {
        let req = api::GetTranscriptRequest {
            session: session.clone(),
            page_size: 4,
            page_token: token,
            ..Default::default()
        };
        let page = g.client.clone().get_transcript(req).await.unwrap().into_inner();
        ids.extend(page.entries.into_iter().map(|e| e.id));
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    assert_eq!(ids, all.entries.iter().map(|e| e.id.clone()).collect::<Vec<_>>());

    let bad = api::GetTranscriptRequest { session, page_token: "nope".into(), ..Default::default() };
    let e = g.client.clone().get_transcript(bad).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().starts_with("page_token:"), "{}", e.message());
    let bad = api::ListSessionsRequest { page_token: "x".into(), ..Default::default() };
    assert_eq!(g.client.clone().list_sessions(bad).await.unwrap_err().code(), Code::InvalidArgument);
    g.stop().await;
}

/// A RunTurn to its end; `Err` with the status that ended it.
async fn turn_status(g: &TestGateway, r: api::RunTurnRequest) -> Result<Vec<api::TurnEvent>, tonic::Status> {
    let mut s = g.client.clone().run_turn(r).await?.into_inner();
    let mut events = Vec::new();
    while let Some(e) = s.next().await {
        events.push(e?);
    }
    Ok(events)
}

#[tokio::test]
async fn turns_over_max_concurrent_turns_are_shed_at_once_with_a_pushback() {
    use ctxgate_proto::gateway::TurnOutcome;
    use ctxgate_proto::pb::Role;
    use ctxgate_tests::harness::{Drive, begin, client, text};
    let mut config = Config::default();
    config.gateway.limits.max_concurrent_turns = 1;
    config.gateway.metrics_listen = "127.0.0.1:0".into();
    let g = TestGateway::start(config).await;
    let hc = client(&g.endpoint);
    let mut held = Drive::admitted(&hc, begin("holder", "hold the only slot")).await;

    let shed = turn_status(&g, request("another session".into())).await.unwrap_err();
    assert_eq!(shed.code(), Code::ResourceExhausted, "{shed:?}");
    assert!(shed.message().contains("limit of 1 open turns (gateway.limits.maxConcurrentTurns)"), "{}", shed.message());
    assert_eq!(shed.metadata().get("grpc-retry-pushback-ms").and_then(|v| v.to_str().ok()), Some("100"));
    let metrics = ctxgate_tests::metrics_text(g.metrics.unwrap()).await;
    assert!(metrics.contains("ctxgate_turns_shed_total 1"), "{metrics}");
    // The store's group commit is visible: writes, and the commits holding them.
    let value = |name: &str| -> u64 {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("{name}: {metrics}"))
    };
    let (commits, writes) = (value("ctxgate_store_commits_total"), value("ctxgate_store_writes_total"));
    assert!(commits >= 1 && writes >= commits, "{commits} commits, {writes} writes");

    held.append(vec![text(Role::Assistant, "done")]).await.unwrap();
    held.end(TurnOutcome::Accepted).await.unwrap();
    // The holder's permit goes with its turn, a moment after its stream
    // ended: a client honouring the pushback gets in.
    let mut tries = 0;
    loop {
        match turn_status(&g, request("now there is room".into())).await {
            Ok(_) => break,
            Err(e) if e.code() == Code::ResourceExhausted && tries < 100 => tries += 1,
            Err(e) => panic!("{e:?}"),
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let t = g
        .client
        .clone()
        .get_transcript(api::GetTranscriptRequest {
            session: Some(api::SessionRef { agent_id: String::new(), session_key: "limits".into() }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(t.entries.len(), 2, "the shed turn left nothing; the next one ran");
    g.stop().await;
}

#[tokio::test]
async fn streams_over_the_per_connection_limit_wait_at_the_client_and_other_connections_go_on() {
    use ctxgate_proto::gateway::{TurnOutcome, gateway_client::GatewayClient, harness_client::HarnessClient};
    use ctxgate_proto::pb::Role;
    use ctxgate_tests::harness::{Drive, begin, text};
    use std::time::Duration;
    let g = limited_gateway(|l| l.max_concurrent_streams_per_connection = 2).await;
    // One HTTP/2 connection with two harness turns held open on it.
    let one = tonic::transport::Endpoint::from_shared(g.endpoint.clone()).unwrap().connect().await.unwrap();
    let hc = HarnessClient::new(one.clone());
    let mut a = Drive::admitted(&hc, begin("a", "hold")).await;
    let mut b = Drive::admitted(&hc, begin("b", "hold")).await;

    // A third stream on that connection is not opened (the server's
    // SETTINGS_MAX_CONCURRENT_STREAMS): it waits, and nothing is stored.
    let third = tokio::spawn(async move {
        let mut r = request("third".into());
        r.session = Some(api::SessionRef { agent_id: String::new(), session_key: "c".into() });
        let mut s = GatewayClient::new(one).run_turn(r).await?.into_inner();
        let mut last = None;
        while let Some(e) = s.next().await {
            last = e?.event;
        }
        Ok::<_, tonic::Status>(last)
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!third.is_finished(), "a third stream ran on a connection limited to 2");
    // Another connection is served meanwhile.
    run(&g, "d", "other connection").await;
    let d = api::GetTranscriptRequest { session: Some(ctxgate_tests::hosting::sref("d")), ..Default::default() };
    assert_eq!(g.client.clone().get_transcript(d).await.unwrap().into_inner().entries.len(), 2);
    assert!(!third.is_finished());

    // One held turn ends: the waiting stream opens and its turn completes.
    a.append(vec![text(Role::Assistant, "done")]).await.unwrap();
    a.end(TurnOutcome::Accepted).await.unwrap();
    drop(a);
    let last = tokio::time::timeout(Duration::from_secs(10), third).await.unwrap().unwrap().unwrap();
    assert!(matches!(last, Some(api::turn_event::Event::Completed(_))), "{last:?}");
    b.end(TurnOutcome::Aborted).await.unwrap();
    g.stop().await;
}

/// A burst the gateway drains is never refused, on a fresh gateway that has
/// measured nothing yet: 64 RunTurns and 50 DriveTurn streams opened at
/// once (each on its own session), all admitted and completed.
#[tokio::test]
async fn bursts_of_run_turns_and_drive_turns_at_once_on_a_fresh_gateway_are_never_refused() {
    use ctxgate_proto::gateway::TurnOutcome;
    use ctxgate_proto::pb::Role;
    use ctxgate_tests::harness::{Drive, begin, client, text};
    let g = TestGateway::start(Config::default()).await;
    let runs = (0..64).map(|i| {
        let r = api::RunTurnRequest {
            session: Some(api::SessionRef { agent_id: String::new(), session_key: format!("burst-{i}") }),
            message: "hello".into(),
            ..Default::default()
        };
        turn_status(&g, r)
    });
    let refused: Vec<_> = futures_util::future::join_all(runs).await.into_iter().filter_map(Result::err).collect();
    assert!(refused.is_empty(), "{} of 64 RunTurns refused: {:?}", refused.len(), refused.first());

    let fresh = TestGateway::start(Config::default()).await;
    let hc = client(&fresh.endpoint);
    let drives = (0..50).map(|i| {
        let hc = hc.clone();
        async move {
            let mut d = Drive::open(&hc, begin(&format!("drive-{i}"), "hello")).await?;
            d.context().await?;
            d.append(vec![text(Role::Assistant, "done")]).await?;
            d.end(TurnOutcome::Accepted).await
        }
    });
    let refused: Vec<_> = futures_util::future::join_all(drives).await.into_iter().filter_map(Result::err).collect();
    assert!(refused.is_empty(), "{} of 50 DriveTurn streams refused: {:?}", refused.len(), refused.first());
    g.stop().await;
    fresh.stop().await;
}

/// Turns waiting to start are bounded: past `maxWaitingTurns` (here 2, all
/// waiting behind one session's running turn) a turn is refused at once,
/// naming the limit; a waiting turn that starts frees its place.
#[tokio::test]
async fn waiting_turns_past_max_waiting_turns_are_refused_naming_the_limit() {
    use ctxgate_proto::gateway::TurnOutcome;
    use ctxgate_proto::pb::Role;
    use ctxgate_tests::harness::{Drive, begin, client, text};
    let g = limited_gateway(|l| l.max_waiting_turns = 2).await;
    let hc = client(&g.endpoint);
    let mut holder = Drive::admitted(&hc, begin("limits", "hold the session")).await;
    let waiting: Vec<_> = (0..2).map(|i| tokio::spawn(turn_status_owned(g.client.clone(), i))).collect();
    // Both wait behind the holder (the status counts them); the third finds
    // two waiting.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while g.client.clone().get_status(api::StatusRequest {}).await.unwrap().into_inner().turns_queued < 2 {
        assert!(std::time::Instant::now() < deadline, "the two turns never waited behind the holder");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let refused = turn_status(&g, request("a third".into())).await.unwrap_err();
    assert!(refused.message().contains("2 turns waiting to start (gateway.limits.maxWaitingTurns)"), "{refused:?}");
    assert_eq!(refused.code(), Code::ResourceExhausted);
    assert!(refused.metadata().get("grpc-retry-pushback-ms").is_some());
    holder.append(vec![text(Role::Assistant, "done")]).await.unwrap();
    holder.end(TurnOutcome::Accepted).await.unwrap();
    for w in waiting {
        assert!(w.await.unwrap().is_ok(), "the waiting turns ran");
    }
    g.stop().await;
}

async fn turn_status_owned(
    mut c: api::gateway_client::GatewayClient<tonic::transport::Channel>,
    i: usize,
) -> Result<Vec<api::TurnEvent>, tonic::Status> {
    let mut s = c.run_turn(request(format!("waits {i}"))).await?.into_inner();
    let mut events = Vec::new();
    while let Some(e) = s.next().await {
        events.push(e?);
    }
    Ok(events)
}

/// A client that makes the server reset stream after stream — each one
/// opened with a malformed request (no `:path`), a stream error the server
/// answers with RST_STREAM — loses its connection (GOAWAY,
/// ENHANCE_YOUR_CALM) after h2's 1,024, instead of costing the gateway
/// work for ever. Raw HTTP/2 frames over TCP: no client library sends a
/// broken request.
#[tokio::test]
async fn a_connection_that_makes_the_server_reset_stream_after_stream_is_closed() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let g = TestGateway::start(Config::default()).await;
    let addr = g.endpoint.trim_start_matches("http://").to_owned();
    let tcp = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let (mut rx, mut tx) = tcp.into_split();
    let frame = |kind: u8, flags: u8, stream: u32, payload: &[u8]| {
        let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
        f.extend([kind, flags]);
        f.extend(stream.to_be_bytes());
        f.extend(payload);
        f
    };
    // HPACK: :method POST, :scheme http, :authority, content-type, te; no :path.
    let literal = |s: &str| [&[s.len() as u8][..], s.as_bytes()].concat();
    let headers = [
        vec![0x83, 0x86, 0x01],
        literal("localhost"),
        vec![0x0f, 0x10],
        literal("application/grpc"),
        vec![0x00],
        literal("te"),
        literal("trailers"),
    ]
    .concat();
    let writer = tokio::spawn(async move {
        let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        out.extend(frame(0x4, 0, 0, &[]));
        for i in 0..2_000u32 {
            let stream = 1 + 2 * i;
            out.extend(frame(0x1, 0x5, stream, &headers)); // HEADERS, END_STREAM | END_HEADERS
            if i % 50 == 49 && tx.write_all(&std::mem::take(&mut out)).await.is_err() {
                return i;
            }
        }
        let _ = tx.write_all(&out).await;
        2_000
    });
    // Read frames until GOAWAY (or the connection ends); count the resets.
    let (mut resets, mut goaway) = (0, None);
    let read = async {
        let mut head = [0u8; 9];
        while rx.read_exact(&mut head).await.is_ok() {
            let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
            let mut payload = vec![0u8; len];
            if rx.read_exact(&mut payload).await.is_err() {
                break;
            }
            match head[3] {
                0x3 => resets += 1,
                0x7 if len >= 8 => {
                    goaway = Some(u32::from_be_bytes([payload[4], payload[5], payload[6], payload[7]]));
                    break;
                }
                _ => {}
            }
        }
    };
    let _ = tokio::time::timeout(std::time::Duration::from_secs(20), read).await;
    writer.abort();
    assert_eq!(goaway, Some(0xb), "GOAWAY with ENHANCE_YOUR_CALM after {resets} resets");
    assert!(resets <= 1_024, "h2's cap, 1,024: {resets} resets before the GOAWAY");
    g.stop().await;
}

/// A connection that sends `P` (or anything short of the HTTP/2 preface
/// and its SETTINGS) and waits is pending, not established: with room for
/// 64 established connections, 200 of them neither take that room nor keep
/// a new client out, and none outlives `handshakeTimeoutSeconds`.
#[tokio::test]
async fn connections_that_send_a_byte_and_wait_do_not_take_a_clients_place() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut config = Config::default();
    let c = &mut config.gateway.limits.connections;
    (c.open_per_peer, c.open_total, c.handshake_timeout_seconds) = (64, 64, 2.0);
    let g = TestGateway::start(config).await;
    let addr = g.endpoint.trim_start_matches("http://").to_owned();
    let mut waiting = Vec::new();
    for _ in 0..200 {
        let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
        s.write_all(b"P").await.unwrap();
        waiting.push(s);
    }
    let turn = tokio::time::timeout(std::time::Duration::from_secs(10), turn_status(&g, request("hello".into())));
    turn.await.expect("the client's turn did not end in 10 s").expect("the client was refused");
    // The last of them (never evicted) is closed once it has waited its timeout.
    let last = waiting.last_mut().unwrap();
    let read = tokio::time::timeout(std::time::Duration::from_secs(10), last.read(&mut [0u8; 1])).await;
    assert!(matches!(read, Ok(Ok(0) | Err(_))), "a connection that sent only `P` was not closed: {read:?}");
    g.stop().await;
}

/// The metrics listener bounds its peers too: a request header that never
/// ends is cut after `handshakeTimeoutSeconds`, and a scrape still works.
#[tokio::test]
async fn a_metrics_request_whose_header_never_ends_is_closed() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut config = Config::default();
    config.gateway.metrics_listen = "127.0.0.1:0".into();
    config.gateway.limits.connections.handshake_timeout_seconds = 1.0;
    let g = TestGateway::start(config).await;
    let metrics = g.metrics.expect("the metrics listener");
    let mut slow = tokio::net::TcpStream::connect(metrics).await.unwrap();
    slow.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n").await.unwrap();
    let started = std::time::Instant::now();
    let mut answer = Vec::new();
    let read = tokio::time::timeout(std::time::Duration::from_secs(10), slow.read_to_end(&mut answer)).await;
    assert!(read.is_ok(), "a header that never ends kept its connection 10 s");
    assert!(started.elapsed() >= std::time::Duration::from_millis(500), "closed before its timeout");
    let text = ctxgate_tests::metrics_text(metrics).await;
    assert!(text.starts_with("HTTP/1.") && text.contains("ctxgate_"), "{text}");
    g.stop().await;
}
