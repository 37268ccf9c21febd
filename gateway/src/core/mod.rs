//! The turn core: managed turns and compaction for one gateway, independent
//! of the API that drives them. Events go out through a channel; the caller
//! going away cancels the work.

mod compact;
mod lease;
mod outbox;
mod subagents;
mod turn;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::Duration;

use ctxgate_proto::gateway as api;
use ctxgate_proto::pb::{self, AgentMessage, ContentPart, Role, content_part::Part, transcript_entry::Entry};
use ctxgate_proto::{estimate, limits};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::compaction::{self, CompactionError, Outcome};
use crate::config::{Config, IdentifierPolicy, ProviderKind};
use crate::engines::registry::Registry;
use crate::engines::{
    Call, CompactReply, EMBEDDED_HOST_CAPABILITIES, EMBEDDED_HOST_LABEL, Engine, EngineCallError, LEGACY_ID,
    check_host_requirements,
};
use crate::host::{GrantGuard, Grants, LLM_COMPLETE, READ_TRANSCRIPT, Scope};
use crate::metrics::Metrics;
use crate::provider::{ChatRequest, ModelError, ModelProvider};
use crate::store::{NewEntry, Session, Store, StoreError, Subagent};
use crate::summarize::{Extractive, ModelSummarizer, Summarizer};
use crate::transcript::{self, Visible};

/// Errors the API maps to statuses (before a turn is admitted, and for
/// every non-turn call).
#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    #[error("{field}: {problem}")]
    Invalid { field: &'static str, problem: String },
    #[error("{field}: {problem}")]
    TooLarge { field: &'static str, problem: String },
    #[error("no session with key {0:?}")]
    NoSession(String),
    #[error("compaction timed out: {0}")]
    CompactionTimeout(String),
    #[error("compaction failed: {0}")]
    CompactionFailed(String),
    #[error("aborted")]
    Aborted,
    #[error("no engine {0:?} is configured")]
    NoEngine(String),
    #[error("{0}")]
    Precondition(String),
    #[error("{0}")]
    EngineFailed(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Overflow compactions before the gateway tries truncating tool results.
const MAX_OVERFLOW_COMPACTIONS: u32 = 3;
const MAX_TIMEOUT_COMPACTIONS: u32 = 2;
/// Timeout recovery only compacts when the prompt is above this share of the budget.
const TIMEOUT_COMPACTION_SHARE: f64 = 0.65;
/// Tool results are cut to this many characters by the last-resort truncation.
const TRUNCATED_TOOL_RESULT_CHARS: usize = 2_000;
/// How long a host grant lives when the call has no tighter deadline.
const GRANT_TTL: Duration = Duration::from_secs(600);

/// Where compaction events go: to a turn's event stream or a Compact stream.
pub type CompactionSink<'a> = dyn Fn(api::compaction_event::Event) + Send + Sync + 'a;

pub struct Core {
    pub config: Arc<Config>,
    pub store: Arc<dyn Store>,
    pub provider: Arc<dyn ModelProvider>,
    pub metrics: Metrics,
    pub grants: Arc<Grants>,
    registry: RwLock<Arc<Registry>>,
    /// Where engines reach the Host service (set once the API is bound).
    host_endpoint: OnceLock<String>,
    summarizer: Arc<dyn Summarizer>,
    /// Per session: serialises its turns and compactions, and holds the
    /// token that Abort fires.
    running: Mutex<HashMap<String, Running>>,
    /// (engine, session) pairs bootstrapped by this process.
    bootstrapped: Mutex<HashSet<(String, String)>>,
    /// Background maintenance: sessions with a run going, and whether a
    /// follow-up is queued.
    maintenance: Arc<Mutex<HashMap<String, bool>>>,
    shutdown: CancellationToken,
}

struct Running {
    lock: Arc<tokio::sync::Mutex<()>>,
    cancel: Option<CancellationToken>,
}

/// Holds a session's lock; registers the work's cancel token for Abort.
struct SessionGuard<'a> {
    core: &'a Core,
    session_id: String,
    _lock: tokio::sync::OwnedMutexGuard<()>,
}

impl Drop for SessionGuard<'_> {
    fn drop(&mut self) {
        let mut running = self.core.running.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(r) = running.get_mut(&self.session_id) {
            r.cancel = None;
            // Only the map and this guard hold the lock: nobody waits, forget it.
            if Arc::strong_count(&r.lock) <= 2 {
                running.remove(&self.session_id);
            }
        }
    }
}

/// The engine a turn (or a manual compaction) runs with: pinned once
/// chosen, so a turn is never replayed on another engine.
struct Lease {
    /// The registry id (`plugins.entries` key) or "legacy".
    key: String,
    engine: Arc<dyn Engine>,
    info: pb::EngineInfo,
    /// The degradation warning, when the configured engine could not take it.
    degraded: Option<String>,
    remote: bool,
}

fn text_message(role: Role, text: String) -> AgentMessage {
    AgentMessage {
        role: role as i32,
        content: vec![ContentPart { part: Some(Part::Text(text)) }],
        created_at_unix_ms: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as i64),
        ..Default::default()
    }
}

