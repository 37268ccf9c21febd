//! The turn core: managed turns and compaction for one gateway, independent
//! of the API that drives them. Events go out through a channel; the caller
//! going away cancels the work.

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

    // --- engines ---------------------------------------------------------

    /// Chooses the engine for one operation ("agent-run", "manual-compact"):
    /// the configured one if it is in service and the host has what it
    /// needs, else legacy with one warning.
    fn lease(&self, operation: &str) -> Lease {
        let registry = self.registry();
        let legacy = |degraded| Lease {
            key: LEGACY_ID.into(),
            engine: registry.legacy(),
            info: registry.legacy.info(),
            degraded,
            remote: false,
        };
        let Some(g) = registry.selected() else { return legacy(None) };
        let reason = if let Some(q) = g.quarantine_record() {
            Some(format!("it is quarantined after failing during {}: {}", q.operation, q.reason))
        } else {
            let info = g.info();
            check_host_requirements(&info, operation, EMBEDDED_HOST_LABEL, &EMBEDDED_HOST_CAPABILITIES).err()
        };
        match reason {
            Some(reason) => {
                let id = g.id();
                let warning = format!(
                    "Context engine \"{id}\" degraded to \"{LEGACY_ID}\" for this logical turn: {reason}. The \"{LEGACY_ID}\" engine will handle only this turn; configuration is unchanged, and \"{id}\" will be retried next turn."
                );
                tracing::warn!("{warning}");
                legacy(Some(warning))
            }
            None => Lease { key: g.id().to_owned(), engine: g.clone(), info: g.info(), degraded: None, remote: true },
        }
    }

    /// A grant for one engine call on `session`, expiring with the call.
    fn grant(
        &self,
        lease: &Lease,
        session: &Session,
        fence_before: Option<&str>,
        deadline: Option<Instant>,
    ) -> Option<GrantGuard> {
        let endpoint = self.host_endpoint.get()?;
        if !lease.remote {
            return None;
        }
        let ttl = deadline.map_or(GRANT_TTL, |d| d.saturating_duration_since(Instant::now()));
        let scope = Scope {
            engine_id: lease.info.id.clone(),
            session_id: session.session_id.clone(),
            session_key: session.session_key.clone(),
            operations: vec![READ_TRANSCRIPT, LLM_COMPLETE],
            fence_before: fence_before.map(str::to_owned),
        };
        Some(self.grants.issue(endpoint, scope, ttl))
    }

    /// RuntimeSettings schema v1 (reference §1.5).
    fn runtime_settings(&self, lease: &Lease, budget: u64, degraded: Option<pb::ReasonCode>) -> pb::RuntimeSettings {
        let model = self.provider.model().to_owned();
        let mode = match (degraded, lease.degraded.is_some()) {
            (Some(_), _) => pb::RuntimeMode::Degraded,
            (None, true) => pb::RuntimeMode::Fallback,
            (None, false) => pb::RuntimeMode::Normal,
        };
        let source =
            if lease.info.id == LEGACY_ID { pb::SelectionSource::Default } else { pb::SelectionSource::Configured };
        pb::RuntimeSettings {
            schema_version: 1,
            runtime: Some(pb::RuntimeInfo {
                host: "ctxgate".into(),
                mode: mode as i32,
                harness_id: None,
                runtime_id: None,
            }),
            model: Some(pb::ModelSelection {
                requested: Some(model.clone()),
                resolved: Some(model),
                provider: Some(format!("{:?}", self.config.models.provider).to_lowercase()),
                family: None,
            }),
            context_engine_selection: Some(pb::EngineSelection {
                selected_id: Some(lease.info.id.clone()),
                source: source as i32,
            }),
            execution_host: Some(pb::ExecutionHost {
                id: Some(crate::engines::EMBEDDED_HOST_ID.into()),
                label: Some(EMBEDDED_HOST_LABEL.into()),
            }),
            limits: Some(pb::Limits {
                prompt_token_budget: Some(budget),
                max_output_tokens: Some(self.config.models.max_output_tokens),
            }),
            diagnostics: Some(pb::Diagnostics {
                fallback_reason: if lease.degraded.is_some() { pb::ReasonCode::RuntimeUnavailable as i32 } else { 0 },
                degraded_reason: degraded.map_or(0, |d| d as i32),
            }),
        }
    }

    fn runtime_context(&self, session: &Session, budget: u64, current: u64) -> pb::RuntimeContext {
        pb::RuntimeContext {
            token_budget: Some(budget),
            current_token_count: Some(current),
            transcript_storage: pb::TranscriptStorage::Sqlite as i32,
            session_target: Some(target(session)),
            provider: Some(format!("{:?}", self.config.models.provider).to_lowercase()),
            model_id: Some(self.provider.model().into()),
            ..Default::default()
        }
    }

    /// Bootstrap (then maintain(bootstrap)) a session the remote engine has
    /// not seen in this process.
    async fn bootstrap_if_new(&self, lease: &Lease, session: &Session, fence: &str, budget: u64, call: &Call) {
        if !lease.remote {
            return;
        }
        let key = (lease.info.id.clone(), session.session_id.clone());
        if !self.bootstrapped.lock().unwrap_or_else(|e| e.into_inner()).insert(key) {
            return;
        }
        let grant = self.grant(lease, session, Some(fence), call.deadline);
        let req = pb::BootstrapRequest {
            session_id: session.session_id.clone(),
            session_key: Some(session.session_key.clone()),
            session_target: Some(target(session)),
            session_file: session.session_key.clone(),
            runtime_settings: Some(self.runtime_settings(lease, budget, None)),
            runtime_context: Some(self.runtime_context(session, budget, 0)),
            host: grant.as_ref().map(|g| g.access.clone()),
        };
        match lease.engine.bootstrap(req, call).await {
            Ok(r) if r.bootstrapped => self.maintain(lease, session, pb::MaintainReason::Bootstrap, budget, call).await,
            Ok(_) | Err(EngineCallError::Unimplemented(_)) => {}
            Err(e) => tracing::warn!(error = %e, "context engine bootstrap failed"),
        }
    }

    /// Maintain and apply the engine's rewrites as a new branch.
    async fn maintain(&self, lease: &Lease, session: &Session, reason: pb::MaintainReason, budget: u64, call: &Call) {
        let grant = self.grant(lease, session, None, call.deadline);
        let req = pb::MaintainRequest {
            session_id: session.session_id.clone(),
            session_key: Some(session.session_key.clone()),
            session_target: Some(target(session)),
            session_file: session.session_key.clone(),
            reason: reason as i32,
            runtime_settings: Some(self.runtime_settings(lease, budget, None)),
            runtime_context: Some(pb::RuntimeContext {
                allow_deferred_compaction_execution: call.deadline.is_none() && reason == pb::MaintainReason::Turn,
                ..self.runtime_context(session, budget, 0)
            }),
            host: grant.as_ref().map(|g| g.access.clone()),
        };
        match lease.engine.maintain(req, call).await {
            Ok(r) if !r.replacements.is_empty() => {
                let replacements = r.replacements.into_iter().filter_map(|x| Some((x.entry_id, x.message?))).collect();
                match self.store.rewrite(&session.session_id, replacements).await {
                    Ok(o) if o.changed => tracing::info!(
                        session = %session.session_id, rewritten = o.rewritten_entries, bytes_freed = o.bytes_freed,
                        "context engine maintenance changed the transcript"
                    ),
                    Ok(o) => tracing::debug!(reason = %o.reason, "maintenance rewrote nothing"),
                    Err(e) => tracing::warn!(error = %e, "applying maintenance rewrites failed"),
                }
            }
            Ok(_) | Err(EngineCallError::Unimplemented(_) | EngineCallError::Cancelled) => {}
            Err(e) => tracing::warn!(error = %e, "context engine maintain failed"),
        }
    }

    /// After a turn, for engines that ask for it: maintain(turn) on the
    /// session's background lane — one run at a time, plus one coalesced
    /// follow-up — cancelled on shutdown. (Foreground maintenance runs in
    /// `finalize`.)
    fn schedule_background_maintenance(self: &Arc<Self>, lease: Lease, session: Session, budget: u64) {
        if lease.info.turn_maintenance_mode != pb::TurnMaintenanceMode::Background as i32 {
            return;
        }
        {
            let mut lanes = self.maintenance.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(follow_up) = lanes.get_mut(&session.session_id) {
                *follow_up = true;
                return;
            }
            lanes.insert(session.session_id.clone(), false);
        }
        let core = self.clone();
        let stop = self.shutdown.child_token();
        tokio::spawn(async move {
            loop {
                core.maintain(&lease, &session, pb::MaintainReason::Turn, budget, &Call::new(stop.clone())).await;
                let mut lanes = core.maintenance.lock().unwrap_or_else(|e| e.into_inner());
                match lanes.get_mut(&session.session_id) {
                    Some(again) if *again && !stop.is_cancelled() => *again = false,
                    _ => {
                        lanes.remove(&session.session_id);
                        return;
                    }
                }
            }
        });
    }

    /// Waits until the session has no background maintenance running.
    pub async fn maintenance_idle(&self, session_id: &str) {
        while self.maintenance.lock().unwrap_or_else(|e| e.into_inner()).contains_key(session_id) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    // --- turns -----------------------------------------------------------

    /// Runs one managed turn; every event goes to `events`. Errors are
    /// returned only before admission; after it, the outcome is an event.
    pub async fn run_turn(
        self: &Arc<Self>,
        req: api::RunTurnRequest,
        events: mpsc::UnboundedSender<api::TurnEvent>,
        cancel: CancellationToken,
    ) -> Result<(), CoreError> {
        let (agent, key) = validate_turn(&req)?;
        let session = self.store.session(&agent, &key, true).await?.ok_or(CoreError::NoSession(key.clone()))?;
        let _guard = self.enter(&session.session_id, &cancel).await;
        let started = std::time::Instant::now();
        self.metrics.turns_in_flight.inc();
        let outcome = self.turn(&session, req, &events, &cancel).await;
        self.metrics.turns_in_flight.dec();
        let label = match &outcome {
            Ok(Some(api::turn_event::Event::Failed(f))) => f.reason.clone(),
            Ok(_) => "completed".into(),
            Err(_) => "error".into(),
        };
        self.metrics.turn_finished(&label, started.elapsed());
        if let Some(last) = outcome? {
            let _ = events.send(event(last));
        }
        Ok(())
    }

    /// The turn after validation; returns the terminal event.
    async fn turn(
        self: &Arc<Self>,
        session: &Session,
        req: api::RunTurnRequest,
        events: &mpsc::UnboundedSender<api::TurnEvent>,
        cancel: &CancellationToken,
    ) -> Result<Option<api::turn_event::Event>, CoreError> {
        use api::turn_event::Event as E;
        // A client that went away stops reading; the cancel token tells the work.
        let send = |e: E| {
            let _ = events.send(event(e));
        };
        // Admission: the user message is durable before anything else runs.
        let turn_id = uuid::Uuid::new_v4().simple().to_string();
        let user =
            NewEntry { turn_id: turn_id.clone(), entry: Entry::Message(text_message(Role::User, req.message.clone())) };
        let admitted = self.store.append(&session.session_id, vec![user]).await?;
        let admitted_id = admitted[0].id.clone();
        send(E::Admitted(api::Admitted {
            session_id: session.session_id.clone(),
            turn_id: turn_id.clone(),
            entry_id: admitted_id.clone(),
        }));

        // Engine selection: the lease is pinned from here on.
        let lease = self.lease("agent-run");
        let reason = match &lease.degraded {
            Some(w) => {
                send(E::Warning(api::Warning { message: w.clone() }));
                "degraded".to_owned()
            }
            None if lease.remote => "configured".to_owned(),
            None => "default".to_owned(),
        };
        send(E::EngineSelected(api::EngineSelected { engine_id: lease.info.id.clone(), reason }));
        let call = Call::new(cancel.clone());

        let system = req.system_prompt.as_deref();
        let budget = self.token_budget(system);
        // Durable engines get earlier turns first; a turn the engine has not
        // accepted blocks this session only.
        if lease.remote && crate::engines::durable(&lease.info) {
            let waiting = self.drain_commits(&session.session_id, cancel).await?;
            if waiting > 0 {
                return Ok(Some(failed(
                    "engine_backlog",
                    format!(
                        "The context engine \"{}\" has not accepted {waiting} earlier turn(s) of this session yet; they are retried in the background. Try again shortly.",
                        lease.key
                    ),
                )));
            }
        }
        self.bootstrap_if_new(&lease, session, &admitted_id, budget, &call).await;
        let sink = |e: api::compaction_event::Event| {
            let mapped = match e {
                api::compaction_event::Event::Started(s) => E::CompactionStarted(s),
                api::compaction_event::Event::Progress(p) => E::CompactionProgress(p),
                api::compaction_event::Event::Done(d) => E::CompactionDone(d),
            };
            let _ = events.send(event(mapped));
        };

        // Proactive compaction: tokens ≥ window − min(20000, 25 % of window).
        // Engines that own compaction are judged by what they assemble.
        let window = self.config.models.context_window;
        let threshold = window - (window / 4).min(20_000);
        let mut visible = self.visible(&session.session_id).await?;
        let mut proactive_done = false;
        if !lease.info.owns_compaction && visible.tokens() >= threshold {
            proactive_done = true;
            if let Err(e) = self.compact(&lease, session, "proactive", Some(budget), None, &sink, cancel).await {
                if cancel.is_cancelled() {
                    return Ok(Some(aborted()));
                }
                send(E::Warning(api::Warning { message: format!("proactive compaction failed: {e}") }));
            }
            visible = self.visible(&session.session_id).await?;
        }

        let (mut overflow_compactions, mut timeout_compactions, mut truncated) = (0, 0, false);
        let mut degraded_reason = None;
        for attempt in 1.. {
            if cancel.is_cancelled() {
                return Ok(Some(aborted()));
            }
            let rendered = visible.render();
            let pre_assembly_tokens = estimate::messages_tokens(&rendered);
            let grant = self.grant(&lease, session, Some(&admitted_id), None);
            let assembled = lease
                .engine
                .assemble(
                    pb::AssembleRequest {
                        session_id: session.session_id.clone(),
                        session_key: Some(session.session_key.clone()),
                        messages: rendered.clone(),
                        token_budget: Some(budget),
                        prompt: Some(req.message.clone()),
                        model: Some(self.provider.model().to_owned()),
                        runtime_settings: Some(self.runtime_settings(&lease, budget, degraded_reason)),
                        runtime_context: Some(self.runtime_context(session, budget, pre_assembly_tokens)),
                        host: grant.as_ref().map(|g| g.access.clone()),
                        ..Default::default()
                    },
                    &call,
                )
                .await;
            drop(grant);
            let assembled = match assembled {
                Ok(a) => a,
                Err(EngineCallError::Cancelled) => return Ok(Some(aborted())),
                Err(e) => {
                    return Ok(Some(failed(
                        "engine_error",
                        format!("The context engine could not assemble the prompt: {e}."),
                    )));
                }
            };
            let mut messages = assembled.messages;
            if let Some(addition) = assembled.system_prompt_addition.as_deref().filter(|a| !a.trim().is_empty()) {
                messages.insert(0, text_message(Role::System, addition.to_owned()));
            }
            if truncated {
                truncate_tool_results(&mut messages);
            }
            let estimated = estimate::messages_tokens(&messages);
            send(E::Assembled(api::Assembled {
                messages: messages.len() as u32,
                estimated_tokens: estimated,
                token_budget: budget,
                attempt,
            }));
            if lease.info.owns_compaction && !proactive_done && estimated >= threshold {
                proactive_done = true;
                if let Err(e) = self.compact(&lease, session, "proactive", Some(budget), None, &sink, cancel).await {
                    send(E::Warning(api::Warning { message: format!("proactive compaction failed: {e}") }));
                }
                visible = self.visible(&session.session_id).await?;
                continue;
            }

            // Pre-prompt check: a prompt over budget is an overflow without
            // spending a model call. Engines owning compaction skip it unless
            // they say the pre-assembly history may overflow.
            let may_overflow = assembled.prompt_authority == pb::PromptAuthority::PreassemblyMayOverflow as i32;
            let checked = if may_overflow { estimated.max(pre_assembly_tokens) } else { estimated };
            let precheck = !lease.info.owns_compaction || may_overflow;
            let result = if precheck && checked > budget {
                Err(ModelError::ContextOverflow(format!("the prompt is {checked} tokens, the budget {budget}")))
            } else {
                self.call_model(system, messages, events, cancel).await
            };
            match result {
                Ok(reply) => {
                    let done = self
                        .finalize(&lease, session, &turn_id, &admitted[0], reply, rendered, budget, events, cancel)
                        .await?;
                    self.schedule_background_maintenance(lease, session.clone(), budget);
                    return Ok(Some(done));
                }
                Err(ModelError::Cancelled) => return Ok(Some(aborted())),
                Err(ModelError::ContextOverflow(why)) => {
                    degraded_reason = Some(pb::ReasonCode::ContextOverflow);
                    if overflow_compactions < MAX_OVERFLOW_COMPACTIONS {
                        overflow_compactions += 1;
                        // A failing engine is quarantined inside; the next
                        // attempts then use built-in compaction.
                        if let Err(e) =
                            self.compact(&lease, session, "overflow", Some(budget), None, &sink, cancel).await
                        {
                            if cancel.is_cancelled() {
                                return Ok(Some(aborted()));
                            }
                            send(E::Warning(api::Warning { message: format!("overflow compaction failed: {e}") }));
                        }
                        visible = self.visible(&session.session_id).await?;
                    } else if !truncated {
                        truncated = true;
                        send(E::Warning(api::Warning {
                            message: "still over the context window: truncating large tool results for this turn"
                                .into(),
                        }));
                    } else {
                        return Ok(Some(failed(
                            "context_overflow",
                            format!(
                                "The conversation does not fit the model's context window even after {MAX_OVERFLOW_COMPACTIONS} compactions ({why}). Run /compact with instructions to summarise harder, or /new to start a fresh session."
                            ),
                        )));
                    }
                }
                Err(ModelError::Timeout(after)) => {
                    let share = estimated as f64 / budget.max(1) as f64;
                    if timeout_compactions < MAX_TIMEOUT_COMPACTIONS && share > TIMEOUT_COMPACTION_SHARE {
                        timeout_compactions += 1;
                        degraded_reason = Some(pb::ReasonCode::ProviderTimeout);
                        if let Err(e) =
                            self.compact(&lease, session, "timeout", Some(budget), None, &sink, cancel).await
                        {
                            send(E::Warning(api::Warning { message: format!("timeout compaction failed: {e}") }));
                        }
                        visible = self.visible(&session.session_id).await?;
                    } else {
                        return Ok(Some(failed(
                            "model_timeout",
                            format!(
                                "The model did not answer within {after:?}. Try again, or /compact to make the prompt smaller."
                            ),
                        )));
                    }
                }
                Err(e) => {
                    return Ok(Some(failed(
                        "model_error",
                        format!("The model call failed: {e}. Check the gateway's model settings and try again."),
                    )));
                }
            }
        }
        unreachable!("the attempt loop returns")
    }

    async fn call_model(
        &self,
        system: Option<&str>,
        messages: Vec<AgentMessage>,
        events: &mpsc::UnboundedSender<api::TurnEvent>,
        cancel: &CancellationToken,
    ) -> Result<crate::provider::ChatResponse, ModelError> {
        let (dtx, mut drx) = mpsc::channel::<String>(64);
        let events = events.clone();
        let forward = tokio::spawn(async move {
            while let Some(text) = drx.recv().await {
                let _ = events.send(event(api::turn_event::Event::ModelDelta(api::ModelDelta { text })));
            }
        });
        let req = ChatRequest {
            system: system.map(str::to_owned),
            messages,
            max_tokens: self.config.models.max_output_tokens,
        };
        let r = self.provider.complete(req, Some(dtx), cancel).await;
        let _ = forward.await;
        r
    }

    /// Appends the reply and tells the engine (after-turn, or ingest for
    /// engines without it); returns the Completed event.
    #[allow(clippy::too_many_arguments)]
    async fn finalize(
        &self,
        lease: &Lease,
        session: &Session,
        turn_id: &str,
        admitted: &pb::TranscriptEntry,
        reply: crate::provider::ChatResponse,
        mut history: Vec<AgentMessage>,
        budget: u64,
        events: &mpsc::UnboundedSender<api::TurnEvent>,
        cancel: &CancellationToken,
    ) -> Result<api::turn_event::Event, CoreError> {
        let mut m = text_message(Role::Assistant, reply.text.clone());
        m.usage = Some(reply.usage);
        m.metadata.insert("model".into(), self.provider.model().into());
        let entry = NewEntry { turn_id: turn_id.into(), entry: Entry::Message(m) };
        if lease.remote && crate::engines::durable(&lease.info) {
            // Durable: the reply and the turn's commit are stored together,
            // then delivered; the engine gets no after-turn or ingest for it.
            let draft = self.commit_draft(lease, session, turn_id, admitted, history.len());
            let stored = self.store.append_with_commit(&session.session_id, vec![entry], draft).await?;
            let waiting = self.drain_commits(&session.session_id, cancel).await?;
            if waiting > 0 {
                let _ = events.send(event(api::turn_event::Event::Warning(api::Warning {
                    message: "the context engine has not accepted this turn yet; it stays queued and is retried".into(),
                })));
            }
            if lease.info.turn_maintenance_mode != pb::TurnMaintenanceMode::Background as i32 {
                self.maintain(lease, session, pb::MaintainReason::Turn, budget, &Call::new(cancel.clone())).await;
            }
            return Ok(api::turn_event::Event::Completed(api::Completed {
                entry_id: stored[0].id.clone(),
                text: reply.text,
                usage: Some(reply.usage),
            }));
        }
        let stored = self.store.append(&session.session_id, vec![entry]).await?;
        // Everything before the admitted user message existed before the prompt.
        let pre_prompt = history.len().saturating_sub(1) as u64;
        if let Some(Entry::Message(reply_message)) = stored[0].entry.clone() {
            history.push(reply_message);
        }
        let new_messages: Vec<AgentMessage> = history[pre_prompt as usize..].to_vec();
        let call = Call::new(cancel.clone());
        let grant = self.grant(lease, session, None, None);
        let tokens = estimate::messages_tokens(&history);
        let after = pb::AfterTurnRequest {
            session_id: session.session_id.clone(),
            session_key: Some(session.session_key.clone()),
            session_target: Some(target(session)),
            session_file: session.session_key.clone(),
            pre_prompt_message_count: pre_prompt,
            messages: history,
            token_budget: Some(budget),
            runtime_settings: Some(self.runtime_settings(lease, budget, None)),
            runtime_context: Some(self.runtime_context(session, budget, tokens)),
            host: grant.as_ref().map(|g| g.access.clone()),
            ..Default::default()
        };
        let warn = |e: EngineCallError| {
            let _ = events.send(event(api::turn_event::Event::Warning(api::Warning {
                message: format!("after-turn failed: {e}"),
            })));
        };
        match lease.engine.after_turn(after, &call).await {
            Ok(_) | Err(EngineCallError::Cancelled) => {}
            // Without after-turn, the engine learns the turn through Ingest.
            Err(EngineCallError::Unimplemented(_)) => {
                for message in new_messages {
                    let req = pb::IngestRequest {
                        session_id: session.session_id.clone(),
                        session_key: Some(session.session_key.clone()),
                        message: Some(message),
                        is_heartbeat: false,
                    };
                    if let Err(e) = lease.engine.ingest(req, &call).await {
                        warn(e);
                        break;
                    }
                }
            }
            Err(e) => warn(e),
        }
        if lease.info.turn_maintenance_mode != pb::TurnMaintenanceMode::Background as i32 {
            self.maintain(lease, session, pb::MaintainReason::Turn, budget, &call).await;
        }
        Ok(api::turn_event::Event::Completed(api::Completed {
            entry_id: stored[0].id.clone(),
            text: reply.text,
            usage: Some(reply.usage),
        }))
    }

    /// The CommitTurn of a durable turn, before its reply is appended.
    fn commit_draft(
        &self,
        lease: &Lease,
        session: &Session,
        turn_id: &str,
        admitted: &pb::TranscriptEntry,
        rendered: usize,
    ) -> crate::store::CommitDraft {
        let anchor = pb::TranscriptEntryAnchor {
            agent_id: session.agent_id.clone(),
            session_id: session.session_id.clone(),
            session_key: session.session_key.clone(),
            store_path: String::new(),
            generation: 0,
            entry_id: admitted.id.clone(),
            raw_seq: admitted.seq,
            effective_parent_id: admitted.parent_id.clone(),
            active_message_position: rendered.saturating_sub(1) as u64,
            idempotency_key: None,
        };
        let message = match &admitted.entry {
            Some(Entry::Message(m)) => vec![m.clone()],
            _ => vec![],
        };
        crate::store::CommitDraft {
            engine_id: lease.key.clone(),
            request: pb::CommitTurnRequest {
                advancement_key: turn_id.into(),
                admission: Some(pb::TranscriptTurnAdmission {
                    anchor: Some(anchor),
                    logical_turn_id: turn_id.into(),
                    role: Role::User as i32,
                }),
                terminal: None,
                messages: message,
                session_id: session.session_id.clone(),
                session_key: Some(session.session_key.clone()),
                session_target: Some(target(session)),
                ..Default::default()
            },
        }
    }

    /// Delivers the session's queued commits in order; returns how many
    /// still wait (the engine is out of service or refused one).
    async fn drain_commits(&self, session_id: &str, cancel: &CancellationToken) -> Result<usize, CoreError> {
        let pending = self.store.pending_commits(session_id).await?;
        let registry = self.registry();
        let mut delivered = 0;
        for p in &pending {
            let Some(engine) = registry.get(&p.engine_id).filter(|g| !g.is_quarantined()) else { break };
            match engine.commit_turn(p.request.clone(), &Call::new(cancel.clone())).await {
                Ok(_) => {
                    self.store.complete_commit(session_id, &p.request.advancement_key).await?;
                    delivered += 1;
                }
                Err(e) => {
                    tracing::warn!(session = session_id, key = %p.request.advancement_key, error = %e, "commit not accepted; it stays queued");
                    break;
                }
            }
        }
        Ok(pending.len() - delivered)
    }

    /// One pass of the outbox, round-robin across sessions: each session
    /// with queued commits gets a turn at draining (under its lock).
    pub async fn drain_outbox(&self) -> Result<(), CoreError> {
        for session_id in self.store.sessions_with_pending_commits().await? {
            // A session with a turn running drains at that turn's start; do
            // not stall every other session's pass behind it.
            let busy = self
                .running
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(&session_id)
                .is_some_and(|r| r.cancel.is_some());
            if busy {
                continue;
            }
            let cancel = self.call_token();
            let _guard = self.enter(&session_id, &cancel).await;
            self.drain_commits(&session_id, &cancel).await?;
        }
        Ok(())
    }

    // --- compaction --------------------------------------------------------

    /// Manual compaction (`/compact`): target=threshold, force.
    pub async fn compact_session(
        &self,
        req: api::CompactSessionRequest,
        sink: &CompactionSink<'_>,
        cancel: CancellationToken,
    ) -> Result<(), CoreError> {
        let (agent, key) = session_ref(req.session.as_ref())?;
        let session = self.store.session(&agent, &key, false).await?.ok_or(CoreError::NoSession(key))?;
        let _guard = self.enter(&session.session_id, &cancel).await;
        let lease = self.lease("manual-compact");
        self.compact(&lease, &session, "manual", None, req.custom_instructions, sink, &cancel).await.map(|_| ())
    }

    /// Runs the engine's compaction — or the built-in one it delegates to —
    /// inside one safety window. Built-in results become a compaction entry
    /// in the transcript; an engine that compacts itself keeps its own
    /// state, and the transcript stays whole. The caller holds the session
    /// lock.
    #[allow(clippy::too_many_arguments)]
    async fn compact(
        &self,
        lease: &Lease,
        session: &Session,
        trigger: &str,
        budget: Option<u64>,
        instructions: Option<String>,
        sink: &CompactionSink<'_>,
        cancel: &CancellationToken,
    ) -> Result<api::CompactionDone, CoreError> {
        use api::compaction_event::Event as C;
        let started = Instant::now();
        let window_end = started + self.config.compaction_timeout();
        let visible = self.visible(&session.session_id).await?;
        let tokens_before = visible.tokens();
        sink(C::Started(api::CompactionStarted { trigger: trigger.into(), tokens_before }));
        let target_kind = if budget.is_some() { pb::CompactionTarget::Budget } else { pb::CompactionTarget::Threshold };
        let call = Call::new(cancel.clone()).with_deadline(window_end);
        let grant = self.grant(lease, session, None, Some(window_end));
        let (force_reason, preflight) = match trigger {
            "manual" => (Some("manual".to_owned()), None),
            "proactive" => (Some("preflight_required".to_owned()), Some("tokens".to_owned())),
            _ => (None, None),
        };
        let request = pb::CompactRequest {
            session_id: session.session_id.clone(),
            session_key: session.session_key.clone(),
            agent_id: Some(session.agent_id.clone()),
            session_target: Some(target(session)),
            token_budget: budget,
            force: true,
            current_token_count: Some(tokens_before),
            compaction_target: target_kind as i32,
            custom_instructions: instructions.clone(),
            runtime_settings: Some(self.runtime_settings(lease, budget.unwrap_or_default(), None)),
            runtime_context: Some(pb::RuntimeContext {
                force_reason,
                preflight_compaction_trigger: preflight,
                ..self.runtime_context(session, budget.unwrap_or_default(), tokens_before)
            }),
            host: grant.as_ref().map(|g| g.access.clone()),
        };
        let progress = |p: pb::CompactProgress| {
            sink(C::Progress(api::CompactionProgress {
                stage: p.stage,
                done: p.done,
                total: p.total,
                message: p.message,
            }));
        };
        let reply = lease.engine.compact(request, &call, &progress).await;
        drop(grant);
        let result = match reply {
            Ok(CompactReply::DelegateToHost(d)) => {
                let instructions = d.custom_instructions.or(instructions);
                self.builtin(&visible, budget, instructions, sink, cancel, window_end).await
            }
            Ok(CompactReply::Done(r)) => {
                // The engine compacted its own state: report it; the
                // transcript keeps every entry.
                let outcome = if r.ok && r.compacted { "compacted" } else { "kept" };
                self.metrics.compaction_finished(trigger, outcome, started.elapsed(), None);
                let done = api::CompactionDone {
                    compacted: r.ok && r.compacted,
                    reason: r.reason,
                    tokens_before: if r.tokens_before > 0 { r.tokens_before } else { tokens_before },
                    tokens_after: r.tokens_after.unwrap_or(tokens_before),
                    entry_id: None,
                    summary_chars: r.summary.map_or(0, |s| s.chars().count() as u32),
                };
                sink(C::Done(done.clone()));
                return Ok(done);
            }
            Err(EngineCallError::Cancelled) => Err(CompactionError::Cancelled),
            Err(EngineCallError::DeadlineExceeded { after, .. }) => Err(CompactionError::Timeout(after)),
            Err(e) => Err(CompactionError::Model(ModelError::Unavailable(e.to_string()))),
        };
        let done = match result {
            Ok(Outcome::Compacted { summary, first_kept_entry_id, tokens_before, tokens_after }) => {
                let entry = pb::CompactionEntry {
                    summary: summary.clone(),
                    first_kept_entry_id,
                    tokens_before,
                    tokens_after: Some(tokens_after),
                };
                let stored = self
                    .store
                    .append(
                        &session.session_id,
                        vec![NewEntry { turn_id: format!("compaction:{trigger}"), entry: Entry::Compaction(entry) }],
                    )
                    .await?;
                self.metrics.compaction_finished(
                    trigger,
                    "compacted",
                    started.elapsed(),
                    Some((tokens_before, tokens_after)),
                );
                api::CompactionDone {
                    compacted: true,
                    reason: None,
                    tokens_before,
                    tokens_after,
                    entry_id: Some(stored[0].id.clone()),
                    summary_chars: summary.chars().count() as u32,
                }
            }
            Ok(Outcome::Kept { reason, tokens_before }) => {
                self.metrics.compaction_finished(trigger, "kept", started.elapsed(), None);
                api::CompactionDone {
                    compacted: false,
                    reason: Some(reason),
                    tokens_before,
                    tokens_after: tokens_before,
                    entry_id: None,
                    summary_chars: 0,
                }
            }
            Err(e) => {
                let (outcome, err) = match e {
                    CompactionError::Cancelled => ("aborted", CoreError::Aborted),
                    CompactionError::Timeout(_) => {
                        ("timeout", CoreError::CompactionTimeout(format!("{e}; history kept as it was")))
                    }
                    CompactionError::Model(_) => {
                        ("failed", CoreError::CompactionFailed(format!("{e}; history kept as it was")))
                    }
                };
                self.metrics.compaction_finished(trigger, outcome, started.elapsed(), None);
                return Err(err);
            }
        };
        sink(C::Done(done.clone()));
        Ok(done)
    }

    /// Built-in compaction, each model request bounded by the safety
    /// timeout but never past the end of the caller's window.
    async fn builtin(
        &self,
        visible: &Visible,
        budget: Option<u64>,
        instructions: Option<String>,
        sink: &CompactionSink<'_>,
        cancel: &CancellationToken,
        window_end: Instant,
    ) -> Result<Outcome, CompactionError> {
        let c = &self.config.agents.defaults.compaction;
        let left = window_end.saturating_duration_since(Instant::now());
        let settings = compaction::Settings {
            keep_recent_tokens: c.keep_recent_tokens,
            recent_turns_preserve: c.recent_turns_preserve,
            chunk_tokens: (self.config.models.context_window / 2).clamp(1_000, 30_000),
            request_timeout: self.config.compaction_timeout().min(left.max(Duration::from_millis(1))),
            quality_guard: c.quality_guard.enabled,
            max_retries: c.quality_guard.max_retries,
            strict_identifiers: c.identifier_policy == IdentifierPolicy::Strict,
        };
        let input = compaction::Input {
            previous_summary: visible.summary.as_ref().map(|(_, c)| c.summary.clone()),
            messages: visible.messages.clone(),
            token_budget: budget,
            instructions,
        };
        let mut progress = |done, total, message| {
            sink(api::compaction_event::Event::Progress(api::CompactionProgress {
                stage: "summarising".into(),
                done,
                total,
                message,
            }));
        };
        compaction::compact(input, self.summarizer.as_ref(), &settings, cancel, &mut progress).await
    }

    // --- subagents ------------------------------------------------------------

    /// Spawns a subagent session: the engine prepares (fails closed), then
    /// the gateway creates the child; a failure after preparation rolls the
    /// engine back.
    pub async fn spawn_subagent(
        &self,
        req: api::SpawnSubagentRequest,
        cancel: CancellationToken,
    ) -> Result<api::SpawnSubagentResult, CoreError> {
        let parent = self.session(req.parent.as_ref()).await?;
        let child_key = req.child_session_key.trim().to_owned();
        if child_key.is_empty() {
            return Err(CoreError::Invalid { field: "child_session_key", problem: "is required".into() });
        }
        if child_key.len() > limits::MAX_ID_BYTES {
            return Err(CoreError::TooLarge {
                field: "child_session_key",
                problem: format!("is over {} bytes", limits::MAX_ID_BYTES),
            });
        }
        if child_key == parent.session_key {
            return Err(CoreError::Invalid {
                field: "child_session_key",
                problem: "must differ from the parent's key".into(),
            });
        }
        let mode = match req.context_mode.as_str() {
            "" | "isolated" => pb::SubagentContextMode::Isolated,
            "fork" => pb::SubagentContextMode::Fork,
            other => {
                return Err(CoreError::Invalid {
                    field: "context_mode",
                    problem: format!("{other:?}: expected isolated or fork"),
                });
            }
        };
        if self.store.session(&parent.agent_id, &child_key, false).await?.is_some() {
            return Err(CoreError::Precondition(format!("session key {child_key:?} is already in use")));
        }
        let lease = self.lease("subagent-spawn");
        // Spawning fails closed: an engine that cannot run here refuses.
        if lease.degraded.is_some() {
            let registry = self.registry();
            if let Some(g) = registry.selected()
                && let Err(m) = check_host_requirements(
                    &g.info(),
                    "subagent-spawn",
                    EMBEDDED_HOST_LABEL,
                    &EMBEDDED_HOST_CAPABILITIES,
                )
            {
                return Err(CoreError::Precondition(m));
            }
        }
        let call = Call::new(cancel);
        let grant = self.grant(&lease, &parent, None, None);
        let prep = pb::PrepareSubagentSpawnRequest {
            parent_session_key: parent.session_key.clone(),
            child_session_key: child_key.clone(),
            context_mode: mode as i32,
            parent_session_id: Some(parent.session_id.clone()),
            parent_session_file: Some(parent.session_key.clone()),
            child_session_id: None,
            child_session_file: Some(child_key.clone()),
            ttl_ms: req.ttl_ms,
            host: grant.as_ref().map(|g| g.access.clone()),
        };
        let prepared = match lease.engine.prepare_subagent_spawn(prep, &call).await {
            Ok(p) => p,
            Err(EngineCallError::Unimplemented(_)) => pb::PrepareSubagentSpawnResult::default(),
            Err(e) => return Err(CoreError::EngineFailed(format!("Context engine subagent preparation failed: {e}"))),
        };
        drop(grant);
        let created = self.create_child(&parent, &child_key, mode, &req, &prepared).await;
        match created {
            Ok(child) => Ok(api::SpawnSubagentResult {
                child: Some(self.session_info(&child).await?),
                engine_prepared: prepared.prepared,
            }),
            Err(e) => {
                if let Some(token) = prepared.rollback_token {
                    let rb = pb::RollbackSubagentSpawnRequest { rollback_token: token, child_session_key: child_key };
                    if let Err(re) = lease.engine.rollback_subagent_spawn(rb, &call).await {
                        tracing::warn!(error = %re, "subagent rollback failed");
                    }
                }
                Err(e)
            }
        }
    }

    async fn create_child(
        &self,
        parent: &Session,
        child_key: &str,
        mode: pb::SubagentContextMode,
        req: &api::SpawnSubagentRequest,
        prepared: &pb::PrepareSubagentSpawnResult,
    ) -> Result<Session, CoreError> {
        // The key was free before the engine prepared; taken since, the spawn fails.
        if self.store.session(&parent.agent_id, child_key, false).await?.is_some() {
            return Err(CoreError::Precondition(format!(
                "session key {child_key:?} was taken while the engine prepared the subagent"
            )));
        }
        let child = self
            .store
            .session(&parent.agent_id, child_key, true)
            .await?
            .ok_or(CoreError::NoSession(child_key.into()))?;
        if mode == pb::SubagentContextMode::Fork {
            // The child starts from what the parent's model sees.
            let history = self.visible(&parent.session_id).await?.render();
            let entries =
                history.into_iter().map(|m| NewEntry { turn_id: "fork".into(), entry: Entry::Message(m) }).collect();
            self.store.append(&child.session_id, entries).await?;
        }
        let expires_at_ms = req.ttl_ms.map(|t| {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
                + t as i64
        });
        self.store
            .add_subagent(Subagent {
                agent_id: parent.agent_id.clone(),
                child_key: child_key.into(),
                parent_key: parent.session_key.clone(),
                rollback_token: prepared.rollback_token.clone(),
                expires_at_ms,
            })
            .await?;
        Ok(child)
    }

    /// Ends a subagent: OnSubagentEnded (best effort), then the reason's
    /// effect on the child's sessions.
    pub async fn end_subagent(
        &self,
        agent: &str,
        child_key: &str,
        reason: &str,
        cancel: CancellationToken,
    ) -> Result<bool, CoreError> {
        let r = match reason {
            "deleted" => pb::SubagentEndReason::Deleted,
            "completed" => pb::SubagentEndReason::Completed,
            "swept" => pb::SubagentEndReason::Swept,
            "released" => pb::SubagentEndReason::Released,
            other => {
                return Err(CoreError::Invalid {
                    field: "reason",
                    problem: format!("{other:?}: expected deleted, completed, swept or released"),
                });
            }
        };
        let Some(_record) = self.store.take_subagent(agent, child_key).await? else { return Ok(false) };
        let lease = self.lease("subagent-spawn");
        let req = pb::OnSubagentEndedRequest {
            child_session_key: child_key.into(),
            reason: r as i32,
            agent_dir: None,
            workspace_dir: None,
        };
        match lease.engine.on_subagent_ended(req, &Call::new(cancel)).await {
            Ok(_) | Err(EngineCallError::Unimplemented(_)) => {}
            Err(e) => tracing::warn!(error = %e, child = child_key, "OnSubagentEnded failed"),
        }
        match r {
            pb::SubagentEndReason::Deleted => {
                self.store.delete_sessions(agent, child_key).await?;
            }
            pb::SubagentEndReason::Swept => {
                // An expired child is archived, never deleted: nothing is lost.
                self.store.replace_session(agent, child_key, true).await?;
            }
            _ => {}
        }
        Ok(true)
    }

    /// Ends every subagent whose ttl has run out (reason "swept").
    pub async fn sweep_subagents(&self) -> Result<usize, CoreError> {
        let now =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64);
        let expired = self.store.expired_subagents(now).await?;
        let mut n = 0;
        for s in expired {
            if self.end_subagent(&s.agent_id, &s.child_key, "swept", self.call_token()).await? {
                n += 1;
            }
        }
        Ok(n)
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
