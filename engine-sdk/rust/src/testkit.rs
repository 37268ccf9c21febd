//! Test an engine in-process: [`TestEngine`] serves it on loopback with the
//! real server (validation, health, reflection), [`TestHost`] plays the
//! gateway's `Host` service with real grants, and [`msg`] builds messages.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

use crate::pb::{self, context_engine_client::ContextEngineClient, host_server};
use crate::{ContextEngine, Server};
use ctxgate_runtime::endpoint::Endpoint;
use ctxgate_runtime::{connect, engine_client};

/// An engine served on `127.0.0.1:0` by the real SDK server.
pub struct TestEngine {
    pub endpoint: String,
    pub client: ContextEngineClient<Channel>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), tonic::transport::Error>>,
}

impl TestEngine {
    pub async fn start<E: ContextEngine>(engine: E) -> std::io::Result<Self> {
        Self::start_server(Server::new(engine)).await
    }

    /// [`TestEngine::start`] with a server built by the caller (a host
    /// policy, a call limit).
    pub async fn start_server<E: ContextEngine>(server: Server<E>) -> std::io::Result<Self> {
        let bound =
            server.drain_timeout(Duration::from_secs(2)).bind(&Endpoint::Tcp(([127, 0, 0, 1], 0).into())).await?;
        let endpoint = format!("http://{}", bound.local_endpoint());
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(bound.serve(async {
            let _ = stopped.await;
        }));
        let channel = connect(&endpoint).map_err(std::io::Error::other)?;
        Ok(Self { client: engine_client(channel), endpoint, stop: Some(stop), task })
    }

    /// Drains and stops the server.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = (&mut self.task).await;
    }
}

impl Drop for TestEngine {
    fn drop(&mut self) {
        self.task.abort();
    }
}

type Responder = dyn Fn(&pb::LlmCompleteRequest) -> Result<String, Status> + Send + Sync;

#[derive(Default)]
struct HostState {
    transcripts: Mutex<HashMap<String, Vec<pb::TranscriptEntry>>>,
    grants: Mutex<HashMap<String, pb::Grant>>,
    llm_calls: Mutex<Vec<pb::LlmCompleteRequest>>,
    responder: Mutex<Option<Arc<Responder>>>,
    llm_delay: Mutex<Duration>,
}

/// A `Host` service on loopback with real grant checks: a token is valid
/// only for its session, its operations and until it expires.
pub struct TestHost {
    pub endpoint: String,
    state: Arc<HostState>,
    task: JoinHandle<Result<(), tonic::transport::Error>>,
}

impl TestHost {
    pub async fn start() -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let endpoint = format!("http://{}", listener.local_addr()?);
        let state = Arc::new(HostState::default());
        let svc = host_server::HostServer::new(HostSvc { state: state.clone() });
        let task = tokio::spawn(
            ctxgate_runtime::server()
                .add_service(svc)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        Ok(Self { endpoint, state, task })
    }

    /// Issues a grant for `session_id` allowing `operations` for `ttl`.
    pub fn grant(&self, session_id: &str, operations: &[&str], ttl: Duration) -> pb::HostAccess {
        let n = self.state.grants.lock().map(|g| g.len()).unwrap_or_default();
        let expires = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default() + ttl;
        let grant = pb::Grant {
            token: format!("test-grant-{n}-{session_id}"),
            session_id: session_id.to_owned(),
            operations: operations.iter().map(|s| (*s).to_owned()).collect(),
            expires_at_unix_ms: expires.as_millis() as i64,
        };
        lock(&self.state.grants).insert(grant.token.clone(), grant.clone());
        pb::HostAccess { endpoint: self.endpoint.clone(), grant: Some(grant) }
    }

    /// Sets the transcript `ReadTranscript` serves for a session.
    pub fn set_transcript(&self, session_id: &str, entries: Vec<pb::TranscriptEntry>) {
        lock(&self.state.transcripts).insert(session_id.to_owned(), entries);
    }

    /// How `LlmComplete` answers; without one it answers UNAVAILABLE.
    pub fn on_llm(&self, f: impl Fn(&pb::LlmCompleteRequest) -> Result<String, Status> + Send + Sync + 'static) {
        *lock(&self.state.responder) = Some(Arc::new(f));
    }

    /// Makes every `LlmComplete` take `delay` before answering (a slow model).
    pub fn set_llm_delay(&self, delay: Duration) {
        *lock(&self.state.llm_delay) = delay;
    }

