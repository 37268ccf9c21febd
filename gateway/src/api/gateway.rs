//! The client API (`ctxgate.v1.Gateway`) over the turn core: proto in,
//! core types out and back.

use std::sync::Arc;

use ctxgate_proto::gateway::{self as api, gateway_server::Gateway};
use tonic::{Request, Response, Status};

use super::outbound::Outbound;
use super::{
    Compaction, EventStream, STREAM_BACKLOG, STREAM_CAPACITY, busy_policy, compaction, failed, guarded, session_fields,
    turn_events,
};
use crate::core::{Core, CoreError, ManagedTurn, TurnEnd, session_ref};
use crate::engines::Engine;
use crate::engines::guarded::QuarantineRecord;
use crate::engines::registry::Registry;
use crate::store::{OutboxCounts, OutboxPage, PageOutcome, PageRequest, Session};

/// The `ctxgate.v1.Gateway` service.
pub struct Api {
    pub core: Arc<Core>,
}

/// Page sizes: the default and the most one page holds.
const MAX_SESSIONS_PAGE: u32 = 1000;
const MAX_TRANSCRIPT_PAGE: u32 = 5000;
/// Stored bytes one GetTranscript page holds at most (about; one larger
/// entry is sent alone): a page always fits the client's 16 MiB decode limit.
const MAX_TRANSCRIPT_PAGE_BYTES: usize = 4 * 1024 * 1024;

fn page_size(asked: u32, max: u32) -> u32 {
    if asked == 0 { max } else { asked.min(max) }
}

/// The most rows one ListOutbox answers (also its default).
const MAX_OUTBOX_ROWS: u32 = 1000;
/// Blocked rows shown by GetStatus.
const STATUS_BLOCKED_ROWS: usize = 20;

impl Api {
    fn outbox_row(&self, r: &crate::store::OutboxRow) -> api::OutboxRow {
        api::OutboxRow {
            agent_id: r.agent_id.clone(),
            session_key: r.session_key.clone(),
            session_id: r.session_id.clone(),
            advancement_key: r.advancement_key.clone(),
            engine_id: r.engine_id.clone(),
            attempts: r.attempts,
            last_error: r.last_error.clone(),
            next_attempt_unix_ms: r.next_attempt_ms,
            blocked: r.attempts > 0,
            engine_state: self.core.delivery().engine_state(&r.engine_id).as_str().into(),
            created_at_unix_ms: r.created_at_ms,
        }
    }

    async fn session_info(&self, s: &Session) -> Result<api::SessionInfo, CoreError> {
        let (entries, compactions, visible_tokens) = self.core.session_counts(s).await?;
        Ok(api::SessionInfo {
            agent_id: s.agent_id.clone(),
            session_key: s.session_key.clone(),
            session_id: s.session_id.clone(),
            state: s.state.clone(),
            created_at_unix_ms: s.created_at_ms,
            entries,
            compactions,
            visible_tokens,
        })
    }

    async fn session(&self, r: Option<&api::SessionRef>) -> Result<Session, CoreError> {
        let (agent, key) = session_fields(r)?;
        self.core.session(agent, key).await
    }
}

#[tonic::async_trait]
impl Gateway for Api {
    type RunTurnStream = EventStream<api::TurnEvent>;

