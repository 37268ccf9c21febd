//! The cases: each talks to the engine over real gRPC and passes, fails,
//! or skips with a reason.

use std::time::Duration;

use ctxgate_proto::{ENGINE_SERVICE, Method, estimate, limits, validate};
use tokio_stream::StreamExt;
use tonic::{Code, Request};
use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient};
use tonic_reflection::pb::v1 as reflection;

use super::{CaseResult, Kit, Outcome, assemble_request, describe, ensure, history, req, session, timed};
use crate::pb;
use crate::testkit::msg;

pub(super) async fn health_check(kit: &Kit) -> CaseResult {
    let mut health = HealthClient::new(kit.channel.clone());
    for service in ["", ENGINE_SERVICE] {
        let status = health
            .check(req(HealthCheckRequest { service: service.into() }))
            .await
            .map_err(|s| format!("Check({service:?}) failed: {}", describe(&s)))?
            .into_inner()
            .status;
        ensure(status == ServingStatus::Serving as i32, || format!("Check({service:?}) is {status}, not SERVING"))?;
    }
    Ok(Outcome::Pass)
}

pub(super) async fn health_watch(kit: &Kit) -> CaseResult {
    let mut stream = HealthClient::new(kit.channel.clone())
        .watch(Request::new(HealthCheckRequest { service: ENGINE_SERVICE.into() }))
        .await
        .map_err(|s| format!("Watch failed: {}", describe(&s)))?
        .into_inner();
    let first = stream.next().await.ok_or("Watch ended without a status")?.map_err(|s| describe(&s))?;
    ensure(first.status == ServingStatus::Serving as i32, || {
        format!("Watch's first status is {}, not SERVING", first.status)
    })?;
    Ok(Outcome::Pass)
}

pub(super) async fn reflection_lists_services(kit: &Kit) -> CaseResult {
    use reflection::{server_reflection_request::MessageRequest, server_reflection_response::MessageResponse};
    let request = reflection::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut stream = reflection::server_reflection_client::ServerReflectionClient::new(kit.channel.clone())
        .server_reflection_info(req(tokio_stream::iter([request])))
        .await
        .map_err(|s| format!("reflection failed: {}", describe(&s)))?
        .into_inner();
    let answer = stream.next().await.ok_or("reflection answered nothing")?.map_err(|s| describe(&s))?;
    let Some(MessageResponse::ListServicesResponse(list)) = answer.message_response else {
        return Err("reflection did not answer ListServices".into());
    };
    let names: Vec<_> = list.service.iter().map(|s| s.name.as_str()).collect();
    for want in [ENGINE_SERVICE, "grpc.health.v1.Health"] {
        ensure(names.contains(&want), || format!("reflection lists {names:?}, missing {want}"))?;
    }
    Ok(Outcome::Pass)
}

pub(super) async fn info_valid(kit: &Kit) -> CaseResult {
    validate::result::info(kit.info()?).map_err(|v| v.to_string())?;
    Ok(Outcome::Pass)
}

pub(super) async fn info_id_not_reserved(kit: &Kit) -> CaseResult {
    let legacy = ctxgate_proto::LEGACY_ENGINE_ID;
    ensure(kit.info()?.id.trim() != legacy, || format!("id {legacy:?} is reserved for the gateway's own engine"))?;
    Ok(Outcome::Pass)
}