    /// Every accepted `LlmComplete` request so far.
    pub fn llm_calls(&self) -> Vec<pb::LlmCompleteRequest> {
        lock(&self.state.llm_calls).clone()
    }
}

impl Drop for TestHost {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

struct HostSvc {
    state: Arc<HostState>,
}

impl HostSvc {
    fn authorise(&self, token: &str, session_id: Option<&str>, op: &str) -> Result<pb::Grant, Status> {
        if token.is_empty() {
            return Err(Status::unauthenticated("grant is required"));
        }
        let grant =
            lock(&self.state.grants).get(token).cloned().ok_or_else(|| Status::unauthenticated("unknown grant"))?;
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as i64;
        if grant.expires_at_unix_ms <= now {
            return Err(Status::permission_denied("grant expired"));
        }
        if session_id.is_some_and(|s| s != grant.session_id) {
            return Err(Status::permission_denied("grant is for another session"));
        }
        if !grant.operations.iter().any(|o| o == op) {
            return Err(Status::permission_denied(format!("grant does not allow {op}")));
        }
        Ok(grant)
    }
}

type ChunkStream = std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::TranscriptChunk, Status>> + Send>>;

#[tonic::async_trait]
impl host_server::Host for HostSvc {
    type ReadTranscriptStream = ChunkStream;

    async fn read_transcript(&self, req: Request<pb::ReadTranscriptRequest>) -> Result<Response<ChunkStream>, Status> {
        let r = req.into_inner();
        self.authorise(&r.grant, Some(&r.session_id), crate::READ_TRANSCRIPT)?;
        let entries = lock(&self.state.transcripts).get(&r.session_id).cloned().unwrap_or_default();
        let chunks: Vec<_> = entries
            .chunks(64)
            .map(|c| Ok(pb::TranscriptChunk { entries: c.to_vec(), next_cursor: String::new() }))
            .collect();
        Ok(Response::new(Box::pin(tokio_stream::iter(chunks))))
    }

    async fn llm_complete(
        &self,
        req: Request<pb::LlmCompleteRequest>,
    ) -> Result<Response<pb::LlmCompleteResult>, Status> {
        let r = req.into_inner();
        let grant = self.authorise(&r.grant, None, crate::LLM_COMPLETE)?;
        let responder =
            lock(&self.state.responder).clone().ok_or_else(|| Status::unavailable("no model configured"))?;
        let delay = *lock(&self.state.llm_delay);
        tokio::time::sleep(delay).await;
        let text = responder(&r)?;
        lock(&self.state.llm_calls).push(r.clone());
        Ok(Response::new(pb::LlmCompleteResult {
            text,
            provider: "testkit".into(),
            model: "testkit".into(),
            audit: Some(pb::LlmAudit {
                caller: "context-engine".into(),
                purpose: r.purpose,
                session_key: grant.session_id,
            }),
            ..Default::default()
        }))
    }
}

/// Message builders for tests.
pub mod msg {
    use crate::pb::{AgentMessage, ContentPart, Role, ToolCall, ToolResult, content_part::Part};

    fn message(id: &str, role: Role, part: Part) -> AgentMessage {
        AgentMessage {
            id: id.into(),
            role: role as i32,
            content: vec![ContentPart { part: Some(part) }],
            ..Default::default()
        }
    }

    pub fn user(id: &str, text: &str) -> AgentMessage {
        message(id, Role::User, Part::Text(text.into()))
    }

    pub fn assistant(id: &str, text: &str) -> AgentMessage {
        message(id, Role::Assistant, Part::Text(text.into()))
    }

    pub fn tool_call(id: &str, call_id: &str, name: &str) -> AgentMessage {
        message(
            id,
            Role::Assistant,
            Part::ToolCall(ToolCall { id: call_id.into(), name: name.into(), arguments_json: "{}".into() }),
        )
    }

    pub fn tool_result(id: &str, call_id: &str, text: &str) -> AgentMessage {
        message(
            id,
            Role::Tool,
            Part::ToolResult(ToolResult {
                tool_call_id: call_id.into(),
                tool_name: String::new(),
                text: text.into(),
                is_error: false,
            }),
        )
    }

    /// The text of every text and tool-result part, joined.
    pub fn text_of(m: &AgentMessage) -> String {
        m.content
            .iter()
            .filter_map(|p| match &p.part {
                Some(Part::Text(t)) => Some(t.as_str()),
                Some(Part::ToolResult(r)) => Some(r.text.as_str()),
                _ => None,
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}
