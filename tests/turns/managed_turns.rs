//! Managed turns through the real gateway (`server::run` in-process, real
//! gRPC, real SQLite) against a local OpenAI-compatible server: cancel and
//! abort, bad input, auth and metrics, a client that stops reading. The
//! helpers here serve compaction.rs too.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::time::{Duration, Instant};

use ctxgate::config::{Config, ProviderKind};
use ctxgate_proto::gateway::{self as api, turn_event::Event};
use ctxgate_proto::pb::transcript_entry::Entry;
use ctxgate_tests::fake_openai::{FakeOpenAi, Kind, Reply};
use ctxgate_tests::hosting::{attached, engine_status, fault_engine, hosting, session, turn_request};
use ctxgate_tests::{PATIENCE, TestGateway, metrics_text, within};
use tokio_stream::StreamExt;
use tonic::Code;

pub(crate) fn openai_config(fake: &FakeOpenAi) -> Config {
    let mut c = Config::default();
    c.models.provider = ProviderKind::Openai;
    c.models.base_url = fake.base_url.clone();
    c.models.model = "gpt-test".into();
    c.models.context_window = 4_000;
    c.models.max_output_tokens = 256;
    c.agents.defaults.compaction.reserve_tokens = Some(500);
    c.agents.defaults.compaction.keep_recent_tokens = 300;
    c
}

/// [`openai_config`] that also selects engine `id` at `endpoint`.
pub(crate) fn openai_hosting(fake: &FakeOpenAi, id: &str, endpoint: &str) -> Config {
    let mut c = openai_config(fake);
    c.plugins = hosting(id, endpoint, &[]).plugins;
    c
}

/// A gateway on `config` whose session "s" already has `turns` turns
/// ([`seed`]).
pub(crate) async fn seeded(config: Config, turns: usize) -> TestGateway {
    let g = TestGateway::start(config).await;
    seed(&g, "s", turns).await;
    g
}

pub(crate) async fn run_turn(g: &TestGateway, key: &str, text: &str) -> Result<Vec<Event>, tonic::Status> {
    let req = turn_request(key, text);
    within(PATIENCE, format!("the turn {text:?} on {key:?} ending"), async {
        let mut stream = g.client.clone().run_turn(req).await?.into_inner();
        let mut events = Vec::new();
        while let Some(e) = stream.next().await {
            events.push(e?.event.unwrap());
        }
        Ok(events)
    })
    .await
}

/// `n` turns of about 100 tokens each, mentioning `file_<i>.rs`.
pub(crate) async fn seed(g: &TestGateway, key: &str, n: usize) {
    for i in 0..n {
        let events = run_turn(g, key, &format!("Turn {i}: please look at file_{i}.rs. {}", "context ".repeat(45)))
            .await
            .unwrap();
        assert!(matches!(events.last(), Some(Event::Completed(_))), "{events:?}");
    }
}

pub(crate) async fn branch(g: &TestGateway, key: &str) -> Vec<ctxgate_proto::pb::TranscriptEntry> {
    let req = api::GetTranscriptRequest { session: session(key), visible_only: false, ..Default::default() };
    g.client.clone().get_transcript(req).await.unwrap().into_inner().entries
}

#[tokio::test]
async fn a_client_cancel_mid_turn_stops_the_model_call_and_keeps_the_transcript_consistent() {
    let fake = FakeOpenAi::start().await;
    let g = seeded(openai_config(&fake), 1).await;
    fake.turns([Reply::Hang("thinking".into())]);

    let mut stream = g.client.clone().run_turn(turn_request("s", "a slow question")).await.unwrap().into_inner();
    while let Some(e) = stream.next().await {
        if matches!(e.unwrap().event, Some(Event::ModelDelta(_))) {
            break;
        }
    }
    drop(stream);
    assert!(fake.wait_disconnect(Duration::from_secs(10)).await, "the model call was cancelled");

    // The admitted message stays; no partial reply is stored; the session is free.
    let events = run_turn(&g, "s", "next question").await.unwrap();
    assert!(matches!(events.last(), Some(Event::Completed(_))), "{events:?}");
    let texts: Vec<String> = branch(&g, "s")
        .await
        .iter()
        .filter_map(|e| {
            if let Some(Entry::Message(m)) = &e.entry { Some(ctxgate::provider::message_text(m)) } else { None }
        })
        .collect();
    assert_eq!(&texts[2..], ["a slow question", "next question", "ok"]);
    g.stop().await;
}