    async fn run_turn(&self, req: Request<api::RunTurnRequest>) -> Result<Response<Self::RunTurnStream>, Status> {
        let trace = super::trace_of(req.metadata());
        let r = req.into_inner();
        let (agent, key) = session_fields(r.session.as_ref())?;
        let busy = busy_policy(r.busy_policy, "busy_policy")?;
        let mut turn = ManagedTurn::new(agent, key, r.message, r.system_prompt, busy)?;
        turn.trace = trace;
        // Refused before the turn's task and stream exist (see `Core::admit`).
        let admission = self.core.admit()?;
        let cancel = self.core.call_token();
        let (out, rx) = Outbound::new(STREAM_CAPACITY, STREAM_BACKLOG, cancel.clone());
        let (core, work) = (self.core.clone(), cancel.clone());
        tokio::spawn(async move {
            let sink = out.clone();
            let events: crate::core::types::EventSink = Arc::new(move |e| {
                turn_events(e, |event| sink.push(api::TurnEvent { event: Some(event) }));
            });
            match core.run_managed(turn, events, work, admission).await {
                Ok(TurnEnd::Completed { entry_id, text, usage }) => {
                    let done = api::Completed { entry_id, text, usage: Some(usage) };
                    out.push_kept(api::TurnEvent { event: Some(api::turn_event::Event::Completed(done)) });
                }
                Ok(TurnEnd::Failed(f)) => {
                    out.push_kept(api::TurnEvent { event: Some(api::turn_event::Event::Failed(failed(f))) });
                }
                Err(e) => out.fail(Status::from(e)),
            }
        });
        Ok(Response::new(guarded(rx, cancel)))
    }

    type CompactStream = EventStream<api::CompactionEvent>;

    async fn compact(&self, req: Request<api::CompactSessionRequest>) -> Result<Response<Self::CompactStream>, Status> {
        let req = req.into_inner();
        let session = self.session(req.session.as_ref()).await?;
        let cancel = self.core.call_token();
        let (out, rx) = Outbound::new(STREAM_CAPACITY, STREAM_BACKLOG, cancel.clone());
        let (core, work) = (self.core.clone(), cancel.clone());
        tokio::spawn(async move {
            use api::compaction_event::Event as C;
            let sink = |e| {
                let event = match compaction(e) {
                    Compaction::Started(s) => C::Started(s),
                    Compaction::Progress(p) => C::Progress(p),
                    Compaction::Done(d) => C::Done(d),
                };
                out.push(api::CompactionEvent { event: Some(event) });
            };
            if let Err(e) = core.compactor().compact_session(&session, req.custom_instructions, &sink, work).await {
                out.fail(Status::from(e));
            }
        });
        Ok(Response::new(guarded(rx, cancel)))
    }

    async fn abort(&self, req: Request<api::AbortRequest>) -> Result<Response<api::AbortResult>, Status> {
        let (agent, key) = session_fields(req.get_ref().session.as_ref())?;
        let (agent, key) = session_ref(agent, key)?;
        Ok(Response::new(api::AbortResult { aborted: self.core.abort(&agent, &key).await? }))
    }

    async fn list_sessions(
        &self,
        req: Request<api::ListSessionsRequest>,
    ) -> Result<Response<api::ListSessionsResult>, Status> {
        let r = req.into_inner();
        let limit = page_size(r.page_size, MAX_SESSIONS_PAGE);
        let offset: u64 = if r.page_token.is_empty() {
            0
        } else {
            r.page_token.parse().map_err(|_| CoreError::invalid("page_token", "is not a token this gateway issued"))?
        };
        // One more than the page tells whether another page follows.
        let mut stats = self.core.list_sessions(r.agent_id.as_deref(), r.include_archived, offset, limit + 1).await?;
        let more = stats.len() > limit as usize;
        stats.truncate(limit as usize);
        let next_page_token = if more { offset.saturating_add(u64::from(limit)).to_string() } else { String::new() };
        let sessions = stats
            .into_iter()
            .map(|s| api::SessionInfo {
                agent_id: s.session.agent_id,
                session_key: s.session.session_key,
                session_id: s.session.session_id,
                state: s.session.state,
                created_at_unix_ms: s.session.created_at_ms,
                entries: s.entries,
                compactions: s.compactions,
                visible_tokens: 0,
            })
            .collect();
        Ok(Response::new(api::ListSessionsResult { sessions, next_page_token }))
    }

    async fn get_session(&self, req: Request<api::SessionRef>) -> Result<Response<api::SessionInfo>, Status> {
        let s = self.session(Some(req.get_ref())).await?;
        Ok(Response::new(self.session_info(&s).await?))
    }

