//! The engine an operation runs with — leased once, so a turn is never
//! replayed on another engine — and what each call to it carries: a grant
//! for the host callbacks, the runtime settings and context.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::Duration;

use ctxgate_proto::pb;
use tokio::time::Instant;

use crate::config::{Config, OnFailure};
use crate::core::CoreError;
use crate::core::types::{Capability, HostProfile, ModelSpec, Operation, Selection};
use crate::engines::registry::Registry;
use crate::engines::replicas::Replicas;
use crate::engines::{Engine, LEGACY_ID};
use crate::grants::{Callback, GrantError, GrantGuard, Grants, HostOperation, LlmSlot, Scope};
use crate::metrics::Metrics;
use crate::store::{Session, Store};

/// How long a host grant lives when the call has no tighter deadline.
const GRANT_TTL: Duration = Duration::from_secs(600);

/// The engine a turn (or a manual compaction, a spawn) runs with: pinned
/// once chosen, so a turn is never replayed on another engine.
#[derive(Clone)]
pub(super) struct EngineLease {
    /// The engine's name in the gateway — events, metrics, spans, messages,
    /// records: its `plugins.entries` key, or "legacy". The id the engine
    /// declares (`info.id`) is shown beside it in status, nowhere else.
    pub key: String,
    pub engine: Arc<dyn Engine>,
    pub info: Arc<pb::EngineInfo>,
    /// The degradation warning, when the configured engine could not take it.
    pub degraded: Option<String>,
    pub remote: bool,
    /// The durable engine whose record gets this turn through the outbox,
    /// whichever engine serves it: a turn served by legacy while the
    /// engine was quarantined (or degraded) still reaches it, in order.
    pub record: Option<String>,
    /// Who runs the operation, and against which model.
    pub host: HostProfile,
    pub model: ModelSpec,
}

/// What to do when the configured engine's host requirements are not met.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Unmet {
    /// Serve the operation on legacy, with OpenClaw's degrade warning.
    Degrade,
    /// Refuse it before anything is admitted (harness turns, spawns).
    FailClosed,
}

impl EngineLease {
    pub(super) fn selection(&self) -> Selection {
        match (&self.degraded, self.remote) {
            (Some(_), _) => Selection::Degraded,
            (None, true) => Selection::Configured,
            (None, false) => Selection::Default,
        }
    }

    /// RuntimeSettings schema v1 (reference §1.5).
    pub(super) fn runtime_settings(&self, budget: u64, degraded: Option<pb::ReasonCode>) -> pb::RuntimeSettings {
        let model = self.model.id.clone();
        let mode = match (degraded, self.degraded.is_some()) {
            (Some(_), _) => pb::RuntimeMode::Degraded,
            (None, true) => pb::RuntimeMode::Fallback,
            (None, false) => pb::RuntimeMode::Normal,
        };
        let source = if self.key == LEGACY_ID { pb::SelectionSource::Default } else { pb::SelectionSource::Configured };
        let harness_id = self.host.id.strip_prefix("agent-harness:").map(str::to_owned);
        pb::RuntimeSettings {
            schema_version: 1,
            runtime: Some(pb::RuntimeInfo { host: "ctxgate".into(), mode: mode as i32, harness_id, runtime_id: None }),
            model: Some(pb::ModelSelection {
                requested: Some(model.clone()),
                resolved: Some(model),
                provider: Some(self.model.provider.clone()).filter(|p| !p.is_empty()),
                family: None,
            }),
            context_engine_selection: Some(pb::EngineSelection {
                selected_id: Some(self.key.clone()),
                source: source as i32,
            }),
            execution_host: Some(pb::ExecutionHost {
                id: Some(self.host.id.clone()),
                label: Some(self.host.label.clone()),
            }),
            limits: Some(pb::Limits {
                prompt_token_budget: Some(budget),
                max_output_tokens: Some(self.model.max_output_tokens),
            }),
            diagnostics: Some(pb::Diagnostics {
                fallback_reason: if self.degraded.is_some() { pb::ReasonCode::RuntimeUnavailable as i32 } else { 0 },
                degraded_reason: degraded.map_or(0, |d| d as i32),
            }),
        }
    }