/// Calls one optional method with a valid request; `Ok(true)` if it is
/// implemented (answered anything but UNIMPLEMENTED).
async fn probe(kit: &Kit, method: Method, session_id: &str) -> Result<bool, String> {
    let mut c = kit.client();
    let key = Some(session_id.to_owned());
    let code = match method {
        Method::Bootstrap => c
            .bootstrap(req(pb::BootstrapRequest {
                session_id: session_id.into(),
                session_key: key,
                ..Default::default()
            }))
            .await
            .err(),
        Method::IngestBatch => c
            .ingest_batch(req(pb::IngestBatchRequest {
                session_id: session_id.into(),
                session_key: key,
                messages: vec![msg::user("probe-1", "hello")],
                is_heartbeat: false,
            }))
            .await
            .err(),
        Method::AfterTurn => c
            .after_turn(req(pb::AfterTurnRequest {
                session_id: session_id.into(),
                session_key: key,
                messages: vec![msg::user("probe-2", "hi")],
                pre_prompt_message_count: 0,
                ..Default::default()
            }))
            .await
            .err(),
        Method::CommitTurn => c.commit_turn(req(commit_request(session_id, "probe-turn"))).await.err(),
        Method::Maintain => c
            .maintain(req(pb::MaintainRequest {
                session_id: session_id.into(),
                session_key: key,
                reason: pb::MaintainReason::Turn as i32,
                ..Default::default()
            }))
            .await
            .err(),
        Method::PrepareSubagentSpawn => c
            .prepare_subagent_spawn(req(pb::PrepareSubagentSpawnRequest {
                parent_session_key: session_id.into(),
                child_session_key: format!("{session_id}-child"),
                context_mode: pb::SubagentContextMode::Isolated as i32,
                ..Default::default()
            }))
            .await
            .err(),
        Method::RollbackSubagentSpawn => c
            .rollback_subagent_spawn(req(pb::RollbackSubagentSpawnRequest {
                rollback_token: "unknown-token".into(),
                child_session_key: format!("{session_id}-child"),
            }))
            .await
            .err(),
        Method::OnSubagentEnded => c
            .on_subagent_ended(req(pb::OnSubagentEndedRequest {
                child_session_key: format!("{session_id}-child"),
                reason: pb::SubagentEndReason::Completed as i32,
                ..Default::default()
            }))
            .await
            .err(),
        Method::ForgetSession => c
            .forget_session(req(pb::ForgetSessionRequest {
                session_id: format!("{session_id}-never-seen"),
                ..Default::default()
            }))
            .await
            .err(),
        // An implementing engine answers an unknown tool with an error result.
        Method::CallTool => {
            c.call_tool(req(super::tools::call(session_id, "ctxgate_conformance_probe", "{}"))).await.err()
        }
        Method::GetInfo | Method::Ingest | Method::Assemble | Method::Compact | Method::Dispose => {
            return Err(format!("no probe for {method}"));
        }
    };
    match code {
        None => Ok(true),
        Some(s) if s.code() == Code::Unimplemented => Ok(false),
        Some(s) => Err(format!("{method} with a valid request failed: {}", describe(&s))),
    }
}

pub(super) async fn info_methods_match(kit: &Kit) -> CaseResult {
    kit.info()?;
    let session_id = session("methods");
    kit.ingest_all(&session_id, &[msg::user("seed", "hello")]).await?;
    // Dispose ends the engine's life: not probed.
    let optional = Method::ALL.into_iter().filter(|m| !m.required() && *m != Method::Dispose);
    let mut problems = Vec::new();
    for method in optional {
        let implemented = probe(kit, method, &session_id).await?;
        match (kit.implements(method), implemented) {
            (true, false) => problems.push(format!("{method} is listed but answers UNIMPLEMENTED")),
            (false, true) => problems.push(format!("{method} answers but is not listed")),
            _ => {}
        }
    }
    ensure(problems.is_empty(), || problems.join("; "))?;
    Ok(Outcome::Pass)
}

pub(super) async fn ingest_idempotent(kit: &Kit) -> CaseResult {
    let session_id = session("ingest");
    let r = pb::IngestRequest {
        session_id: session_id.clone(),
        session_key: Some(session_id.clone()),
        message: Some(msg::user("m1", "hello")),
        is_heartbeat: false,
    };
    kit.client().ingest(req(r.clone())).await.map_err(|s| format!("first Ingest failed: {}", describe(&s)))?;
    let second =
        kit.client().ingest(req(r)).await.map_err(|s| format!("second Ingest failed: {}", describe(&s)))?.into_inner();
    ensure(!second.ingested, || "the same message id was ingested twice".into())?;
    Ok(Outcome::Pass)
}