    async fn get_transcript(
        &self,
        req: Request<api::GetTranscriptRequest>,
    ) -> Result<Response<api::GetTranscriptResult>, Status> {
        let r = req.into_inner();
        let s = self.session(r.session.as_ref()).await?;
        let limit = page_size(r.page_size, MAX_TRANSCRIPT_PAGE) as usize;
        let page = PageRequest {
            after: Some(r.page_token).filter(|t| !t.is_empty()),
            until: None,
            limit,
            max_bytes: MAX_TRANSCRIPT_PAGE_BYTES,
        };
        let (entries, next_page_token) = match self.core.transcript_page(&s.session_id, r.visible_only, page).await? {
            PageOutcome::Page { entries, more } => {
                let next = if more { entries.last().map(|e| e.id.clone()).unwrap_or_default() } else { String::new() };
                (entries, next)
            }
            PageOutcome::UnknownAfter | PageOutcome::UnknownUntil => {
                return Err(CoreError::invalid("page_token", "names no entry of this transcript").into());
            }
        };
        Ok(Response::new(api::GetTranscriptResult {
            session: Some(self.session_info(&s).await?),
            entries,
            next_page_token,
        }))
    }

    async fn new_session(&self, req: Request<api::SessionRef>) -> Result<Response<api::SessionInfo>, Status> {
        let r = req.get_ref();
        let s = self.core.replace_session(&r.agent_id, &r.session_key, false).await?;
        Ok(Response::new(self.session_info(&s).await?))
    }

    async fn reset_session(&self, req: Request<api::SessionRef>) -> Result<Response<api::SessionInfo>, Status> {
        let r = req.get_ref();
        let s = self.core.replace_session(&r.agent_id, &r.session_key, true).await?;
        Ok(Response::new(self.session_info(&s).await?))
    }

    async fn delete_session(
        &self,
        req: Request<api::SessionRef>,
    ) -> Result<Response<api::DeleteSessionResult>, Status> {
        let r = req.get_ref();
        let n = self.core.delete_sessions(&r.agent_id, &r.session_key).await?;
        Ok(Response::new(api::DeleteSessionResult { deleted_sessions: n }))
    }

    async fn get_status(&self, _req: Request<api::StatusRequest>) -> Result<Response<api::StatusResult>, Status> {
        let c = &self.core;
        let registry = c.registry();
        let OutboxCounts { queued: outbox_queued, blocked: outbox_blocked } = c.delivery().outbox_counts().await?;
        let blocked_commits = if outbox_blocked == 0 {
            Vec::new()
        } else {
            let rows = c.delivery().list_outbox(None, MAX_OUTBOX_ROWS).await?.rows;
            rows.iter().filter(|r| r.attempts > 0).take(STATUS_BLOCKED_ROWS).map(|r| self.outbox_row(r)).collect()
        };
        Ok(Response::new(api::StatusResult {
            version: env!("CARGO_PKG_VERSION").into(),
            model_provider: c.provider_name(),
            model: c.model_id().into(),
            context_window: c.config().models.context_window,
            selected_engine: registry.selected_id().into(),
            engines: engine_statuses(&registry),
            sessions: c.count_sessions().await?,
            turns_in_flight: c.turns_in_flight(),
            turns_queued: c.turns_queued(),
            outbox_queued,
            outbox_blocked,
            blocked_commits,
        }))
    }

