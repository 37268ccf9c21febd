//! Engine tools across the process boundary: declarations checked at
//! attach, `call_tool` from a harness turn (its result stored as the call's
//! answer), the managed tool loop, deadlines, aborts and quarantine — none
//! of which fails a turn or quarantines an engine by itself — and the
//! strict `onFailure: fail` policy.

use std::time::Duration;

use ctxgate::config::OnFailure;
use ctxgate_proto::gateway::{self as api, harness_event::Event as H};
use ctxgate_proto::pb::{Role, content_part::Part, transcript_entry::Entry};
use ctxgate_tests::harness::{Drive, begin, client, text, tool_call};
use ctxgate_tests::hosting::{
    engine_status, fault_engine, fault_gateway, fault_gateway_with, hosting, quarantine_of, session, signal,
    transcript, wait_engine,
};
use ctxgate_tests::{PATIENCE, TestGateway};
use tokio_stream::StreamExt;
use tonic::Code;

/// The result text of a tool message.
fn result_text(r: &api::ToolResult) -> (String, bool) {
    let m = r.message.as_ref().expect("the tool message");
    assert_eq!(m.role, Role::Tool as i32);
    match m.content.first().and_then(|p| p.part.as_ref()) {
        Some(Part::ToolResult(t)) => (t.text.clone(), t.is_error),
        other => panic!("a tool result part, not {other:?}"),
    }
}