fn event(e: api::turn_event::Event) -> api::TurnEvent {
    api::TurnEvent { event: Some(e) }
}

fn failed(reason: &str, message: impl Into<String>) -> api::turn_event::Event {
    api::turn_event::Event::Failed(api::Failed { reason: reason.into(), message: message.into() })
}

fn aborted() -> api::turn_event::Event {
    failed("aborted", "The turn was aborted.")
}

/// Validates a turn request; returns (agent, key).
pub fn validate_turn(req: &api::RunTurnRequest) -> Result<(String, String), CoreError> {
    let at = session_ref(req.session.as_ref())?;
    if req.message.trim().is_empty() {
        return Err(CoreError::Invalid { field: "message", problem: "is empty".into() });
    }
    if req.message.len() > limits::MAX_MESSAGE_CONTENT_BYTES {
        return Err(CoreError::TooLarge {
            field: "message",
            problem: format!("is {} bytes, the limit is {}", req.message.len(), limits::MAX_MESSAGE_CONTENT_BYTES),
        });
    }
    Ok(at)
}

/// Validates a session reference; returns (agent, key).
pub fn session_ref(r: Option<&api::SessionRef>) -> Result<(String, String), CoreError> {
    let r = r.ok_or(CoreError::Invalid { field: "session", problem: "is required".into() })?;
    let key = r.session_key.trim();
    if key.is_empty() {
        return Err(CoreError::Invalid { field: "session.session_key", problem: "is required".into() });
    }
    if key.len() > limits::MAX_ID_BYTES || r.agent_id.len() > limits::MAX_ID_BYTES {
        return Err(CoreError::TooLarge {
            field: "session",
            problem: format!("ids are limited to {} bytes", limits::MAX_ID_BYTES),
        });
    }
    let agent = if r.agent_id.trim().is_empty() { "main" } else { r.agent_id.trim() };
    Ok((agent.to_owned(), key.to_owned()))
}

impl Core {
    /// Builds the core and its engine registry (starts health monitors:
    /// call inside a tokio runtime).
    pub fn new(config: Arc<Config>, store: Arc<dyn Store>, provider: Arc<dyn ModelProvider>, metrics: Metrics) -> Self {
        let summarizer: Arc<dyn Summarizer> = match provider.kind() {
            ProviderKind::Offline => Arc::new(Extractive),
            ProviderKind::Openai => Arc::new(ModelSummarizer { provider: provider.clone(), max_tokens: 2_048 }),
        };
        let registry = RwLock::new(Arc::new(Registry::build(&config, &metrics)));
        Self {
            config,
            store,
            provider,
            metrics,
            grants: Arc::default(),
            registry,
            host_endpoint: OnceLock::new(),
            summarizer,
            running: Mutex::default(),
            bootstrapped: Mutex::default(),
            maintenance: Arc::default(),
            shutdown: CancellationToken::new(),
        }
    }

    /// Where engines call the Host service back (set once, after binding).
    pub fn set_host_endpoint(&self, endpoint: String) {
        let _ = self.host_endpoint.set(endpoint);
    }