pub(super) async fn assemble_estimate(kit: &Kit) -> CaseResult {
    let h = history(2, 200);
    let r = kit.seeded_assemble("estimate", &h, None).await?;
    validate::result::assemble(&r, h.len()).map_err(|v| v.to_string())?;
    let ours = estimate::messages_tokens(&r.messages);
    ensure(r.estimated_tokens > 0, || "estimated_tokens is 0 for a non-empty result".into())?;
    ensure(r.estimated_tokens <= ours * 4 && r.estimated_tokens * 4 >= ours, || {
        format!("estimated_tokens {} is more than 4x away from the contract estimate {ours}", r.estimated_tokens)
    })?;
    Ok(Outcome::Pass)
}

pub(super) async fn assemble_order(kit: &Kit) -> CaseResult {
    let h = history(3, 50);
    let r = kit.seeded_assemble("order", &h, None).await?;
    let position = |id: &str| h.iter().position(|m| m.id == id);
    let kept: Vec<usize> = r.messages.iter().filter_map(|m| position(&m.id)).collect();
    ensure(!kept.is_empty(), || "no message of the request came back".into())?;
    ensure(kept.windows(2).all(|w| w[0] < w[1]), || {
        format!("messages came back out of order (request positions {kept:?})")
    })?;
    let newest = &h[h.len() - 1].id;
    ensure(r.messages.iter().any(|m| &m.id == newest), || "the newest message was dropped with no budget".into())?;
    Ok(Outcome::Pass)
}

pub(super) async fn assemble_tool_pairs(kit: &Kit) -> CaseResult {
    let h = history(6, 2000);
    // A budget that fits about a third of the history forces the engine to cut.
    let budget = estimate::messages_tokens(&h) / 3;
    for b in [None, Some(budget)] {
        let r = kit.seeded_assemble("pairs", &h, b).await?;
        validate::result::assemble(&r, h.len()).map_err(|v| format!("budget {b:?}: {v}"))?;
    }
    Ok(Outcome::Pass)
}

fn compact_request(session_id: &str) -> pb::CompactRequest {
    pb::CompactRequest {
        session_id: session_id.into(),
        session_key: session_id.into(),
        force: true,
        token_budget: Some(2000),
        compaction_target: pb::CompactionTarget::Threshold as i32,
        ..Default::default()
    }
}

pub(super) async fn compact_stream_shape(kit: &Kit) -> CaseResult {
    use pb::compact_event::Event;
    let session_id = session("compact");
    kit.ingest_all(&session_id, &history(8, 1000)).await?;
    let mut stream =
        kit.client().compact(req(compact_request(&session_id))).await.map_err(|s| describe(&s))?.into_inner();
    let mut events = Vec::new();
    while let Some(e) = stream.next().await {
        events.push(e.map_err(|s| format!("Compact failed after {} events: {}", events.len(), describe(&s)))?);
    }
    let (last, progress) = events.split_last().ok_or("the stream ended with no event")?;
    for p in progress {
        match &p.event {
            Some(Event::Progress(pr)) => ensure(pr.total == 0 || pr.done <= pr.total, || {
                format!("progress done {} > total {}", pr.done, pr.total)
            })?,
            _ => return Err("an event came after the terminal event".into()),
        }
    }
    match &last.event {
        Some(Event::Result(r)) if r.compacted && !r.ok => Err("result says compacted but not ok".into()),
        Some(Event::Result(_)) | Some(Event::DelegateToHost(_)) => Ok(Outcome::Pass),
        _ => Err("the stream ended without a result or delegate_to_host".into()),
    }
}

/// A turn of two messages, anchored as the gateway anchors one: the user's
/// entry at position 0, the terminal one after it at position 1, both of
/// one generation (a durable engine may check that the range and the
/// positions agree, as lossless-claw 1.x does).
fn commit_request(session_id: &str, key: &str) -> pb::CommitTurnRequest {
    let anchor = |entry: &str, seq: u64, parent: Option<String>| pb::TranscriptEntryAnchor {
        session_id: session_id.into(),
        session_key: session_id.into(),
        generation: session_id.into(),
        entry_id: entry.into(),
        raw_seq: seq,
        effective_parent_id: parent,
        active_message_position: seq - 1,
        ..Default::default()
    };
    pb::CommitTurnRequest {
        advancement_key: key.into(),
        admission: Some(pb::TranscriptTurnAdmission {
            anchor: Some(anchor(&format!("{key}-u"), 1, None)),
            logical_turn_id: key.into(),
            role: pb::Role::User as i32,
        }),
        terminal: Some(anchor(&format!("{key}-a"), 2, Some(format!("{key}-u")))),
        messages: vec![msg::user(&format!("{key}-u"), "question"), msg::assistant(&format!("{key}-a"), "answer")],
        session_id: session_id.into(),
        session_key: Some(session_id.into()),
        ..Default::default()
    }
}