#[tokio::test]
async fn a_harness_runs_an_engine_tool_and_the_result_answers_the_call_once() {
    let (engine, g) = fault_gateway("tools").await;
    let hc = client(&g.endpoint);
    let mut d = Drive::open(&hc, begin("t", "use the echo tool")).await.unwrap();
    let ctx = d.context().await.unwrap();
    let names: Vec<&str> = ctx.engine_tools.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["echo", "hang_tool", "fail_tool"], "the engine's tools are offered");
    d.append(vec![tool_call("c1", "echo", r#"{"say":"hi"}"#)]).await.unwrap();
    let r = d.call_tool("c1").await.unwrap();
    assert_eq!(result_text(&r), ("echo: {\"say\":\"hi\"}".to_owned(), false));
    assert!(engine.wait_line("event tool echo {\"say\":\"hi\"}", PATIENCE).await.is_some());
    // The next context holds the call and its answer, in order.
    let next = d.assemble(vec![]).await.unwrap();
    let tail: Vec<i32> = next.messages.iter().rev().take(2).rev().map(|m| m.role).collect();
    assert_eq!(tail, [Role::Assistant as i32, Role::Tool as i32]);
    d.append(vec![text(Role::Assistant, "done")]).await.unwrap();
    d.end(api::TurnOutcome::Accepted).await.unwrap();
    let entries = transcript(&g.client, "t").await;
    let answers =
        entries.iter().filter(|e| matches!(&e.entry, Some(Entry::Message(m)) if m.role == Role::Tool as i32)).count();
    assert_eq!(answers, 1, "one result, stored once");
    assert_eq!(r.entry_id, entries[2].id, "the result follows its call");
    g.stop().await;
}

#[tokio::test]
async fn bad_call_tool_requests_are_refused_and_store_nothing() {
    let (_engine, g) = fault_gateway("tools").await;
    let hc = client(&g.endpoint);
    // A harness tool that has an engine tool's name wins: the engine's is
    // not offered in that turn (an engine cannot break a harness's turns
    // by naming its tools), and the turn says so.
    let mut b = begin("shadow", "hi");
    b.available_tools = vec!["echo".into()];
    let mut d = Drive::open(&hc, b).await.unwrap();
    let context = d.context().await.unwrap();
    assert!(!context.engine_tools.iter().any(|t| t.name == "echo"), "{:?}", context.engine_tools);
    let warned = d
        .seen
        .iter()
        .any(|e| matches!(e, H::Warning(w) if w.message.contains("\"fault\"'s tools [\"echo\"] are not offered")));
    assert!(warned, "{:?}", d.seen);
    d.append(vec![tool_call("s1", "echo", "{}")]).await.unwrap();
    let s = d.call_tool("s1").await.unwrap_err();
    assert_eq!(s.code(), Code::FailedPrecondition, "the harness's echo, run by the harness: {s:?}");
    assert!(s.message().contains("the harness runs its own tools"), "{s:?}");
    drop(d);

    let mut b = begin("bad", "hi");
    b.available_tools = vec!["read_file".into()];
    let mut d = Drive::open(&hc, b).await.unwrap();
    d.context().await.unwrap();
    // Not a tool call of this turn.
    let s = d.call_tool("nope").await.unwrap_err();
    assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");
    assert!(s.message().starts_with("call_tool.tool_call_id:"), "{s:?}");
    let mut d = Drive::open(&hc, begin("bad", "again")).await.unwrap();
    d.context().await.unwrap();
    // A harness tool: the harness runs it itself.
    d.append(vec![tool_call("h1", "read_file", "{}")]).await.unwrap();
    let s = d.call_tool("h1").await.unwrap_err();
    assert_eq!(s.code(), Code::FailedPrecondition, "{s:?}");
    let mut d = Drive::open(&hc, begin("bad", "twice")).await.unwrap();
    d.context().await.unwrap();
    d.append(vec![tool_call("e1", "echo", "{}")]).await.unwrap();
    d.call_tool("e1").await.unwrap();
    let s = d.call_tool("e1").await.unwrap_err();
    assert_eq!(s.code(), Code::FailedPrecondition, "{s:?}");
    assert!(s.message().contains("already has a result"), "{s:?}");
    // Arguments that are not JSON: an error result for the model, no engine call.
    let mut d = Drive::open(&hc, begin("bad", "garbled")).await.unwrap();
    d.context().await.unwrap();
    d.append(vec![tool_call("g1", "echo", "{not json")]).await.unwrap();
    let (text, is_error) = result_text(&d.call_tool("g1").await.unwrap());
    assert!(is_error && text.contains("not JSON"), "{text}");
    d.end(api::TurnOutcome::Aborted).await.unwrap();
    // The refused steps left nothing: every refused stream's turn was aborted.
    let tools = transcript(&g.client, "bad")
        .await
        .into_iter()
        .filter(|e| matches!(&e.entry, Some(Entry::Message(m)) if m.role == Role::Tool as i32))
        .count();
    assert_eq!(tools, 0, "no tool result stayed on the branch");
    assert_eq!(engine_status(&g, "fault").await.quarantine, None);
    g.stop().await;
}

#[tokio::test]
async fn a_hanging_tool_is_cut_at_its_deadline_and_the_model_reads_an_error() {
    let (engine, g) = fault_gateway_with("tools", &[("callTool", 0.5)]).await;
    let hc = client(&g.endpoint);
    let mut d = Drive::open(&hc, begin("h", "wait")).await.unwrap();
    d.context().await.unwrap();
    d.append(vec![tool_call("c1", "hang_tool", "{}")]).await.unwrap();
    let started = std::time::Instant::now();
    let (said, is_error) = result_text(&d.call_tool("c1").await.unwrap());
    let took = started.elapsed();
    assert!(is_error && said.contains("did not answer within"), "{said}");
    assert!((Duration::from_millis(450)..Duration::from_secs(5)).contains(&took), "cut after {took:?}");
    assert!(engine.wait_line("event cancelled CallTool", PATIENCE).await.is_some(), "the engine saw the cancel");
    // A failing tool is an error result too; neither quarantines.
    d.append(vec![tool_call("c2", "fail_tool", "{}")]).await.unwrap();
    let (said, is_error) = result_text(&d.call_tool("c2").await.unwrap());
    assert!(is_error && said.contains("fail_tool failed"), "{said}");
    assert!(!said.contains("the tool broke"), "engine internals stay in the engine: {said}");
    d.append(vec![text(Role::Assistant, "ok")]).await.unwrap();
    assert!(d.end(api::TurnOutcome::Accepted).await.is_ok());
    assert_eq!(engine_status(&g, "fault").await.quarantine, None, "a tool's trouble is not the engine's");
    g.stop().await;
}

#[tokio::test]
async fn an_aborted_turn_cancels_its_tool_call_at_the_engine() {
    let (engine, g) = fault_gateway("tools").await;
    let hc = client(&g.endpoint);
    let mut d = Drive::open(&hc, begin("a", "wait")).await.unwrap();
    d.context().await.unwrap();
    d.append(vec![tool_call("c1", "hang_tool", "{}")]).await.unwrap();
    d.send(ctxgate_proto::gateway::harness_request::Request::CallTool(api::CallTool { tool_call_id: "c1".into() }))
        .await;
    wait_engine(&g, "fault", "running the tool", |e| e.replicas.iter().any(|r| r.in_flight > 0)).await;
    let aborted = g.client.clone().abort(api::AbortRequest { session: session("a") }).await.unwrap();
    assert!(aborted.into_inner().aborted);
    assert_eq!(d.status().await.code(), Code::Cancelled);
    assert!(engine.wait_line("event cancelled CallTool", PATIENCE).await.is_some(), "the engine saw the cancel");
    assert_eq!(engine_status(&g, "fault").await.quarantine, None, "an abort blames no one");
    g.stop().await;
}

#[tokio::test]
async fn a_quarantined_engine_offers_no_tools() {
    let (engine, g) = fault_gateway("tools").await;
    signal(engine.pid(), "USR1").await;
    wait_engine(&g, "fault", "quarantined", |e| e.quarantine.is_some()).await;
    let hc = client(&g.endpoint);
    let mut d = Drive::open(&hc, begin("q", "hi")).await.unwrap();
    let ctx = d.context().await.unwrap();
    assert!(ctx.engine_tools.is_empty(), "legacy serves, with no tools: {:?}", ctx.engine_tools);
    d.append(vec![tool_call("c1", "echo", "{}")]).await.unwrap();
    assert_eq!(d.call_tool("c1").await.unwrap_err().code(), Code::FailedPrecondition);
    g.stop().await;
}

#[tokio::test]
async fn tool_declarations_that_break_the_contract_keep_the_engine_out_with_the_field_path() {
    for (fault, field) in [
        ("bad-tool-name", "info.tools[0].name"),
        ("too-many-tools", "info.tools"),
        ("huge-schema", "info.tools[0].parameters_json_schema"),
        ("schema-not-object", "info.tools[0].parameters_json_schema"),
    ] {
        let engine = fault_engine(fault).await;
        let g = TestGateway::start(hosting("fault", &engine.endpoint, &[])).await;
        let e = wait_engine(&g, "fault", "refused at attach", |e| {
            e.quarantine.as_ref().is_some_and(|q| q.reason.contains(field))
        })
        .await;
        let (op, reason) = quarantine_of(&e);
        assert_eq!(op, "attach", "{fault}: {reason}");
        assert!(e.name.is_empty(), "{fault}: never attached");
        g.stop().await;
    }
}

#[tokio::test]
async fn on_failure_fail_fails_the_turn_naming_the_engine_instead_of_legacy() {
    let engine = fault_engine("tools").await;
    let mut config = hosting("fault", &engine.endpoint, &[]);
    config.plugins.entries.get_mut("fault").unwrap().on_failure = OnFailure::Fail;
    let g = TestGateway::start(config).await;
    g.wait_attached("fault").await;
    signal(engine.pid(), "USR1").await;
    wait_engine(&g, "fault", "quarantined", |e| e.quarantine.is_some()).await;
    let mut stream =
        g.client.clone().run_turn(ctxgate_tests::hosting::turn_request("f", "hi")).await.unwrap().into_inner();
    let s = loop {
        match stream.next().await {
            Some(Ok(_)) => continue,
            Some(Err(s)) => break s,
            None => panic!("the turn ran, on legacy"),
        }
    };
    assert_eq!(s.code(), Code::Unavailable, "{s:?}");
    assert!(s.message().contains("\"fault\"") && s.message().contains("onFailure"), "{s:?}");
    g.stop().await;
}
