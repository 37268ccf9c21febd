//! The turn core: one turn lifecycle ([`Turn`]) with two drivers (the
//! managed `RunTurn` loop and an external harness), compaction, subagents
//! and durable turns, independent of the APIs that drive them. The core
//! speaks its own types ([`types`]) and the engine contract; the client
//! protos stay in the adapters.

pub mod admission;
mod claims;
mod compact;
mod history;
mod lease;
mod managed;
mod outbox;
mod sessions;
mod subagents;
mod turn;
pub mod types;

use std::collections::HashSet;
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::Duration;

use ctxgate_proto::pb::{self, AgentMessage, ContentPart, Role, content_part::Part, transcript_entry::Entry};
use ctxgate_proto::{Method, estimate, limits};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::compaction::{self, CompactionError};
use crate::config::{Config, IdentifierPolicy, ProviderKind};
use crate::engines::registry::Registry;
use crate::engines::{Call, CompactReply, Engine, EngineCallError, LEGACY_ID};
use crate::grants::{GrantError, GrantGuard, Grants, HostOperation, Scope};
use crate::metrics::Metrics;
use crate::provider::{ChatRequest, ChatResponse, ModelError, ModelProvider};
use crate::store::{NewEntry, Session, SessionStats, Store, StoreError, Subagent};
use crate::summarize::{Extractive, ModelSummarizer, Summarizer};
use crate::transcript::{self, Visible};

use claims::Held;
pub use managed::{ManagedTurn, TurnEnd};
pub use outbox::EngineState;
pub use sessions::BusyError;
use sessions::{SessionGuard, SessionLocks};
pub use turn::{Begun, Finished, StepError, Turn, check_client_message};
use types::*;

/// Errors the API maps to statuses (before a turn is admitted, for a
/// harness step, and for every non-turn call).
#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    #[error("{field}: {problem}")]
    Invalid { field: String, problem: String },
    #[error("{field}: {problem}")]
    TooLarge { field: String, problem: String },
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
    Busy(#[from] BusyError),
    /// Over the admission limit (`core::admission`): shed at once.
    #[error("the gateway is at its limit of {} concurrent turns; retry in {} ms", .0.limit, .0.retry_after.as_millis())]
    Overloaded(admission::Shed),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl CoreError {
    pub fn invalid(field: impl Into<String>, problem: impl Into<String>) -> Self {
        Self::Invalid { field: field.into(), problem: problem.into() }
    }

    pub fn too_large(field: impl Into<String>, problem: impl Into<String>) -> Self {
        Self::TooLarge { field: field.into(), problem: problem.into() }
    }

    /// The same error with its field under `parent` (`parent.field`).
    pub fn under(self, parent: &str) -> Self {
        match self {
            Self::Invalid { field, problem } => Self::Invalid { field: format!("{parent}.{field}"), problem },
            Self::TooLarge { field, problem } => Self::TooLarge { field: format!("{parent}.{field}"), problem },
            other => other,
        }
    }
}

impl From<ctxgate_proto::validate::Violation> for CoreError {
    fn from(v: ctxgate_proto::validate::Violation) -> Self {
        match v.kind {
            ctxgate_proto::validate::ViolationKind::Invalid => Self::Invalid { field: v.field, problem: v.problem },
            ctxgate_proto::validate::ViolationKind::TooLarge => Self::TooLarge { field: v.field, problem: v.problem },
        }
    }
}

/// Overflow compactions before the gateway gives up on compacting.
const MAX_OVERFLOW_COMPACTIONS: u32 = 3;
const MAX_TIMEOUT_COMPACTIONS: u32 = 2;
/// Timeout recovery only compacts when the prompt is above this share of the budget.
const TIMEOUT_COMPACTION_SHARE: f64 = 0.65;
/// Tool results are cut to this many characters by the last-resort truncation.
const TRUNCATED_TOOL_RESULT_CHARS: usize = 2_000;
/// (engine, session) pairs remembered as bootstrapped before the set starts over.
const MAX_BOOTSTRAPPED: usize = 65_536;
/// How long a host grant lives when the call has no tighter deadline.
const GRANT_TTL: Duration = Duration::from_secs(600);

/// Old entry id → new, after a maintenance rewrite copied a branch.
type Remap = std::collections::HashMap<String, String>;

/// Where compaction events go: to a turn's events or a Compact stream.
pub type CompactionSink<'a> = dyn Fn(CompactionEvent) + Send + Sync + 'a;

pub struct Core {
    config: Arc<Config>,
    store: Arc<dyn Store>,
    provider: Arc<dyn ModelProvider>,
    metrics: Metrics,
    grants: Arc<Grants>,
    registry: RwLock<Arc<Registry>>,
    /// Where engines reach the Host service (set once the API is bound).
    host_endpoint: OnceLock<String>,
    summarizer: Arc<dyn Summarizer>,
    /// One turn or compaction at a time per session, and Abort.
    sessions: Arc<SessionLocks>,
    /// (engine, session) pairs bootstrapped by this process.
    bootstrapped: Mutex<Forgetful<(String, String)>>,
    /// Engines known to be durable (their last attach said so; kept in the
    /// store), so turns legacy serves before an attach still reach them.
    durable: Mutex<HashSet<String>>,
    /// One permit per turn taken (`gateway.limits.maxConcurrentTurns`).
    admission: Arc<admission::Admission>,
    /// Background maintenance: sessions with a run going, and whether a
    /// follow-up is queued.
    maintenance: Arc<Mutex<std::collections::HashMap<String, bool>>>,
    shutdown: CancellationToken,
}

/// The engine a turn (or a manual compaction) runs with: pinned once
/// chosen, so a turn is never replayed on another engine.
#[derive(Clone)]
struct Lease {
    /// The registry id (`plugins.entries` key) or "legacy".
    key: String,
    engine: Arc<dyn Engine>,
    info: pb::EngineInfo,
    /// The degradation warning, when the configured engine could not take it.
    degraded: Option<String>,
    remote: bool,
    /// The durable engine whose record gets this turn through the outbox,
    /// whichever engine serves it: a turn served by legacy while the
    /// engine was quarantined (or degraded) still reaches it, in order.
    record: Option<String>,
    /// Who runs the operation, and against which model.
    host: HostProfile,
    model: ModelSpec,
}

impl Lease {
    fn selection(&self) -> Selection {
        match (&self.degraded, self.remote) {
            (Some(_), _) => Selection::Degraded,
            (None, true) => Selection::Configured,
            (None, false) => Selection::Default,
        }
    }
}

/// What to do when the configured engine's host requirements are not met.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unmet {
    /// Serve the operation on legacy, with OpenClaw's degrade warning.
    Degrade,
    /// Refuse it before anything is admitted (harness turns, spawns).
    FailClosed,
}

