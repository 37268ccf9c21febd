//! The turn core: one turn lifecycle ([`Turn`]) with two drivers (the
//! managed `RunTurn` loop and an external harness), compaction, subagents
//! and durable turns, independent of the APIs that drive them. The core
//! speaks its own types ([`types`]) and the engine contract; the client
//! protos stay in the adapters.

pub mod admission;
mod claims;
mod compact;
mod cursors;
mod engine_lease;
mod error;
mod maintenance;
mod managed;
mod outbox;
mod preview;
mod session_locks;
mod sessions;
mod subagents;
mod turn;
pub mod types;

use std::collections::HashSet;
use std::sync::{Arc, Mutex, OnceLock, RwLock};

use ctxgate_proto::limits;
use ctxgate_proto::pb::{AgentMessage, ContentPart, Role, content_part::Part};
use tokio_util::sync::CancellationToken;

use crate::config::{Config, ProviderKind};
use crate::engines::registry::Registry;
use crate::engines::replicas::Replicas;
use crate::grants::{Callback, GrantError, Grants, HostOperation, LlmSlot, Scope};
use crate::metrics::Metrics;
use crate::provider::{ChatRequest, ChatResponse, ModelError, ModelProvider};
use crate::store::{Session, Store};
use crate::summarize::{Extractive, ModelSummarizer, Summarizer};
use crate::transcript::{self, Visible};

use claims::Held;
pub use error::{CoreError, new_error_id};
pub use managed::{ManagedTurn, TurnEnd};
pub use outbox::{EngineState, HELD};
pub use preview::{Preview, PreviewMessage, is_summary};
pub use session_locks::BusyError;
use session_locks::SessionLocks;
pub use turn::{Begun, Finished, StepError, Turn, check_client_message};
use types::{BusyPolicy, CompactionEvent, ModelSpec};

/// (engine, session) pairs remembered as bootstrapped before the set starts over.
const MAX_BOOTSTRAPPED: usize = 65_536;

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
    locks: Arc<SessionLocks>,
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
    /// One forget delivery at a time: a delete's own pass and the
    /// background pass would otherwise both read, and both send, the same
    /// owed ForgetSession.
    forgets: tokio::sync::Mutex<()>,
    shutdown: CancellationToken,
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
        let grants = Arc::new(Grants::new(config.gateway.limits.host_callbacks));
        Self {
            config,
            store,
            provider,
            metrics,
            grants,
            registry,
            host_endpoint: OnceLock::new(),
            summarizer,
            locks: Arc::default(),
            bootstrapped: Mutex::new(Forgetful::new(MAX_BOOTSTRAPPED)),
            durable: Mutex::default(),
            admission,
            maintenance: Arc::default(),
            forgets: tokio::sync::Mutex::new(()),
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
        self.locks.running() as u32
    }

    /// The admission limit now (it follows latency).
    pub fn turn_limit(&self) -> u32 {
        self.admission.load().1 as u32
    }

    pub fn turns_queued(&self) -> u32 {
        self.locks.queued() as u32
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
    fn durable_engine(&self, engine: &Replicas) -> bool {
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

    async fn visible(&self, session_id: &str) -> Result<Visible, CoreError> {
        Ok(transcript::visible(&self.store.visible_tail(session_id).await?))
    }

    /// The session's visible history, rendered as the model sees it.
    async fn visible_messages(&self, session: &Session) -> Result<Vec<AgentMessage>, CoreError> {
        Ok(self.visible_shared(session).await?.into_vec())
    }

    /// The visible history read in place, shared with the store's tail.
    async fn visible_shared(&self, session: &Session) -> Result<transcript::Messages, CoreError> {
        let tail = self.store.visible_tail(&session.session_id).await?;
        Ok(transcript::Messages::Shared(transcript::SharedHistory::new(tail)))
    }

    /// A host callback under its grant's budget.
    pub fn authorise(&self, token: &str, session_id: Option<&str>, op: HostOperation) -> Result<Callback, GrantError> {
        self.grants.authorise(token, session_id, op)
    }

    /// One of the engine's model-call slots (Host.LlmComplete).
    pub fn llm_slot(&self, engine_id: &str) -> Result<LlmSlot, GrantError> {
        self.grants.llm_slot(engine_id)
    }

    /// A model request on an engine's behalf (Host.LlmComplete).
    pub async fn complete_for_engine(
        &self,
        scope: &Scope,
        purpose: &str,
        mut chat: ChatRequest,
        cancel: &CancellationToken,
    ) -> Result<ChatResponse, ModelError> {
        tracing::info!(engine = %scope.engine_id, session = %scope.session_id, purpose = ?purpose, "host model call for a context engine");
        self.metrics.host_llm_call(&scope.engine_id, purpose);
        chat.max_tokens = chat.max_tokens.min(self.config.models.max_output_tokens);
        self.provider.complete(chat, None, cancel).await
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
