//! The client API (`ctxgate.v1.Gateway`) over the turn core, and the one
//! mapping from core errors to gRPC statuses.

use std::pin::Pin;
use std::sync::Arc;

use ctxgate_proto::gateway::{self as api, gateway_server::Gateway};
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::{Request, Response, Status};

use crate::core::{Core, CoreError, session_ref, validate_turn};
use crate::store::StoreError;
use crate::transcript;

impl From<CoreError> for Status {
    fn from(e: CoreError) -> Self {
        match e {
            CoreError::Invalid { .. } => Status::invalid_argument(e.to_string()),
            CoreError::TooLarge { .. } => Status::resource_exhausted(e.to_string()),
            CoreError::NoSession(_) => Status::not_found(format!("{e}; start one with `ctxgate chat --session KEY`")),
            CoreError::CompactionTimeout(_) => Status::deadline_exceeded(e.to_string()),
            CoreError::CompactionFailed(_) => Status::unavailable(e.to_string()),
            CoreError::Aborted => Status::cancelled("aborted"),
            CoreError::NoEngine(_) => Status::not_found(e.to_string()),
            CoreError::Precondition(_) => Status::failed_precondition(e.to_string()),
            CoreError::EngineFailed(_) => Status::unavailable(e.to_string()),
            CoreError::Store(StoreError::NoSession(_)) => Status::not_found("the session no longer exists"),
            CoreError::Store(StoreError::Backend(detail)) => {
                // Internal detail goes to the log, not to clients.
                tracing::error!(%detail, "store failure");
                Status::internal("the gateway's store failed; see the gateway log")
            }
        }
    }
}

pub struct Api {
    pub core: Arc<Core>,
}

type EventStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// `stream`, firing `cancel` when the client drops it (client cancel,
/// disconnect): the work behind it stops.
fn guarded<T: Send + 'static>(
    stream: impl Stream<Item = Result<T, Status>> + Send + 'static,
    cancel: tokio_util::sync::CancellationToken,
) -> EventStream<T> {
    let guard = cancel.drop_guard();
    Box::pin(stream.map(move |item| {
        let _keep = &guard;
        item
    }))
}

#[tonic::async_trait]
impl Gateway for Api {
    type RunTurnStream = EventStream<api::TurnEvent>;

    async fn run_turn(&self, req: Request<api::RunTurnRequest>) -> Result<Response<Self::RunTurnStream>, Status> {
        let req = req.into_inner();
        validate_turn(&req)?;
        let (tx, rx) = mpsc::unbounded_channel();
        let (failed_tx, failed_rx) = tokio::sync::oneshot::channel::<Status>();
        let cancel = self.core.call_token();
        let (core, work) = (self.core.clone(), cancel.clone());
        tokio::spawn(async move {
            if let Err(e) = core.run_turn(req, tx, work).await {
                let _ = failed_tx.send(Status::from(e));
            }
        });
        // The events, then — once every sender is gone — the error that
        // ended the turn early, if one did.
        let events = UnboundedReceiverStream::new(rx).map(Ok);
        let failure = futures_util::stream::once(failed_rx);
        let failure = futures_util::StreamExt::filter_map(failure, |r| std::future::ready(r.ok().map(Err)));
        Ok(Response::new(guarded(events.chain(failure), cancel)))
    }

    type CompactStream = EventStream<api::CompactionEvent>;

    async fn compact(&self, req: Request<api::CompactSessionRequest>) -> Result<Response<Self::CompactStream>, Status> {
        let req = req.into_inner();
        self.core.session(req.session.as_ref()).await?;
        let (tx, rx) = mpsc::unbounded_channel();
        let cancel = self.core.call_token();
        let (core, work) = (self.core.clone(), cancel.clone());
        tokio::spawn(async move {
            let sink = |e| {
                let _ = tx.send(Ok(api::CompactionEvent { event: Some(e) }));
            };
            if let Err(e) = core.compact_session(req, &sink, work).await {
                let _ = tx.send(Err(Status::from(e)));
            }
        });
        Ok(Response::new(guarded(UnboundedReceiverStream::new(rx), cancel)))
    }

    async fn abort(&self, req: Request<api::AbortRequest>) -> Result<Response<api::AbortResult>, Status> {
        let (agent, key) = session_ref(req.get_ref().session.as_ref())?;
        Ok(Response::new(api::AbortResult { aborted: self.core.abort(&agent, &key).await? }))
    }

