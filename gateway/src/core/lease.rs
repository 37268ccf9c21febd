//! Engines for one operation: the lease, grants, runtime settings, bootstrap
//! and maintenance (foreground or on the session's background lane).

use super::*;

impl Core {
    // --- engines ---------------------------------------------------------

    /// Chooses the engine for one operation ("agent-run", "manual-compact"):
    /// the configured one if it is in service and the host has what it
    /// needs, else legacy with one warning.
    pub(super) fn lease(&self, operation: &str) -> Lease {
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
    pub(super) fn runtime_settings(
        &self,
        lease: &Lease,
        budget: u64,
        degraded: Option<pb::ReasonCode>,
    ) -> pb::RuntimeSettings {
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

    pub(super) fn runtime_context(&self, session: &Session, budget: u64, current: u64) -> pb::RuntimeContext {
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
    pub(super) async fn bootstrap_if_new(
        &self,
        lease: &Lease,
        session: &Session,
        fence: &str,
        budget: u64,
        call: &Call,
    ) {
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
    pub(super) async fn maintain(
        &self,
        lease: &Lease,
        session: &Session,
        reason: pb::MaintainReason,
        budget: u64,
        call: &Call,
    ) {
        // Runs after every turn: an engine that does not list Maintain (the
        // legacy one included) is not asked for an UNIMPLEMENTED each time.
        if !lease.info.implemented_methods.iter().any(|m| m == "Maintain") {
            return;
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
    pub(super) fn schedule_background_maintenance(self: &Arc<Self>, lease: Lease, session: Session, budget: u64) {
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
}