    pub fn registry(&self) -> Arc<Registry> {
        self.registry.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Applies the engine part of a new configuration: new clients and
    /// monitors, quarantines cleared, the slot re-resolved (an entry that
    /// is gone resets it to legacy). Turns in flight keep their lease.
    pub fn reload_engines(&self, config: &Config) {
        let next = Arc::new(Registry::build(config, &self.metrics));
        *self.registry.write().unwrap_or_else(|e| e.into_inner()) = next;
        self.bootstrapped.lock().unwrap_or_else(|e| e.into_inner()).clear();
        tracing::info!(selected = %self.registry().selected_id(), "engine configuration reloaded");
    }

    /// A token for one API call: fired when the caller goes away (the API
    /// cancels it) or when the gateway shuts down.
    pub fn call_token(&self) -> CancellationToken {
        self.shutdown.child_token()
    }

    /// Cancels every running turn, compaction and maintenance run.
    pub fn shutdown(&self) {
        self.shutdown.cancel();
    }

    pub fn turns_in_flight(&self) -> u32 {
        self.running.lock().unwrap_or_else(|e| e.into_inner()).values().filter(|r| r.cancel.is_some()).count() as u32
    }

    /// Waits for the session's lock, then registers `cancel` for Abort.
    async fn enter(&self, session_id: &str, cancel: &CancellationToken) -> SessionGuard<'_> {
        let lock = {
            let mut running = self.running.lock().unwrap_or_else(|e| e.into_inner());
            running
                .entry(session_id.to_owned())
                .or_insert_with(|| Running { lock: Arc::default(), cancel: None })
                .lock
                .clone()
        };
        let guard = lock.lock_owned().await;
        if let Some(r) = self.running.lock().unwrap_or_else(|e| e.into_inner()).get_mut(session_id) {
            r.cancel = Some(cancel.clone());
        }
        SessionGuard { core: self, session_id: session_id.to_owned(), _lock: guard }
    }

    /// Fires the running turn's or compaction's token. True if one ran.
    pub async fn abort(&self, agent: &str, key: &str) -> Result<bool, CoreError> {
        let Some(s) = self.store.session(agent, key, false).await? else { return Ok(false) };
        let running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        Ok(match running.get(&s.session_id).and_then(|r| r.cancel.as_ref()) {
            Some(c) => {
                c.cancel();
                true
            }
            None => false,
        })
    }

    fn token_budget(&self, system: Option<&str>) -> u64 {
        let m = &self.config.models;
        m.context_window
            .saturating_sub(self.config.reserve_tokens())
            .saturating_sub(system.map_or(0, estimate::text_tokens))
    }

    async fn visible(&self, session_id: &str) -> Result<Visible, CoreError> {
        Ok(transcript::visible(&self.store.visible_tail(session_id).await?))
    }
    // --- sessions ------------------------------------------------------------

    pub async fn session_info(&self, s: &Session) -> Result<api::SessionInfo, CoreError> {
        let branch = self.store.branch(&s.session_id).await?;
        let compactions = branch.iter().filter(|e| matches!(e.entry, Some(Entry::Compaction(_)))).count() as u32;
        Ok(api::SessionInfo {
            agent_id: s.agent_id.clone(),
            session_key: s.session_key.clone(),
            session_id: s.session_id.clone(),
            state: s.state.clone(),
            created_at_unix_ms: s.created_at_ms,
            entries: branch.len() as u32,
            compactions,
            visible_tokens: transcript::visible(&branch).tokens(),
        })
    }

    pub async fn session(&self, r: Option<&api::SessionRef>) -> Result<Session, CoreError> {
        let (agent, key) = session_ref(r)?;
        self.store.session(&agent, &key, false).await?.ok_or(CoreError::NoSession(key))
    }
}

fn target(s: &Session) -> pb::SessionTarget {
    pb::SessionTarget {
        agent_id: Some(s.agent_id.clone()),
        session_id: Some(s.session_id.clone()),
        session_key: Some(s.session_key.clone()),
        store_path: None,
        thread_id: None,
    }
}

/// The last-resort recovery: shortens every long tool result of this
/// prompt (the transcript keeps them whole).
fn truncate_tool_results(messages: &mut [AgentMessage]) {
    for m in messages {
        for p in &mut m.content {
            if let Some(Part::ToolResult(r)) = &mut p.part
                && r.text.chars().count() > TRUNCATED_TOOL_RESULT_CHARS
            {
                let cut: String = r.text.chars().take(TRUNCATED_TOOL_RESULT_CHARS).collect();
                r.text = format!("{cut}\n[… truncated by ctxgate to fit the context window]");
            }
        }
    }
}