/// Ingest, forget, ingest the same message again: an engine that forgot
/// the session takes it as new. Forgetting twice, or a session never seen,
/// answers OK.
pub(super) async fn forget_session_forgets(kit: &Kit) -> CaseResult {
    if !kit.implements(Method::ForgetSession) {
        return Ok(Outcome::Skip("ForgetSession is not implemented".into()));
    }
    let session_id = session("forget");
    let ingest = pb::IngestRequest {
        session_id: session_id.clone(),
        session_key: Some(session_id.clone()),
        message: Some(msg::user("m1", "remember me")),
        is_heartbeat: false,
    };
    let forget = pb::ForgetSessionRequest { session_id: session_id.clone(), ..Default::default() };
    kit.client().ingest(req(ingest.clone())).await.map_err(|s| format!("Ingest failed: {}", describe(&s)))?;
    for n in ["first", "second"] {
        kit.client()
            .forget_session(req(forget.clone()))
            .await
            .map_err(|s| format!("{n} ForgetSession failed: {}", describe(&s)))?;
    }
    let again = kit
        .client()
        .ingest(req(ingest))
        .await
        .map_err(|s| format!("Ingest after ForgetSession failed: {}", describe(&s)))?
        .into_inner();
    ensure(again.ingested, || "the message was still held after ForgetSession (ingested=false)".into())?;
    Ok(Outcome::Pass)
}

fn delta_engine(kit: &Kit) -> Result<Option<Outcome>, String> {
    let delta = kit.info()?.history_delivery == pb::HistoryDelivery::Delta as i32;
    Ok((!delta).then(|| Outcome::Skip("the engine declares FULL history delivery".into())))
}

/// What a faithful DELTA engine holds after an IngestBatch of `messages`.
fn cursor_after(messages: &[pb::AgentMessage]) -> pb::HistoryCursor {
    pb::HistoryCursor {
        message_id: messages.last().map(|m| m.id.clone()).unwrap_or_default(),
        seq: messages.len() as u64,
        message_count: messages.len() as u64,
        tokens: estimate::messages_tokens(messages),
    }
}

async fn ingest_batch(kit: &Kit, session_id: &str, messages: &[pb::AgentMessage]) -> Result<(), String> {
    let r = pb::IngestBatchRequest {
        session_id: session_id.into(),
        session_key: Some(session_id.into()),
        messages: messages.to_vec(),
        is_heartbeat: false,
    };
    kit.client().ingest_batch(req(r)).await.map_err(|s| format!("IngestBatch failed: {}", describe(&s)))?;
    Ok(())
}

/// The held history plus only the new message: the result has all three,
/// in order.
pub(super) async fn delta_from_cursor(kit: &Kit) -> CaseResult {
    if let Some(skip) = delta_engine(kit)? {
        return Ok(skip);
    }
    let session_id = session("delta");
    let held = [msg::user("d1", "first, about ticket D-1"), msg::assistant("d2", "noted D-1")];
    ingest_batch(kit, &session_id, &held).await?;
    let mut r = assemble_request(&session_id, vec![msg::user("d3", "and now D-3")], None);
    r.cursor = Some(cursor_after(&held));
    let out = kit.client().assemble(req(r)).await.map_err(|s| describe(&s))?.into_inner();
    let ids: Vec<&str> = out.messages.iter().map(|m| m.id.as_str()).filter(|id| id.starts_with('d')).collect();
    ensure(ids == ["d1", "d2", "d3"], || format!("assembled {ids:?} from the cursor, not [d1, d2, d3]"))?;
    Ok(Outcome::Pass)
}

