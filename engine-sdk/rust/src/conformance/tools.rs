//! Cases for engine tools (`EngineInfo.tools`, `CallTool`): skipped for an
//! engine that declares none.

use std::time::Duration;

use tonic::Code;

use super::{CaseResult, Kit, Outcome, describe, ensure, req, session, timed};
use crate::pb;
use ctxgate_proto::{Method, validate};

/// A CallTool request for `name` in `session_id`.
pub(super) fn call(session_id: &str, name: &str, arguments_json: &str) -> pb::CallToolRequest {
    pb::CallToolRequest {
        session_id: session_id.into(),
        session_key: Some(session_id.into()),
        tool_call_id: format!("conformance-{name}"),
        name: name.into(),
        arguments_json: arguments_json.into(),
        ..Default::default()
    }
}

/// The engine's tools, or the skip when it declares none.
fn declared(kit: &Kit) -> Result<Result<Vec<pb::ToolDefinition>, Outcome>, String> {
    let info = kit.info()?;
    if info.tools.is_empty() {
        return Ok(Err(Outcome::Skip("the engine declares no tools".into())));
    }
    Ok(Ok(info.tools.clone()))
}

pub(super) async fn declared_valid(kit: &Kit) -> CaseResult {
    let tools = match declared(kit)? {
        Ok(t) => t,
        Err(skip) => return Ok(skip),
    };
    ensure(kit.implements(Method::CallTool), || "tools are declared but CallTool is not listed".into())?;
    validate::tools(&tools, "info.tools").map_err(|v| v.to_string())?;
    Ok(Outcome::Pass)
}

pub(super) async fn unknown_tool_is_an_error_result(kit: &Kit) -> CaseResult {
    if let Err(skip) = declared(kit)? {
        return Ok(skip);
    }
    let r = kit.client().call_tool(req(call(&session("tools-unknown"), "no_such_tool_here", "{}"))).await;
    let r = r.map_err(|s| format!("an unknown tool must be an error result, not {}", describe(&s)))?.into_inner();
    ensure(r.is_error, || "an unknown tool answered a result that is not an error".into())?;
    validate::result::call_tool(&r).map_err(|v| v.to_string())?;
    Ok(Outcome::Pass)
}

pub(super) async fn each_declared_tool_answers(kit: &Kit) -> CaseResult {
    let tools = match declared(kit)? {
        Ok(t) => t,
        Err(skip) => return Ok(skip),
    };
    let session_id = session("tools-each");
    for t in tools {
        // Arguments it may not accept: a result either way (an error one is fine).
        let r = kit.client().call_tool(req(call(&session_id, &t.name, "{}"))).await;
        let r = r.map_err(|s| format!("tool {:?} answered {}", t.name, describe(&s)))?.into_inner();
        validate::result::call_tool(&r).map_err(|v| format!("tool {:?}: {v}", t.name))?;
        // Arguments that are not JSON: an error result, never a failure.
        let r = kit.client().call_tool(req(call(&session_id, &t.name, "not json"))).await;
        let r =
            r.map_err(|s| format!("tool {:?} given arguments that are not JSON answered {}", t.name, describe(&s)))?;
        ensure(r.into_inner().is_error, || format!("tool {:?} accepted arguments that are not JSON", t.name))?;
    }
    Ok(Outcome::Pass)
}

pub(super) async fn deadline_and_cancel_leave_engine_healthy(kit: &Kit) -> CaseResult {
    let tools = match declared(kit)? {
        Ok(t) => t,
        Err(skip) => return Ok(skip),
    };
    let session_id = session("tools-deadline");
    let name = &tools[0].name;
    let got = kit.client().call_tool(timed(call(&session_id, name, "{}"), Duration::from_millis(1))).await;
    if let Err(s) = &got {
        ensure(matches!(s.code(), Code::DeadlineExceeded | Code::Cancelled), || {
            format!("a tool call with a 1 ms deadline ended in {}", describe(s))
        })?;
    }
    let mut c = kit.client();
    let request = call(&session_id, name, "{}");
    let pending = tokio::spawn(async move { c.call_tool(req(request)).await.map(|_| ()) });
    tokio::time::sleep(Duration::from_millis(1)).await;
    pending.abort();
    let _ = pending.await;
    kit.still_healthy("tool calls cut by their deadline or cancelled").await?;
    Ok(Outcome::Pass)
}