/// A set bounded by starting over when full: for "seen before" facts whose
/// loss costs only a repeated idempotent call (a Bootstrap), never memory.
struct Forgetful<T> {
    set: HashSet<T>,
    cap: usize,
}

impl<T: std::hash::Hash + Eq> Forgetful<T> {
    fn new(cap: usize) -> Self {
        Self { set: HashSet::new(), cap: cap.max(1) }
    }

    /// True the first time `key` is seen (since the last start-over).
    fn first_time(&mut self, key: T) -> bool {
        if self.set.len() >= self.cap && !self.set.contains(&key) {
            tracing::info!(entries = self.set.len(), "bounded set full; starting over");
            self.set.clear();
        }
        self.set.insert(key)
    }

    fn clear(&mut self) {
        self.set.clear();
    }
}

fn now_unix_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

fn text_message(role: Role, text: String) -> AgentMessage {
    AgentMessage {
        role: role as i32,
        content: vec![ContentPart { part: Some(Part::Text(text)) }],
        created_at_unix_ms: now_unix_ms(),
        ..Default::default()
    }
}

/// Validates a session reference; returns (agent, key).
pub fn session_ref(agent_id: &str, session_key: &str) -> Result<(String, String), CoreError> {
    let key = session_key.trim();
    if key.is_empty() {
        return Err(CoreError::invalid("session.session_key", "is required"));
    }
    if key.len() > limits::MAX_ID_BYTES || agent_id.len() > limits::MAX_ID_BYTES {
        return Err(CoreError::too_large("session", format!("ids are limited to {} bytes", limits::MAX_ID_BYTES)));
    }
    let agent = if agent_id.trim().is_empty() { "main" } else { agent_id.trim() };
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
        let admission = Arc::new(admission::Admission::new(&config.gateway.limits));
        Self {
            config,
            store,
            provider,
            metrics,
            grants: Arc::default(),
            registry,
            host_endpoint: OnceLock::new(),
            summarizer,
            sessions: Arc::default(),
            bootstrapped: Mutex::new(Forgetful::new(MAX_BOOTSTRAPPED)),
            durable: Mutex::default(),
            admission,
            maintenance: Arc::default(),
            shutdown: CancellationToken::new(),
        }
    }

    pub fn config(&self) -> &Config {
        &self.config
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
        self.sessions.running() as u32
    }

    /// The admission limit now (it follows latency).
    pub fn turn_limit(&self) -> u32 {
        self.admission.load().1 as u32
    }

    pub fn turns_queued(&self) -> u32 {
        self.sessions.queued() as u32
    }

    /// The gateway's own model, as a turn sees it.
    fn provider_model(&self) -> ModelSpec {
        ModelSpec {
            id: self.provider.model().to_owned(),
            provider: self.provider_name(),
            context_window: self.config.models.context_window,
            reserve_tokens: self.config.reserve_tokens(),
            max_output_tokens: self.config.models.max_output_tokens,
        }
    }

    /// Loads the engines known to be durable (call once at start).
    pub async fn load_durable_engines(&self) -> Result<(), CoreError> {
        let known = self.store.durable_engines().await?;
        self.durable.lock().unwrap_or_else(|e| e.into_inner()).extend(known);
        Ok(())
    }

    /// Whether `engine` takes durable turns: from its attach when it has
    /// one (remembered in the store when that changes), else from the last
    /// one remembered.
    fn durable_engine(&self, engine: &crate::engines::replicas::Replicas) -> bool {
        let id = engine.id();
        let mut known = self.durable.lock().unwrap_or_else(|e| e.into_inner());
        let Some(info) = engine.attached_info() else { return known.contains(id) };
        let durable = crate::engines::durable(&info);
        if durable != known.contains(id) {
            if durable {
                known.insert(id.to_owned());
            } else {
                known.remove(id);
            }
            let (store, id) = (self.store.clone(), id.to_owned());
            tokio::spawn(async move {
                if let Err(e) = store.set_durable(&id, durable).await {
                    tracing::warn!(engine = id, error = %e, "remembering the engine's durability failed");
                }
            });
        }
        durable
    }

    /// The embedded offline model (no real model configured).
    pub fn model_is_offline(&self) -> bool {
        self.provider.kind() == ProviderKind::Offline
    }

    pub fn provider_name(&self) -> String {
        format!("{:?}", self.config.models.provider).to_lowercase()
    }

    pub fn model_id(&self) -> &str {
        self.provider.model()
    }

    /// The reply reserve for a model with `window` tokens: the configured
    /// `reserveTokens`, else a quarter of the window up to 16 384.
    pub fn reserve_for(&self, window: u64) -> u64 {
        self.config.agents.defaults.compaction.reserve_tokens.unwrap_or_else(|| (window / 4).min(16_384))
    }

    /// Waits for the session (Enqueue: the caller's cancel ends the wait)
    /// for work that is not a turn. `bounded`: a client's (manual
    /// compaction) waits in the session's bounded queue; the gateway's own
    /// (the outbox, background maintenance) is bounded by construction.
    async fn enter(&self, session_id: &str, cancel: &CancellationToken, bounded: bool) -> Result<Held, CoreError> {
        let limit = bounded.then_some(self.config.gateway.limits.queued_turns_per_session);
        self.hold(session_id, cancel, BusyPolicy::Enqueue, limit).await
    }

    /// Fires the running turn's or compaction's token (on a shared store,
    /// also another gateway's, at its next lease renewal). True if one ran.
    pub async fn abort(&self, agent: &str, key: &str) -> Result<bool, CoreError> {
        let Some(s) = self.store.session(agent, key, false).await? else { return Ok(false) };
        Ok(self.sessions.abort(&s.session_id) || self.store.interrupt_holder(&s.session_id).await?)
    }

    async fn visible(&self, session_id: &str) -> Result<Visible, CoreError> {
        Ok(transcript::visible(&self.store.visible_tail(session_id).await?))
    }

    // --- sessions ------------------------------------------------------------

    pub async fn session(&self, agent: &str, key: &str) -> Result<Session, CoreError> {
        let (agent, key) = session_ref(agent, key)?;
        self.store.session(&agent, &key, false).await?.ok_or(CoreError::NoSession(key))
    }

    /// A session's branch, or only the entries behind its visible history.
    pub async fn transcript(
        &self,
        session_id: &str,
        visible_only: bool,
    ) -> Result<Vec<pb::TranscriptEntry>, CoreError> {
        let branch = self.store.branch(session_id).await?;
        Ok(if visible_only { transcript::visible_entries(&branch) } else { branch })
    }

    /// Entries on the branch, compactions among them, and visible tokens.
    pub async fn session_counts(&self, s: &Session) -> Result<(u32, u32, u64), CoreError> {
        let branch = self.store.branch(&s.session_id).await?;
        let compactions = branch.iter().filter(|e| matches!(e.entry, Some(Entry::Compaction(_)))).count() as u32;
        Ok((branch.len() as u32, compactions, transcript::visible(&branch).tokens()))
    }

    pub async fn list_sessions(
        &self,
        agent: Option<&str>,
        include_archived: bool,
        offset: u64,
        limit: u32,
    ) -> Result<Vec<SessionStats>, CoreError> {
        Ok(self.store.list_sessions(agent, include_archived, offset, limit).await?)
    }

    /// `/new` (archive = false) or `/reset` (archive = true).
    pub async fn replace_session(&self, agent: &str, key: &str, archive: bool) -> Result<Session, CoreError> {
        let (agent, key) = session_ref(agent, key)?;
        Ok(self.store.replace_session(&agent, &key, archive).await?)
    }

    /// Aborts what runs and deletes every session of the key with its
    /// queued commits; then tells the engines that saw it to forget it.
    pub async fn delete_sessions(&self, agent: &str, key: &str) -> Result<u32, CoreError> {
        let (agent, key) = session_ref(agent, key)?;
        self.abort(&agent, &key).await?;
        let cancel = self.call_token();
        // Under every session's lock: no turn or delivery of the key runs
        // while its rows go, so nothing reaches an engine after its forget.
        let ids = self.store.session_ids(&agent, &key).await?;
        let mut guards = Vec::new();
        for session_id in &ids {
            guards.push(self.enter(session_id, &cancel, false).await?);
        }
        let deleted = self.store.delete_sessions(&agent, &key).await?;
        drop(guards);
        if deleted == 0 {
            return Err(CoreError::NoSession(key));
        }
        // This delete's forgets, best effort now (others' wait for the
        // background pass, which also retries these).
        if let Err(e) = self.deliver_forgets(Some(&ids)).await {
            tracing::warn!(error = %e, "ForgetSession delivery failed; retried in the background");
        }
        Ok(deleted)
    }

    pub async fn count_sessions(&self) -> Result<u32, CoreError> {
        Ok(self.store.count_sessions().await?)
    }

    // --- host callbacks ------------------------------------------------------

    /// The scope of a host callback's grant.
    pub fn authorise(&self, token: &str, session_id: Option<&str>, op: HostOperation) -> Result<Scope, GrantError> {
        self.grants.authorise(token, session_id, op)
    }

    /// A model request on an engine's behalf (Host.LlmComplete).
    pub async fn complete_for_engine(
        &self,
        scope: &Scope,
        purpose: &str,
        mut chat: ChatRequest,
        cancel: &CancellationToken,
    ) -> Result<ChatResponse, ModelError> {
        tracing::info!(engine = %scope.engine_id, session = %scope.session_id, purpose, "host model call for a context engine");
        self.metrics.host_llm_call(&scope.engine_id, purpose);
        chat.max_tokens = chat.max_tokens.min(self.config.models.max_output_tokens);
        self.provider.complete(chat, None, cancel).await
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

#[cfg(test)]
mod tests {
    use super::Forgetful;

    #[test]
    fn a_forgetful_set_never_grows_past_its_cap() {
        let mut seen = Forgetful::new(3);
        assert!(seen.first_time(1) && seen.first_time(2) && seen.first_time(3));
        assert!(!seen.first_time(2), "seen");
        assert!(seen.first_time(4), "full: starts over with 4");
        assert_eq!(seen.set.len(), 1);
        assert!(seen.first_time(1), "1 was forgotten: one more Bootstrap, no unbounded memory");
        for i in 0..1000 {
            seen.first_time(i);
            assert!(seen.set.len() <= 3);
        }
    }
}