/// A cursor the engine does not hold: FAILED_PRECONDITION with the typed
/// HistoryGap detail (never INTERNAL, never a guess).
pub(super) async fn delta_gap(kit: &Kit) -> CaseResult {
    if let Some(skip) = delta_engine(kit)? {
        return Ok(skip);
    }
    let session_id = session("gap");
    let mut r = assemble_request(&session_id, vec![msg::user("g3", "where were we?")], None);
    r.cursor = Some(pb::HistoryCursor { message_id: "g2".into(), seq: 2, message_count: 2, tokens: 10 });
    match kit.client().assemble(req(r)).await {
        Ok(_) => Err("Assemble with a cursor the engine cannot hold answered OK".into()),
        Err(s) if ctxgate_proto::history::gap_of(&s).is_some() => Ok(Outcome::Pass),
        Err(s) => Err(format!("expected FAILED_PRECONDITION with a HistoryGap detail, got {}", describe(&s))),
    }
}

/// After a gap, the history resent with IngestBatch makes the same cursor
/// good.
pub(super) async fn delta_resend(kit: &Kit) -> CaseResult {
    if let Some(skip) = delta_engine(kit)? {
        return Ok(skip);
    }
    let session_id = session("resend");
    let history = [msg::user("r1", "one"), msg::assistant("r2", "two")];
    let mut r = assemble_request(&session_id, vec![msg::user("r3", "three")], None);
    r.cursor = Some(cursor_after(&history));
    let first = kit.client().assemble(req(r.clone())).await;
    ensure(first.as_ref().err().and_then(ctxgate_proto::history::gap_of).is_some(), || {
        format!(
            "a fresh session with a cursor should be a gap, got {:?}",
            first.map(|_| "OK").map_err(|s| describe(&s))
        )
    })?;
    ingest_batch(kit, &session_id, &history).await?;
    let out = kit.client().assemble(req(r)).await.map_err(|s| format!("after the resend: {}", describe(&s)))?;
    ensure(out.into_inner().messages.iter().any(|m| m.id == "r1"), || "the resent history is not assembled".into())?;
    Ok(Outcome::Pass)
}

pub(super) async fn commit_turn_idempotent(kit: &Kit) -> CaseResult {
    if !kit.implements(Method::CommitTurn) {
        return Ok(Outcome::Skip("CommitTurn is not implemented".into()));
    }
    let session_id = session("commit");
    let r = commit_request(&session_id, "turn-1");
    let first = kit.client().commit_turn(req(r.clone())).await.map_err(|s| describe(&s))?.into_inner();
    let second = kit.client().commit_turn(req(r)).await.map_err(|s| describe(&s))?.into_inner();
    ensure(first.status == pb::CommitStatus::Committed as i32, || {
        format!("first commit answered status {}", first.status)
    })?;
    ensure(second.status == pb::CommitStatus::Duplicate as i32, || {
        format!("retried commit answered status {}, not DUPLICATE", second.status)
    })?;
    Ok(Outcome::Pass)
}

pub(super) async fn subagent_rollback(kit: &Kit) -> CaseResult {
    if !kit.implements(Method::PrepareSubagentSpawn) {
        return Ok(Outcome::Skip("PrepareSubagentSpawn is not implemented".into()));
    }
    let parent = session("parent");
    kit.ingest_all(&parent, &history(1, 10)).await?;
    let prep = pb::PrepareSubagentSpawnRequest {
        parent_session_key: parent.clone(),
        child_session_key: format!("{parent}-child"),
        context_mode: pb::SubagentContextMode::Fork as i32,
        parent_session_id: Some(parent.clone()),
        ttl_ms: Some(60_000),
        ..Default::default()
    };
    let r = kit.client().prepare_subagent_spawn(req(prep)).await.map_err(|s| describe(&s))?.into_inner();
    let Some(token) = r.rollback_token else {
        return Ok(Outcome::Skip("fork preparation returned no rollback token".into()));
    };
    for attempt in ["first", "repeated"] {
        let rb = pb::RollbackSubagentSpawnRequest {
            rollback_token: token.clone(),
            child_session_key: format!("{parent}-child"),
        };
        kit.client()
            .rollback_subagent_spawn(req(rb))
            .await
            .map_err(|s| format!("{attempt} rollback failed: {}", describe(&s)))?;
    }
    Ok(Outcome::Pass)
}