    async fn list_outbox(
        &self,
        req: Request<api::ListOutboxRequest>,
    ) -> Result<Response<api::ListOutboxResult>, Status> {
        let r = req.into_inner();
        let limit = if r.limit == 0 { MAX_OUTBOX_ROWS } else { r.limit.min(MAX_OUTBOX_ROWS) };
        let OutboxPage { rows, more } = self.core.delivery().list_outbox(r.agent_id.as_deref(), limit).await?;
        let rows = rows.iter().map(|row| self.outbox_row(row)).collect();
        let (forgets, more_forgets) = self.core.delivery().list_forgets(limit).await?;
        let forgets = forgets
            .into_iter()
            .map(|f| api::OwedForget {
                engine_state: self.core.delivery().engine_state(&f.engine_id).as_str().into(),
                agent_id: f.agent_id,
                session_key: f.session_key,
                session_id: f.session_id,
                engine_id: f.engine_id,
                attempts: f.attempts,
                last_error: f.last_error,
                next_attempt_unix_ms: f.next_attempt_ms,
            })
            .collect();
        Ok(Response::new(api::ListOutboxResult { rows, more, forgets, more_forgets }))
    }

    async fn retry_outbox(&self, req: Request<api::SessionRef>) -> Result<Response<api::OutboxActionResult>, Status> {
        let r = req.into_inner();
        let cancel = self.core.call_token();
        let _guard = cancel.clone().drop_guard();
        let (done, remaining) = self.core.delivery().retry_outbox(&r.agent_id, &r.session_key, cancel).await?;
        let remaining = remaining.iter().map(|row| self.outbox_row(row)).collect();
        Ok(Response::new(api::OutboxActionResult { done, remaining }))
    }

    async fn drop_outbox(&self, req: Request<api::SessionRef>) -> Result<Response<api::OutboxActionResult>, Status> {
        let r = req.into_inner();
        let cancel = self.core.call_token();
        let _guard = cancel.clone().drop_guard();
        let dropped = self.core.delivery().drop_outbox(&r.agent_id, &r.session_key, cancel).await?;
        Ok(Response::new(api::OutboxActionResult { done: dropped.len() as u32, remaining: Vec::new() }))
    }

    async fn drop_forgets(
        &self,
        req: Request<api::DropForgetsRequest>,
    ) -> Result<Response<api::OutboxActionResult>, Status> {
        let engine = req.into_inner().engine_id;
        if engine.is_empty() {
            return Err(CoreError::invalid("engine_id", "must name the engine whose forgets to drop").into());
        }
        let dropped = self.core.delivery().drop_forgets(&engine).await?;
        Ok(Response::new(api::OutboxActionResult { done: dropped.len() as u32, remaining: Vec::new() }))
    }

    async fn list_outbox_drops(
        &self,
        req: Request<api::ListOutboxDropsRequest>,
    ) -> Result<Response<api::ListOutboxDropsResult>, Status> {
        let limit = req.into_inner().limit;
        let limit = if limit == 0 { MAX_OUTBOX_ROWS } else { limit.min(MAX_OUTBOX_ROWS) };
        let (drops, more) = self.core.delivery().list_drops(limit).await?;
        let drops = drops
            .into_iter()
            .map(|d| api::OutboxDrop {
                agent_id: d.agent_id,
                session_key: d.session_key,
                session_id: d.session_id,
                advancement_key: d.advancement_key,
                engine_id: d.engine_id,
                attempts: d.attempts,
                last_error: d.last_error,
                dropped_at_unix_ms: d.dropped_at_ms,
            })
            .collect();
        Ok(Response::new(api::ListOutboxDropsResult { drops, more }))
    }

    async fn spawn_subagent(
        &self,
        req: Request<api::SpawnSubagentRequest>,
    ) -> Result<Response<api::SpawnSubagentResult>, Status> {
        let r = req.into_inner();
        let parent = self.session(r.parent.as_ref()).await?;
        let cancel = self.core.call_token();
        let _guard = cancel.clone().drop_guard();
        let (child, engine_prepared) =
            self.core.spawn_subagent(&parent, &r.child_session_key, &r.context_mode, r.ttl_ms, cancel).await?;
        Ok(Response::new(api::SpawnSubagentResult { child: Some(self.session_info(&child).await?), engine_prepared }))
    }

