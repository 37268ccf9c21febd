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
mod rewrite_rate;
mod session_locks;
mod sessions;
mod subagents;
mod turn;
pub mod types;

use std::collections::HashSet;
use std::sync::Arc;

use ctxgate_proto::pb::{AgentMessage, ContentPart, Role, content_part::Part};
use ctxgate_proto::{estimate, limits};
use tokio_util::sync::CancellationToken;

use crate::config::{Config, ProviderKind};
use crate::engines::registry::Registry;
use crate::grants::{Callback, GrantError, HostOperation, LlmSlot, Scope};
use crate::metrics::Metrics;
use crate::model_spend::{ModelSpend, OverBudget};
use crate::provider::{ChatRequest, ChatResponse, ModelError, ModelProvider};
use crate::store::{Session, Store};
use crate::summarize::{Extractive, ModelSummarizer, Summarizer};

use admission::Permit;
use claims::SessionGate;
pub use compact::Compactor;
use engine_lease::Engines;
pub use error::{CoreError, new_error_id};
use maintenance::Maintenance;
pub use managed::{ManagedTurn, TurnEnd};
pub use outbox::Delivery;
pub use outbox::{EngineState, HELD};
pub use preview::{Preview, PreviewMessage, is_summary};
pub use session_locks::BusyError;
pub use turn::{Begun, Finished, StepError, Turn, check_client_message};
use types::{CompactionEvent, ModelSpec};

