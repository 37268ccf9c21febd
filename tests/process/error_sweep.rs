//! What a client sees when things fail inside: no URL credential, no model
//! key, no SQL and no PostgreSQL message in any error, and every error with
//! an id (`ctxgate-error-id`, or "error id …" in a turn's failure) that the
//! gateway's log carries next to the detail.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::process::Stdio;

use ctxgate_proto::gateway::{self as api, turn_event::Event};
use ctxgate_tests::postgres::Postgres;
use ctxgate_tests::{EngineProcess, bin, gateway_client};
use tokio_stream::StreamExt;

/// What must never reach a client.
const SECRETS: &[&str] = &[
    "s3cret-pass",
    "sk-query-LEAK",
    "sk-key-LEAK",
    "pg-LEAK",
    "relation",
    "SELECT",
    "INSERT",
    "ERROR:",
    "db error",
    "PostgreSQL",
    "postgres://",
];

fn assert_clean(what: &str, text: &str) {
    for s in SECRETS {
        assert!(!text.contains(s), "{what} shows {s:?} to the client: {text}");
    }
}

/// The error id a status carries, checked against the log.
fn error_id(what: &str, s: &tonic::Status) -> String {
    let id = s.metadata().get("ctxgate-error-id").unwrap_or_else(|| panic!("{what}: no error id: {s:?}"));
    id.to_str().unwrap().to_owned()
}

#[tokio::test]
async fn errors_show_no_secrets_and_carry_an_id_the_log_has() {
    let pg = Postgres::start(false).await;
    pg.database("sweep").await;
    // The store URL carries a password (the test server trusts, so it is
    // ignored); the model's base URL carries a user, a password and a key
    // in its query, and points where nothing listens.
    let store_url = format!("postgres://postgres:pg-LEAK@127.0.0.1:{}/sweep", pg.port());
    let model_url = "http://user:s3cret-pass@127.0.0.1:9/v1?api-key=sk-query-LEAK";
    let dir = tempfile::tempdir().unwrap();
    let log_path = dir.path().join("gateway.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let mut cmd = tokio::process::Command::new(bin("ctxgate"));
    cmd.args(["serve", "--listen", "127.0.0.1:0"])
        .env("CTXGATE_STORE_URL", &store_url)
        .env("CTXGATE_MODEL_PROVIDER", "openai")
        .env("CTXGATE_MODEL_BASE_URL", model_url)
        .env("CTXGATE_MODEL_API_KEY", "sk-key-LEAK")
        .env("CTXGATE_MODEL", "gpt-test")
        .env_remove("CTXGATE_LOG");
    let g = EngineProcess::spawn_logging_to(cmd, Stdio::from(log)).await.unwrap();
    let client = gateway_client(&g.endpoint);
    let logged = || std::fs::read_to_string(&log_path).unwrap();
    let mut ids = Vec::new();

    // A model that cannot be reached: the turn fails with a sentence and an id.
    let req = api::RunTurnRequest {
        session: Some(api::SessionRef { agent_id: String::new(), session_key: "k".into() }),
        message: "hello".into(),
        ..Default::default()
    };
    let mut stream = client.clone().run_turn(req.clone()).await.unwrap().into_inner();
    let mut failed = None;
    while let Some(e) = stream.next().await {
        if let Some(Event::Failed(f)) = e.unwrap().event {
            failed = Some(f);
        }
    }
    let failed = failed.expect("the turn failed");
    assert_clean("a model failure", &failed.message);
    let id = failed.message.split("error id ").nth(1).and_then(|r| r.get(..16)).expect("an error id").to_owned();
    ids.push(id);

    // A request the gateway refuses: an id too.
    let nobody = api::SessionRef { agent_id: String::new(), session_key: "nobody".into() };
    let s = client.clone().get_session(nobody).await.unwrap_err();
    ids.push(error_id("an unknown session", &s));

    // The database loses its tables under the gateway: every path that
    // reads or writes them answers without a word of SQL.
    pg.sql("sweep", "DROP TABLE entries CASCADE").await;
    let sref = || Some(api::SessionRef { agent_id: String::new(), session_key: "k".into() });
    let transcript = api::GetTranscriptRequest { session: sref(), ..Default::default() };
    let s = client.clone().get_transcript(transcript).await.unwrap_err();
    assert_clean("GetTranscript", s.message());
    ids.push(error_id("GetTranscript", &s));
    let turn = async {
        let mut stream = client.clone().run_turn(req.clone()).await?.into_inner();
        while let Some(e) = stream.next().await {
            if let Some(Event::Failed(f)) = e?.event {
                return Err(tonic::Status::internal(f.message));
            }
        }
        Ok(())
    };
    let s = turn.await.unwrap_err();
    assert_clean("RunTurn", s.message());
    if s.metadata().contains_key("ctxgate-error-id") {
        ids.push(error_id("RunTurn", &s));
    }
    if let Err(s) = client.clone().preview_context(sref().unwrap()).await {
        assert_clean("PreviewContext", s.message());
        ids.push(error_id("PreviewContext", &s));
    }

    // Every id is in the log; no secret is, either, beside the ids.
    let log = logged();
    for id in &ids {
        assert!(log.contains(id), "error id {id} is not in the gateway's log:\n{log}");
    }
    for s in ["s3cret-pass", "sk-query-LEAK", "sk-key-LEAK", "pg-LEAK"] {
        assert!(!log.contains(s), "the log shows {s:?}:\n{log}");
    }
    assert!(ids.len() >= 4, "{ids:?}");
}
