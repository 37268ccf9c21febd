//! Turns through the Python engine (engines/python) as a real process. The
//! Python engine also runs in the conformance, delta history, durable
//! turns, tracing and TLS tests (tests/README.md).

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use ctxgate_tests::hosting::*;

#[tokio::test]
async fn turns_run_through_the_python_engine() {
    let (_py_state, _engine, g) = python_gateway().await;
    let events = run_turn(&g, "p", "hello from a polyglot test").await;
    assert!(completed(&events), "{events:?}");
    assert_eq!(selected(&events).engine_id, "py");
    let e = engine_status(&g, "py").await;
    assert!(e.quarantine.is_none(), "{e:?}");
    g.stop().await;
}

/// The engine's `history_search` tool: ranked full-text search over every
/// message it holds for the session, an error result for bad arguments, and
/// nothing left of a session after ForgetSession.
#[tokio::test]
async fn the_python_engines_history_search_finds_held_messages_and_forgets_them() {
    use ctxgate_engine_sdk::pb;
    use ctxgate_engine_sdk::testkit::msg;
    let py_state = tempfile::tempdir().unwrap();
    let engine = ctxgate_tests::start_python(py_state.path()).await;
    let mut c = ctxgate_runtime::engine_client(ctxgate_runtime::connect(&engine.endpoint).unwrap());
    let info = c.get_info(pb::GetInfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.tools.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(), ["history_search"]);
    assert!(info.implemented_methods.iter().any(|m| m == "CallTool"), "{info:?}");
    let messages = vec![
        msg::user("h1", "the deploy key lives in vault"),
        msg::assistant("h2", "noted"),
        msg::user("h3", "rotate the deploy key on friday"),
    ];
    c.ingest_batch(pb::IngestBatchRequest { session_id: "hs".into(), messages, ..Default::default() }).await.unwrap();
    let search = async |args: &str| {
        let req = pb::CallToolRequest {
            session_id: "hs".into(),
            tool_call_id: "t1".into(),
            name: "history_search".into(),
            arguments_json: args.into(),
            ..Default::default()
        };
        let r = c.clone().call_tool(req).await.unwrap().into_inner();
        let text = r.content.iter().filter_map(|p| match &p.part {
            Some(pb::content_part::Part::Text(t)) => Some(t.as_str()),
            _ => None,
        });
        (r.is_error, text.collect::<String>())
    };
    let (is_error, text) = search(r#"{"query": "deploy key friday", "limit": 5}"#).await;
    let lines: Vec<&str> = text.lines().collect();
    assert!(!is_error && lines.len() == 2, "{text}");
    assert!(lines[0].starts_with("seq 3 (user): ") && lines[0].contains("[friday]"), "best match first: {text}");
    assert!(lines[1].starts_with("seq 1 (user): "), "{text}");
    for bad in ["not json", "{}", r#"{"query": 7}"#, r#"{"query": "key", "limit": 0}"#] {
        assert!(search(bad).await.0, "{bad} is an error result");
    }
    c.clone().forget_session(pb::ForgetSessionRequest { session_id: "hs".into(), ..Default::default() }).await.unwrap();
    let (is_error, text) = search(r#"{"query": "deploy"}"#).await;
    assert!(!is_error && text.starts_with("no message"), "forgotten: {text}");
}