#[tokio::test]
async fn abort_stops_a_running_turn_without_blaming_anyone() {
    // A remote engine holds the turn (its Assemble never answers): the
    // abort must reach it as a cancel, and an abort is never its fault.
    let fake = FakeOpenAi::start().await;
    let engine = fault_engine("hang").await;
    let g = TestGateway::start(openai_hosting(&fake, "fault", &engine.endpoint)).await;
    attached(&g, "fault").await;
    let mut stream = g.client.clone().run_turn(turn_request("a", "long task")).await.unwrap().into_inner();
    // The engine itself holds the call (the gateway counting it in flight
    // is not enough: an abort before the request arrives is no cancel there).
    assert!(engine.wait_line("event assemble", PATIENCE).await.is_some(), "the engine got the turn's Assemble");
    let aborted = g.client.clone().abort(api::AbortRequest { session: session("a") }).await.unwrap().into_inner();
    assert!(aborted.aborted);
    let last = within(PATIENCE, "the aborted turn's stream ending", async {
        let mut last = None;
        while let Some(e) = stream.next().await {
            last = e.unwrap().event;
        }
        last
    })
    .await;
    assert!(matches!(last, Some(Event::Failed(ref f)) if f.reason == "aborted"), "{last:?}");
    assert!(engine.wait_line("event cancelled Assemble", PATIENCE).await.is_some(), "the engine saw the cancel");
    let e = engine_status(&g, "fault").await;
    assert_eq!(e.quarantine, None, "an abort blames no one: {e:?}");
    assert_eq!(fake.count(Kind::Turn), 0, "the model was never called");
    let nothing = g.client.clone().abort(api::AbortRequest { session: session("a") }).await.unwrap().into_inner();
    assert!(!nothing.aborted, "nothing runs any more");
    g.stop().await;
}

#[tokio::test]
async fn bad_input_gets_clear_errors() {
    let g = TestGateway::start(Config::default()).await;
    let mut c = g.client.clone();
    let e = c.run_turn(turn_request("s", "   ")).await.err().unwrap();
    assert_eq!((e.code(), e.message()), (Code::InvalidArgument, "message: is empty"));
    let e = c.run_turn(turn_request("", "hi")).await.err().unwrap();
    assert_eq!((e.code(), e.message()), (Code::InvalidArgument, "session.session_key: is required"));
    // A key that would forge a log line (or move a terminal's cursor).
    for key in ["s\n2026-12-07T00:00:00Z  INFO ctxgate: forged", "s\u{1b}[2J"] {
        let e = c.run_turn(turn_request(key, "hi")).await.err().unwrap();
        assert_eq!(
            (e.code(), e.message()),
            (Code::InvalidArgument, "session.session_key: contains a control character")
        );
    }
    let mut agent = turn_request("s", "hi");
    agent.session.as_mut().unwrap().agent_id = "a\rb".into();
    let e = c.run_turn(agent).await.err().unwrap();
    assert_eq!((e.code(), e.message()), (Code::InvalidArgument, "session.agent_id: contains a control character"));
    let e = c
        .run_turn(turn_request("s", "x".repeat(ctxgate_proto::limits::MAX_MESSAGE_CONTENT_BYTES + 1)))
        .await
        .err()
        .unwrap();
    assert_eq!(e.code(), Code::ResourceExhausted);
    assert!(e.message().starts_with("message: is"), "{}", e.message());
    let e = c.get_session(api::SessionRef { agent_id: String::new(), session_key: "nope".into() }).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    let e = c
        .compact(api::CompactSessionRequest { session: session("nope"), custom_instructions: None })
        .await
        .err()
        .unwrap();
    assert_eq!(e.code(), Code::NotFound);
    let e =
        c.delete_session(api::SessionRef { agent_id: String::new(), session_key: "nope".into() }).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    // None of that created anything.
    assert!(c.list_sessions(api::ListSessionsRequest::default()).await.unwrap().into_inner().sessions.is_empty());
    g.stop().await;
}