    async fn list_sessions(
        &self,
        req: Request<api::ListSessionsRequest>,
    ) -> Result<Response<api::ListSessionsResult>, Status> {
        let r = req.into_inner();
        let stats =
            self.core.store.list_sessions(r.agent_id.as_deref(), r.include_archived).await.map_err(CoreError::from)?;
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
        Ok(Response::new(api::ListSessionsResult { sessions }))
    }

    async fn get_session(&self, req: Request<api::SessionRef>) -> Result<Response<api::SessionInfo>, Status> {
        let s = self.core.session(Some(req.get_ref())).await?;
        Ok(Response::new(self.core.session_info(&s).await?))
    }

    async fn get_transcript(
        &self,
        req: Request<api::GetTranscriptRequest>,
    ) -> Result<Response<api::GetTranscriptResult>, Status> {
        let r = req.into_inner();
        let s = self.core.session(r.session.as_ref()).await?;
        let branch = self.core.store.branch(&s.session_id).await.map_err(CoreError::from)?;
        let entries = if r.visible_only { visible_entries(&branch) } else { branch };
        Ok(Response::new(api::GetTranscriptResult { session: Some(self.core.session_info(&s).await?), entries }))
    }

    async fn new_session(&self, req: Request<api::SessionRef>) -> Result<Response<api::SessionInfo>, Status> {
        let (agent, key) = session_ref(Some(req.get_ref()))?;
        let s = self.core.store.replace_session(&agent, &key, false).await.map_err(CoreError::from)?;
        Ok(Response::new(self.core.session_info(&s).await?))
    }

    async fn reset_session(&self, req: Request<api::SessionRef>) -> Result<Response<api::SessionInfo>, Status> {
        let (agent, key) = session_ref(Some(req.get_ref()))?;
        let s = self.core.store.replace_session(&agent, &key, true).await.map_err(CoreError::from)?;
        Ok(Response::new(self.core.session_info(&s).await?))
    }

    async fn delete_session(
        &self,
        req: Request<api::SessionRef>,
    ) -> Result<Response<api::DeleteSessionResult>, Status> {
        let (agent, key) = session_ref(Some(req.get_ref()))?;
        self.core.abort(&agent, &key).await?;
        let n = self.core.store.delete_sessions(&agent, &key).await.map_err(CoreError::from)?;
        if n == 0 {
            return Err(CoreError::NoSession(key).into());
        }
        Ok(Response::new(api::DeleteSessionResult { deleted_sessions: n }))
    }

    async fn get_status(&self, _req: Request<api::StatusRequest>) -> Result<Response<api::StatusResult>, Status> {
        let c = &self.core;
        let registry = c.registry();
        Ok(Response::new(api::StatusResult {
            version: env!("CARGO_PKG_VERSION").into(),
            model_provider: format!("{:?}", c.config.models.provider).to_lowercase(),
            model: c.provider.model().into(),
            context_window: c.config.models.context_window,
            selected_engine: registry.selected_id().into(),
            engines: registry.status(),
            sessions: c.store.count_sessions().await.map_err(CoreError::from)?,
            turns_in_flight: c.turns_in_flight(),
        }))
    }

    async fn spawn_subagent(
        &self,
        req: Request<api::SpawnSubagentRequest>,
    ) -> Result<Response<api::SpawnSubagentResult>, Status> {
        let cancel = self.core.call_token();
        let _guard = cancel.clone().drop_guard();
        Ok(Response::new(self.core.spawn_subagent(req.into_inner(), cancel).await?))
    }

    async fn end_subagent(
        &self,
        req: Request<api::EndSubagentRequest>,
    ) -> Result<Response<api::EndSubagentResult>, Status> {
        let r = req.into_inner();
        let (agent, key) = session_ref(r.child.as_ref())?;
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
        let readmitted = self.core.registry().readmit(&id).ok_or(CoreError::NoEngine(id))?;
        Ok(Response::new(api::ReadmitEngineResult { readmitted }))
    }
}

/// The entries behind the visible history, in the order the model sees
/// them: the latest compaction entry, then the kept and later messages.
pub(crate) fn visible_entries(
    branch: &[ctxgate_proto::pb::TranscriptEntry],
) -> Vec<ctxgate_proto::pb::TranscriptEntry> {
    let v = transcript::visible(branch);
    let kept: std::collections::HashSet<&str> = v.messages.iter().map(|m| m.id.as_str()).collect();
    let summary = v.summary.as_ref().and_then(|(id, _)| branch.iter().find(|e| &e.id == id));
    summary.into_iter().chain(branch.iter().filter(|e| kept.contains(e.id.as_str()))).cloned().collect()
}
