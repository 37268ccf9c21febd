//! Engines for one operation: the lease, grants, runtime settings, bootstrap
//! and maintenance (foreground or on the session's background lane).

use super::*;

impl Core {
    // --- engines ---------------------------------------------------------

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
    ) -> Result<Lease, CoreError> {
        let registry = self.registry();
        // Known durable from its last attach (in this process or, kept in
        // the store, an earlier one), even while it is quarantined.
        let record = registry.selected().filter(|g| self.durable_engine(g)).map(|g| g.id().to_owned());
        let lease = |key: String, engine: Arc<dyn Engine>, info, degraded, remote| Lease {
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
            match host.unmet(&g.info(), operation) {
                Err(m) if unmet == Unmet::FailClosed => return Err(CoreError::Precondition(m)),
                r => r.err(),
            }
        };
        Ok(match reason {
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
    /// The host model is granted only to hosts with runtime-llm-complete.
    pub(super) fn grant(
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
        let mut operations = vec![HostOperation::ReadTranscript];
        if lease.host.has(Capability::RuntimeLlmComplete) {
            operations.push(HostOperation::LlmComplete);
        }
        let scope = Scope {
            engine_id: lease.info.id.clone(),
            session_id: session.session_id.clone(),
            session_key: session.session_key.clone(),
            operations,
            fence_before: fence_before.map(str::to_owned),
        };
        Some(self.grants.issue(endpoint, scope, ttl))
    }

    /// RuntimeSettings schema v1 (reference §1.5).
    pub(super) fn runtime_settings(
        &self,
        lease: &Lease,
        budget: u64,
        degraded: Option<pb::ReasonCode>,
    ) -> pb::RuntimeSettings {
        let model = lease.model.id.clone();
        let mode = match (degraded, lease.degraded.is_some()) {
            (Some(_), _) => pb::RuntimeMode::Degraded,
            (None, true) => pb::RuntimeMode::Fallback,
            (None, false) => pb::RuntimeMode::Normal,
        };
        let source =
            if lease.info.id == LEGACY_ID { pb::SelectionSource::Default } else { pb::SelectionSource::Configured };
        let harness_id = lease.host.id.strip_prefix("agent-harness:").map(str::to_owned);
        pb::RuntimeSettings {
            schema_version: 1,
            runtime: Some(pb::RuntimeInfo { host: "ctxgate".into(), mode: mode as i32, harness_id, runtime_id: None }),
            model: Some(pb::ModelSelection {
                requested: Some(model.clone()),
                resolved: Some(model),
                provider: Some(lease.model.provider.clone()).filter(|p| !p.is_empty()),
                family: None,
            }),
            context_engine_selection: Some(pb::EngineSelection {
                selected_id: Some(lease.info.id.clone()),
                source: source as i32,
            }),
            execution_host: Some(pb::ExecutionHost {
                id: Some(lease.host.id.clone()),
                label: Some(lease.host.label.clone()),
            }),
            limits: Some(pb::Limits {
                prompt_token_budget: Some(budget),
                max_output_tokens: Some(lease.model.max_output_tokens),
            }),
            diagnostics: Some(pb::Diagnostics {
                fallback_reason: if lease.degraded.is_some() { pb::ReasonCode::RuntimeUnavailable as i32 } else { 0 },
                degraded_reason: degraded.map_or(0, |d| d as i32),
            }),
        }
    }

    pub(super) fn runtime_context(
        &self,
        lease: &Lease,
        session: &Session,
        budget: u64,
        current: u64,
    ) -> pb::RuntimeContext {
        pb::RuntimeContext {
            token_budget: Some(budget),
            current_token_count: Some(current),
            transcript_storage: pb::TranscriptStorage::Sqlite as i32,
            session_target: Some(target(session)),
            provider: Some(lease.model.provider.clone()).filter(|p| !p.is_empty()),
            model_id: Some(lease.model.id.clone()),
            ..Default::default()
        }
    }

    /// Bootstrap (then maintain(bootstrap)) a session the remote engine has
    /// not seen in this process, for hosts with the bootstrap capability.
    /// Returns the rewrite's id map (empty when nothing was rewritten).
    pub(super) async fn bootstrap_if_new(
        &self,
        lease: &Lease,
        session: &Session,
        fence: &str,
        budget: u64,
        call: &Call,
    ) -> Remap {
        if !lease.remote || !lease.host.has(Capability::Bootstrap) {
            return Remap::new();
        }
        let key = (lease.info.id.clone(), session.session_id.clone());
        if !self.bootstrapped.lock().unwrap_or_else(|e| e.into_inner()).first_time(key) {
            return Remap::new();
        }
        let grant = self.grant(lease, session, Some(fence), call.deadline);
        let req = pb::BootstrapRequest {
            session_id: session.session_id.clone(),
            session_key: Some(session.session_key.clone()),
            session_target: Some(target(session)),
            session_file: session.session_key.clone(),
            runtime_settings: Some(self.runtime_settings(lease, budget, None)),
            runtime_context: Some(self.runtime_context(lease, session, budget, 0)),
            host: grant.as_ref().map(|g| g.access.clone()),
        };
        match lease.engine.bootstrap(req, call).await {
            Ok(r) if r.bootstrapped => {
                return self.maintain(lease, session, pb::MaintainReason::Bootstrap, budget, call).await;
            }
            Ok(_) | Err(EngineCallError::Unimplemented(_)) => {}
            Err(e) => tracing::warn!(error = %e, "context engine bootstrap failed"),
        }
        Remap::new()
    }

    /// Maintain and apply the engine's rewrites as a new branch; returns
    /// the rewrite's id map (empty when nothing was rewritten).
    pub(super) async fn maintain(
        &self,
        lease: &Lease,
        session: &Session,
        reason: pb::MaintainReason,
        budget: u64,
        call: &Call,
    ) -> Remap {
        // Runs after every turn: an engine that does not list Maintain (the
        // legacy one included) is not asked for an UNIMPLEMENTED each time.
        if !Method::Maintain.listed_in(&lease.info.implemented_methods) || !lease.host.has(Capability::Maintain) {
            return Remap::new();
        }
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
                ..self.runtime_context(lease, session, budget, 0)
            }),
            host: grant.as_ref().map(|g| g.access.clone()),
        };
        match lease.engine.maintain(req, call).await {
            Ok(r) if !r.replacements.is_empty() => {
                let replacements = r.replacements.into_iter().filter_map(|x| Some((x.entry_id, x.message?))).collect();
                match self.store.rewrite(&session.session_id, replacements).await {
                    Ok(o) if o.changed => {
                        tracing::info!(
                            session = %session.session_id, rewritten = o.rewritten_entries, bytes_freed = o.bytes_freed,
                            "context engine maintenance changed the transcript"
                        );
                        return o.remap;
                    }
                    Ok(o) => tracing::debug!(reason = %o.reason, "maintenance rewrote nothing"),
                    Err(e) => tracing::warn!(error = %e, "applying maintenance rewrites failed"),
                }
            }
            Ok(_) | Err(EngineCallError::Unimplemented(_) | EngineCallError::Cancelled) => {}
            Err(e) => tracing::warn!(error = %e, "context engine maintain failed"),
        }
        Remap::new()
    }

    /// After a turn: maintain(turn) in the foreground, or — for engines that
    /// ask for it — on the session's background lane: one run at a time,
    /// plus one coalesced follow-up, each under the session's lock (so it
    /// never rewrites a branch a turn is writing), cancelled on shutdown.
    pub(super) async fn maintain_after_turn(
        self: &Arc<Self>,
        lease: &Lease,
        session: &Session,
        budget: u64,
        call: &Call,
    ) {
        if lease.info.turn_maintenance_mode != pb::TurnMaintenanceMode::Background as i32 {
            self.maintain(lease, session, pb::MaintainReason::Turn, budget, call).await;
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
        let (core, lease, session) = (self.clone(), lease.clone(), session.clone());
        let stop = self.shutdown.child_token();
        tokio::spawn(async move {
            loop {
                if let Ok(_guard) = core.enter(&session.session_id, &stop, false).await {
                    core.maintain(&lease, &session, pb::MaintainReason::Turn, budget, &Call::new(stop.clone())).await;
                }
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
}