    /// RuntimeContext for a call about `session` (reference §1.4).
    pub(super) fn runtime_context(&self, session: &Session, budget: u64, current: u64) -> pb::RuntimeContext {
        pb::RuntimeContext {
            token_budget: Some(budget),
            current_token_count: Some(current),
            transcript_storage: pb::TranscriptStorage::Sqlite as i32,
            session_target: Some(session_target(session)),
            provider: Some(self.model.provider.clone()).filter(|p| !p.is_empty()),
            model_id: Some(self.model.id.clone()),
            ..Default::default()
        }
    }
}

/// The session as the contract names it.
pub(super) fn session_target(s: &Session) -> pb::SessionTarget {
    pb::SessionTarget {
        agent_id: Some(s.agent_id.clone()),
        session_id: Some(s.session_id.clone()),
        session_key: Some(s.session_key.clone()),
        store_path: None,
        thread_id: None,
    }
}

/// The engines: the registry (the configured engine's replicas, health
/// and quarantine, and legacy), which of them take durable turns, and the
/// grants their calls carry back to the Host service. Leases an engine to
/// each operation.
pub struct Engines {
    registry: RwLock<Arc<Registry>>,
    grants: Arc<Grants>,
    /// Where engines reach the Host service (set once the API is bound).
    host_endpoint: OnceLock<String>,
    /// Engines known to be durable (their last attach said so; kept in the
    /// store), so turns legacy serves before an attach still reach them.
    durable: Mutex<HashSet<String>>,
    store: Arc<dyn Store>,
    metrics: Metrics,
}

impl Engines {
    /// Builds the registry (starts its health monitors: call inside a tokio
    /// runtime).
    pub fn new(config: &Config, store: Arc<dyn Store>, metrics: Metrics) -> Self {
        Self {
            registry: RwLock::new(Arc::new(Registry::build(config, &metrics))),
            grants: Arc::new(Grants::new(config.gateway.limits.host_callbacks)),
            host_endpoint: OnceLock::new(),
            durable: Mutex::default(),
            store,
            metrics,
        }
    }