    async fn end_subagent(
        &self,
        req: Request<api::EndSubagentRequest>,
    ) -> Result<Response<api::EndSubagentResult>, Status> {
        let r = req.into_inner();
        let (agent, key) = session_fields(r.child.as_ref())?;
        let (agent, key) = session_ref(agent, key)?;
        let cancel = self.core.call_token();
        let _guard = cancel.clone().drop_guard();
        let ended = self.core.end_subagent(&agent, &key, &r.reason, cancel).await?;
        if !ended {
            return Err(CoreError::NoSession(key).into());
        }
        Ok(Response::new(api::EndSubagentResult { ended }))
    }

    async fn readmit_engine(
        &self,
        req: Request<api::ReadmitEngineRequest>,
    ) -> Result<Response<api::ReadmitEngineResult>, Status> {
        let id = req.into_inner().engine_id;
        let readmitted = self.core.readmit_engine(&id).ok_or(CoreError::NoEngine(id))?;
        Ok(Response::new(api::ReadmitEngineResult { readmitted }))
    }

    async fn preview_context(&self, req: Request<api::SessionRef>) -> Result<Response<api::ContextPreview>, Status> {
        let r = req.get_ref();
        let p = self.core.preview_context(&r.agent_id, &r.session_key).await?;
        Ok(Response::new(api::ContextPreview {
            engine_id: p.engine_id,
            messages: p
                .messages
                .into_iter()
                .map(|m| api::PreviewMessage {
                    kind: if m.summary { "summary" } else { "raw" }.into(),
                    tokens: m.tokens,
                    message: Some(m.message),
                })
                .collect(),
            system_prompt_addition: p.system_prompt_addition,
            estimated_tokens: p.estimated_tokens,
            token_budget: p.token_budget,
            engine_tools: p.engine_tools,
        }))
    }
}

/// Engines for Status: legacy first, then every remote one with its replicas.
fn engine_statuses(registry: &Registry) -> Vec<api::EngineStatus> {
    let legacy = registry.legacy.info();
    let mut out = vec![api::EngineStatus {
        id: legacy.id.clone(),
        name: legacy.name.clone(),
        endpoint: "in-process".into(),
        health: "SERVING".into(),
        quarantine: None,
        methods: vec![],
        replicas: vec![],
        affinity: String::new(),
        tools: vec![],
        declared_id: legacy.id.clone(),
    }];
    for (id, g) in registry.engines() {
        let replicas = g
            .replicas()
            .iter()
            .map(|r| api::ReplicaStatus {
                address: r.address().to_owned(),
                health: r.guarded.health().as_str().into(),
                quarantine: r.guarded.quarantine_record().map(quarantine),
                in_flight: r.guarded.in_flight() as u32,
                calls: r.guarded.stats().values().map(|s| s.calls).sum(),
            })
            .collect();
        // One read: name and tools from the same attach.
        let info = g.attached_info();
        out.push(api::EngineStatus {
            id: id.to_owned(),
            name: info.as_ref().map(|i| i.name.clone()).unwrap_or_default(),
            declared_id: info.as_ref().map(|i| i.id.clone()).unwrap_or_default(),
            endpoint: g.endpoint.clone(),
            health: g.health().as_str().into(),
            quarantine: g.quarantine_record().map(quarantine),
            replicas,
            affinity: g.affinity().map(|a| a.as_str().to_owned()).unwrap_or_default(),
            tools: info.map(|i| i.tools.clone()).unwrap_or_default(),
            methods: g
                .stats()
                .into_iter()
                .map(|(m, s)| api::MethodCounters {
                    method: m.name().into(),
                    calls: s.calls,
                    failures: s.failures,
                    timeouts: s.timeouts,
                    fallbacks: s.fallbacks,
                    shed: s.shed,
                })
                .collect(),
        });
    }
    out
}

fn quarantine(q: QuarantineRecord) -> api::Quarantine {
    api::Quarantine {
        operation: q.cause.as_str().into(),
        reason: q.reason,
        since_unix_ms: q.since.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64),
    }
}