/// Why a model call for an engine did not answer.
#[derive(Debug, thiserror::Error)]
pub enum EngineModelError {
    #[error(transparent)]
    OverBudget(#[from] OverBudget),
    #[error(transparent)]
    Model(#[from] ModelError),
}

/// Old entry id → new, after a maintenance rewrite copied a branch.
type Remap = std::collections::HashMap<String, String>;

/// Where compaction events go: to a turn's events or a Compact stream.
pub type CompactionSink<'a> = dyn Fn(CompactionEvent) + Send + Sync + 'a;

pub struct Core {
    config: Arc<Config>,
    store: Arc<dyn Store>,
    provider: Arc<dyn ModelProvider>,
    metrics: Metrics,
    /// The engines, their leases and grants.
    engines: Arc<Engines>,
    /// Compaction, the engine's or the built-in one.
    compactor: Arc<Compactor>,
    /// One turn or compaction at a time per session (and gateway), Abort.
    gate: Arc<SessionGate>,
    /// One permit per turn taken (`gateway.limits.maxConcurrentTurns`).
    admission: Arc<admission::Admission>,
    /// Bootstrap and Maintain.
    maintenance: Arc<Maintenance>,
    /// CommitTurns, ForgetSessions and DELTA cursors.
    delivery: Arc<Delivery>,
    /// Each engine's model tokens (Host.LlmComplete).
    model_spend: Arc<ModelSpend>,
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

/// The gateway's own model, as a turn sees it.
fn provider_model(config: &Config, provider: &dyn ModelProvider) -> ModelSpec {
    ModelSpec {
        id: provider.model().to_owned(),
        provider: format!("{:?}", config.models.provider).to_lowercase(),
        context_window: config.models.context_window,
        reserve_tokens: config.reserve_tokens(),
        max_output_tokens: config.models.max_output_tokens,
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
    printable("session.session_key", key)?;
    printable("session.agent_id", agent_id)?;
    let agent = if agent_id.trim().is_empty() { "main" } else { agent_id.trim() };
    Ok((agent.to_owned(), key.to_owned()))
}

/// An id a client names: it becomes log fields, status lines and the key
/// engines see, so a newline or an escape in it would forge log lines and
/// terminal output.
pub fn printable(field: &str, id: &str) -> Result<(), CoreError> {
    if id.chars().any(char::is_control) {
        return Err(CoreError::invalid(field, "contains a control character"));
    }
    Ok(())
}

/// Why the core could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("model provider: {0}")]
    Provider(String),
    #[error("gateway.otlp: {0}")]
    Otlp(String),
    #[error("reading the store failed: {0}")]
    StoreRead(String),
}

impl Core {
    /// The core as the gateway runs it, composed from its configuration:
    /// the model provider, metrics (with OTLP spans when configured), the
    /// services, the Host endpoint engines call back, the engines known
    /// durable.
    pub async fn start(
        config: Arc<Config>,
        store: crate::store::Opened,
        host_endpoint: String,
    ) -> Result<Arc<Self>, StartError> {
        let provider = crate::provider::from_config(&config.models).map_err(StartError::Provider)?;
        let spans = match &config.gateway.otlp {
            Some(o) => {
                let ca = o.ca.as_deref().map(|path| ("gateway.otlp.ca", path));
                Some(
                    ctxgate_runtime::otlp::Exporter::start(&o.endpoint, &o.service_name, ca)
                        .map_err(StartError::Otlp)?,
                )
            }
            None => None,
        };
        let metrics = Metrics::new(store.counters).with_spans(spans);
        let core = Arc::new(Self::new(config, store.store, provider, metrics));
        core.set_host_endpoint(host_endpoint);
        core.load_durable_engines().await.map_err(|e| StartError::StoreRead(e.to_string()))?;
        Ok(core)
    }

    /// The gateway's own periodic work, every 500 ms until aborted:
    /// subagents past their ttl ended ("swept"), turns a dead gateway left
    /// open recovered (shared store), queued durable commits retried, and
    /// the drop audit pruned at start and hourly.
    pub fn spawn_upkeep(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let core = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(std::time::Duration::from_millis(500));
            let mut pruned: Option<tokio::time::Instant> = None;
            loop {
                tick.tick().await;
                if pruned.is_none_or(|at| at.elapsed() >= std::time::Duration::from_secs(3600)) {
                    pruned = Some(tokio::time::Instant::now());
                    match core.delivery.prune_audit().await {
                        Ok(0) => {}
                        Ok(n) => tracing::info!(drops = n, "audited outbox drops past store.auditRetentionDays pruned"),
                        Err(e) => tracing::warn!(error = %e, "pruning the outbox drop audit failed"),
                    }
                }
                if let Err(e) = core.sweep_subagents().await {
                    tracing::warn!(error = %e, "subagent sweep failed");
                }
                if let Err(e) = core.delivery.recover_abandoned_turns().await {
                    tracing::warn!(error = %e, "recovering abandoned turns failed");
                }
                if let Err(e) = core.delivery.drain_outbox().await {
                    tracing::warn!(error = %e, "outbox drain failed");
                }
            }
        })
    }

    /// Builds the core and its engine registry (starts health monitors:
    /// call inside a tokio runtime).
    pub fn new(config: Arc<Config>, store: Arc<dyn Store>, provider: Arc<dyn ModelProvider>, metrics: Metrics) -> Self {
        let summarizer: Arc<dyn Summarizer> = match provider.kind() {
            ProviderKind::Offline => Arc::new(Extractive),
            ProviderKind::Openai => Arc::new(ModelSummarizer { provider: provider.clone(), max_tokens: 2_048 }),
        };
        let engines = Arc::new(Engines::new(&config, store.clone(), metrics.clone()));
        let admission = Arc::new(admission::Admission::new(&config.gateway.limits));
        let shutdown = CancellationToken::new();
        let gate = Arc::new(SessionGate::new(
            store.clone(),
            config.store.lease(),
            config.gateway.limits.queued_turns_per_session,
        ));
        let delivery = Arc::new(Delivery::new(store.clone(), engines.clone(), gate.clone(), &config, shutdown.clone()));
        let model = provider_model(&config, provider.as_ref());
        let compactor = Arc::new(Compactor::new(
            config.clone(),
            store.clone(),
            engines.clone(),
            gate.clone(),
            summarizer,
            metrics.clone(),
            model,
        ));
        let maintenance = Arc::new(Maintenance::new(
            store.clone(),
            engines.clone(),
            delivery.clone(),
            gate.clone(),
            config.gateway.limits.maintain_rewrites_per_session_per_hour,
            shutdown.clone(),
        ));
        let model_spend =
            Arc::new(ModelSpend::new(config.gateway.limits.host_callbacks.llm_tokens_per_engine_per_hour));
        Self {
            config,
            store,
            provider,
            metrics,
            engines,
            compactor,
            gate,
            admission,
            maintenance,
            delivery,
            model_spend,
            shutdown,
        }
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Takes engine `id` out of quarantine now; `None` when no such
    /// engine is configured.
    pub fn readmit_engine(&self, id: &str) -> Option<bool> {
        self.registry().readmit(id)
    }

    /// Where engines call the Host service back (set once, after binding).
    pub fn set_host_endpoint(&self, endpoint: String) {
        self.engines.set_host_endpoint(endpoint);
    }

    pub fn registry(&self) -> Arc<Registry> {
        self.engines.registry()
    }

    /// The outbox, forgets and their audit, for operators.
    pub fn delivery(&self) -> &Delivery {
        &self.delivery
    }

    /// Applies the engine part of a new configuration: new clients and
    /// monitors, quarantines cleared, the slot re-resolved (an entry that
    /// is gone resets it to legacy). Turns in flight keep their lease.
    pub fn reload_engines(&self, config: &Config) {
        self.engines.reload(config);
        self.maintenance.forget_bootstraps();
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
        self.gate.running() as u32
    }

    /// The admission limit now (it follows latency).
    pub fn turn_limit(&self) -> u32 {
        self.admission.load().1 as u32
    }

    pub fn turns_queued(&self) -> u32 {
        self.gate.queued() as u32
    }

    /// The gateway's own model, as a turn sees it.
    fn provider_model(&self) -> ModelSpec {
        provider_model(&self.config, self.provider.as_ref())
    }

    /// Manual compaction, by the [`Compactor`].
    pub fn compactor(&self) -> &Compactor {
        &self.compactor
    }

    /// Loads the engines known to be durable (call once at start).
    pub async fn load_durable_engines(&self) -> Result<(), CoreError> {
        self.engines.load_durable().await
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

    /// Admission control: a permit for one turn, or shed at once over the
    /// limit. Callers ask before any work of the turn, before they spawn
    /// its task or open its stream: under overload most turns are refused,
    /// and a refusal that had a task and a stream set up first took the
    /// CPU the admitted turns needed.
    pub fn admit(&self) -> Result<Permit, CoreError> {
        let admission = self.admission.try_admit().map_err(|shed| turn::shed_error(&self.metrics, shed))?;
        self.metrics.turn_limit.set(admission.limit() as i64);
        Ok(admission)
    }

    /// Begins a turn under its `admission` ([`Core::admit`]); see
    /// [`Turn`] for its steps.
    pub async fn begin(
        &self,
        spec: types::TurnSpec,
        events: types::EventSink,
        cancel: CancellationToken,
        admission: Permit,
    ) -> Result<Begun, CoreError> {
        Turn::begin(self.turn_services(), &self.gate, spec, events, cancel, admission).await
    }

    /// The session's visible history, rendered as the model sees it.
    async fn visible_messages(&self, session: &Session) -> Result<Vec<AgentMessage>, CoreError> {
        Ok(self.turn_services().visible(session).await?.into_vec())
    }

    /// The services a turn calls (a turn holds these, not the core).
    fn turn_services(&self) -> turn::TurnServices {
        turn::TurnServices {
            store: self.store.clone(),
            metrics: self.metrics.clone(),
            engines: self.engines.clone(),
            delivery: self.delivery.clone(),
            maintenance: self.maintenance.clone(),
            compactor: self.compactor.clone(),
        }
    }

    /// A host callback under its grant's budget.
    pub fn authorise(&self, token: &str, session_id: Option<&str>, op: HostOperation) -> Result<Callback, GrantError> {
        self.engines.authorise(token, session_id, op)
    }

    /// One of the engine's model-call slots (Host.LlmComplete).
    pub fn llm_slot(&self, engine_id: &str) -> Result<LlmSlot, GrantError> {
        self.engines.llm_slot(engine_id)
    }

    /// A model request on an engine's behalf (Host.LlmComplete), within the
    /// engine's hourly token budget: what it may cost (its prompt's
    /// estimate and its most output) is set aside first, and what the
    /// model reports it used is what counts.
    pub async fn complete_for_engine(
        &self,
        scope: &Scope,
        purpose: &str,
        mut chat: ChatRequest,
        cancel: &CancellationToken,
    ) -> Result<ChatResponse, EngineModelError> {
        chat.max_tokens = chat.max_tokens.min(self.config.models.max_output_tokens);
        let prompt =
            chat.system.as_deref().map_or(0, estimate::text_tokens) + estimate::messages_tokens(chat.messages.iter());
        let mut reserved = self.model_spend.reserve(&scope.engine_id, prompt.saturating_add(chat.max_tokens))?;
        tracing::info!(engine = %scope.engine_id, session = %scope.session_id, purpose = ?purpose, "host model call for a context engine");
        self.metrics.host_llm_call(&scope.engine_id, purpose);
        reserved.sent(prompt);
        let reply = self.provider.complete(chat, None, cancel).await?;
        // A provider that reports no usage is charged the prompt estimate.
        let (input, output) = (reply.usage.input_tokens.unwrap_or(prompt), reply.usage.output_tokens.unwrap_or(0));
        reserved.settle(input.saturating_add(output));
        self.metrics.host_llm_tokens(&scope.engine_id, input, output);
        Ok(reply)
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