#[tokio::test]
async fn a_configured_token_is_required_and_metrics_count_turns() {
    let mut config = Config::default();
    config.gateway.auth.token = Some("s3cret-s3cret-s3cret".into());
    config.gateway.metrics_listen = "127.0.0.1:0".into();
    let g = TestGateway::start(config).await;
    let e = run_turn(&g, "s", "hi").await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);

    let channel = tonic::transport::Endpoint::from_shared(g.endpoint.clone()).unwrap().connect().await.unwrap();
    let token: tonic::metadata::MetadataValue<_> = "Bearer s3cret-s3cret-s3cret".parse().unwrap();
    let mut c = api::gateway_client::GatewayClient::with_interceptor(channel, move |mut r: tonic::Request<()>| {
        r.metadata_mut().insert("authorization", token.clone());
        Ok(r)
    });
    let events: Vec<_> =
        c.run_turn(turn_request("s", "hi")).await.unwrap().into_inner().collect::<Result<_, _>>().await.unwrap();
    assert!(matches!(events.last().and_then(|e| e.event.as_ref()), Some(Event::Completed(_))));

    let metrics = metrics_text(g.metrics.unwrap()).await;
    assert!(metrics.contains("ctxgate_turns_total{outcome=\"completed\"} 1"), "{metrics}");
    assert!(metrics.contains("ctxgate_turn_duration_seconds_count 1"), "{metrics}");
    g.stop().await;
}

#[tokio::test]
async fn a_client_that_stops_reading_slows_only_its_own_stream() {
    let fake = FakeOpenAi::start().await;
    let g = TestGateway::start(openai_config(&fake)).await;
    let long: String = (0..20_000).map(|i| format!("w{i} ")).collect();
    fake.turns([Reply::Text(long.clone())]);
    let req = api::RunTurnRequest {
        session: session("slow"),
        message: "talk a lot".into(),
        system_prompt: None,
        ..Default::default()
    };
    let mut slow = g.client.clone().run_turn(req).await.unwrap().into_inner();
    assert!(matches!(slow.next().await.unwrap().unwrap().event, Some(Event::Admitted(_))));

    // The client reads nothing more, yet its turn finishes on the gateway
    // (20 000 streamed words do not fit any buffer on the way) ...
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let s = g.client.clone().get_status(api::StatusRequest {}).await.unwrap().into_inner();
        if s.turns_in_flight == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "a client that does not read holds its turn");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // ... and other sessions are served meanwhile.
    let events = run_turn(&g, "other", "hello").await.unwrap();
    assert!(matches!(events.last(), Some(Event::Completed(_))), "{events:?}");

    // Reading now: every word arrives, in order, merged while the client was behind.
    let mut text = String::new();
    let (mut deltas, mut last) = (0, None);
    while let Some(e) = slow.next().await {
        match e.unwrap().event.unwrap() {
            Event::ModelDelta(d) => {
                deltas += 1;
                text.push_str(&d.text);
            }
            other => last = Some(other),
        }
    }
    assert_eq!(text, long, "no streamed text is lost");
    assert!(deltas < 20_000, "deltas were merged while the client was behind ({deltas})");
    let Some(Event::Completed(done)) = last else { panic!("{last:?}") };
    assert_eq!(done.text, long);
    g.stop().await;
}