    pub fn registry(&self) -> Arc<Registry> {
        self.registry.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// New clients and monitors for `config`'s engines, quarantines
    /// cleared, the slot re-resolved. Leases taken before keep theirs.
    pub fn reload(&self, config: &Config) {
        let next = Arc::new(Registry::build(config, &self.metrics));
        *self.registry.write().unwrap_or_else(|e| e.into_inner()) = next;
    }

    /// Where engines call the Host service back (set once, after binding).
    pub fn set_host_endpoint(&self, endpoint: String) {
        let _ = self.host_endpoint.set(endpoint);
    }

    /// A host callback under its grant's budget.
    pub fn authorise(&self, token: &str, session_id: Option<&str>, op: HostOperation) -> Result<Callback, GrantError> {
        self.grants.authorise(token, session_id, op)
    }

    /// One of the engine's model-call slots (Host.LlmComplete).
    pub fn llm_slot(&self, engine_id: &str) -> Result<LlmSlot, GrantError> {
        self.grants.llm_slot(engine_id)
    }

    /// Loads the engines known to be durable (call once at start).
    pub async fn load_durable(&self) -> Result<(), CoreError> {
        let known = self.store.durable_engines().await?;
        self.durable.lock().unwrap_or_else(|e| e.into_inner()).extend(known);
        Ok(())
    }

    /// Whether `engine` takes durable turns: from its attach when it has
    /// one (remembered in the store when that changes), else from the last
    /// one remembered.
    pub fn durable(&self, engine: &Replicas) -> bool {
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

    /// Chooses the engine for one operation: the configured one if it is in
    /// service and `host` has what it needs; else legacy with one warning
    /// (a quarantine always degrades; unmet host requirements degrade or,
    /// with [`Unmet::FailClosed`], refuse with OpenClaw's message).
    pub(super) fn lease(
        &self,
        operation: Operation,
        host: &HostProfile,
        model: ModelSpec,
        unmet: Unmet,
    ) -> Result<EngineLease, CoreError> {
        let registry = self.registry();
        // Known durable from its last attach (in this process or, kept in
        // the store, an earlier one), even while it is quarantined.
        let record = registry.selected().filter(|g| self.durable(g)).map(|g| g.id().to_owned());
        let lease = |key: String, engine: Arc<dyn Engine>, info, degraded, remote| EngineLease {
            key,
            engine,
            info,
            degraded,
            remote,
            record: record.clone(),
            host: host.clone(),
            model: model.clone(),
        };
        let legacy = |degraded| lease(LEGACY_ID.into(), registry.legacy(), registry.legacy.info(), degraded, false);
        let Some(g) = registry.selected() else { return Ok(legacy(None)) };
        let reason = if let Some(q) = g.quarantine_record() {
            Some(format!("it is quarantined after failing during {}: {}", q.cause, q.reason))
        } else {
            match host.unmet(g.id(), &g.info(), operation) {
                Err(m) if unmet == Unmet::FailClosed => return Err(CoreError::Precondition(m)),
                r => r.err(),
            }
        };
        Ok(match reason {
            Some(reason) if g.on_failure() == OnFailure::Fail => {
                let id = g.id();
                return Err(CoreError::EngineFailed(format!(
                    "Context engine \"{id}\" cannot serve this turn: {reason}. plugins.entries.{id}.onFailure is \"fail\", so the turn fails instead of running on \"{LEGACY_ID}\"."
                )));
            }
            Some(reason) => {
                let id = g.id();
                let warning = format!(
                    "Context engine \"{id}\" degraded to \"{LEGACY_ID}\" for this logical turn: {reason}. The \"{LEGACY_ID}\" engine will handle only this turn; configuration is unchanged, and \"{id}\" will be retried next turn."
                );
                tracing::warn!("{warning}");
                legacy(Some(warning))
            }
            None => lease(g.id().to_owned(), g.clone(), g.info(), None, true),
        })
    }

    /// A grant for one engine call on `session`, expiring with the call.
    pub(super) fn grant(
        &self,
        lease: &EngineLease,
        session: &Session,
        fence_before: Option<&str>,
        deadline: Option<Instant>,
    ) -> Option<GrantGuard> {
        if !lease.remote {
            return None;
        }
        let ttl = deadline.map_or(GRANT_TTL, |d| d.saturating_duration_since(Instant::now()));
        let scope = Scope {
            // The config entry, not the id the engine declares: its model
            // slots and audit name are the operator's, not the peer's.
            engine_id: lease.key.clone(),
            session_id: session.session_id.clone(),
            session_key: session.session_key.clone(),
            operations: host_operations(lease),
            fence_before: fence_before.map(str::to_owned),
        };
        self.issue(scope, ttl)
    }

    /// A grant for delivering a queued commit: the operations its turn's
    /// host allowed, as [`commit_draft`](super::outbox::Delivery::commit_draft)
    /// wrote them in the queued request (a grant's token cannot be kept,
    /// it dies with its call), for the one call delivering it now.
    pub(super) fn commit_grant(&self, engine_id: &str, request: &pb::CommitTurnRequest) -> Option<GrantGuard> {
        let allowed = request.host.as_ref()?.grant.as_ref()?;
        let scope = Scope {
            engine_id: engine_id.to_owned(),
            session_id: request.session_id.clone(),
            session_key: request.session_key.clone().unwrap_or_default(),
            operations: allowed.operations.iter().filter_map(|o| HostOperation::from_name(o)).collect(),
            fence_before: None,
        };
        self.issue(scope, GRANT_TTL)
    }

    fn issue(&self, scope: Scope, ttl: Duration) -> Option<GrantGuard> {
        let endpoint = self.host_endpoint.get()?;
        Some(self.grants.issue(endpoint, scope, ttl))
    }
}

/// What a call of a turn on `lease` may call back for: the transcript,
/// and the host model only when the host has runtime-llm-complete.
pub(super) fn host_operations(lease: &EngineLease) -> Vec<HostOperation> {
    let mut operations = vec![HostOperation::ReadTranscript];
    if lease.host.has(Capability::RuntimeLlmComplete) {
        operations.push(HostOperation::LlmComplete);
    }
    operations
}