pub(super) async fn cancel_mid_flight(kit: &Kit) -> CaseResult {
    let session_id = session("cancel");
    let h = history(20, 4000);
    kit.ingest_all(&session_id, &h).await?;
    // A streaming Compact dropped after its first event (or at once).
    let mut stream =
        kit.client().compact(Request::new(compact_request(&session_id))).await.map_err(|s| describe(&s))?.into_inner();
    let _ = tokio::time::timeout(Duration::from_millis(20), stream.next()).await;
    drop(stream);
    // A unary Assemble abandoned after 1 ms.
    let mut c = kit.client();
    let call =
        tokio::spawn(
            async move { c.assemble(Request::new(assemble_request(&session_id, h, Some(500)))).await.map(|_| ()) },
        );
    tokio::time::sleep(Duration::from_millis(1)).await;
    call.abort();
    let _ = call.await;
    kit.still_healthy("cancelled calls").await?;
    Ok(Outcome::Pass)
}

pub(super) async fn deadline_one_ms(kit: &Kit) -> CaseResult {
    let session_id = session("deadline");
    let h = history(20, 4000);
    let got = kit.client().assemble(timed(assemble_request(&session_id, h, Some(500)), Duration::from_millis(1))).await;
    if let Err(s) = &got {
        ensure(matches!(s.code(), Code::DeadlineExceeded | Code::Cancelled), || {
            format!("a 1 ms deadline ended in {}", describe(s))
        })?;
    }
    kit.still_healthy("a 1 ms deadline").await?;
    Ok(Outcome::Pass)
}

pub(super) async fn malformed_missing_session(kit: &Kit) -> CaseResult {
    let r = pb::IngestRequest {
        session_id: String::new(),
        session_key: None,
        message: Some(msg::user("m", "hi")),
        is_heartbeat: false,
    };
    kit.expect_code("Ingest without session_id", kit.client().ingest(req(r)).await, Code::InvalidArgument).await?;
    let a = assemble_request("", vec![msg::user("m", "hi")], None);
    kit.expect_code("Assemble without session_id", kit.client().assemble(req(a)).await, Code::InvalidArgument).await
}

pub(super) async fn malformed_missing_message(kit: &Kit) -> CaseResult {
    let r = pb::IngestRequest { session_id: session("nomsg"), session_key: None, message: None, is_heartbeat: false };
    kit.expect_code("Ingest without a message", kit.client().ingest(req(r)).await, Code::InvalidArgument).await
}

pub(super) async fn malformed_unknown_role(kit: &Kit) -> CaseResult {
    let mut m = msg::user("m", "hi");
    m.role = 42;
    let r = pb::IngestRequest { session_id: session("role"), session_key: None, message: Some(m), is_heartbeat: false };
    kit.expect_code("Ingest with role 42", kit.client().ingest(req(r)).await, Code::InvalidArgument).await
}

pub(super) async fn malformed_tool_result(kit: &Kit) -> CaseResult {
    let r = pb::IngestRequest {
        session_id: session("toolid"),
        session_key: None,
        message: Some(msg::tool_result("m", "", "output")),
        is_heartbeat: false,
    };
    kit.expect_code(
        "Ingest of a tool result without a call id",
        kit.client().ingest(req(r)).await,
        Code::InvalidArgument,
    )
    .await
}

pub(super) async fn malformed_oversized(kit: &Kit) -> CaseResult {
    let big = "x".repeat(limits::MAX_MESSAGE_CONTENT_BYTES + 1024);
    let r = pb::IngestRequest {
        session_id: session("big"),
        session_key: None,
        message: Some(msg::user("m", &big)),
        is_heartbeat: false,
    };
    kit.expect_code(
        "Ingest of a message over the content limit",
        kit.client().ingest(req(r)).await,
        Code::ResourceExhausted,
    )
    .await
}
