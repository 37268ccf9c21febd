//! Subagents: spawn (prepare, create, roll back on failure), end, sweep.

use ctxgate_proto::limits;
use ctxgate_proto::pb::{self, transcript_entry::Entry};
use tokio_util::sync::CancellationToken;

use crate::core::engine_lease::Unmet;
use crate::core::types::{HostProfile, Operation};
use crate::core::{Core, CoreError, now_unix_ms};
use crate::engines::{Call, EngineCallError};
use crate::store::{NewEntry, Session, Subagent};

/// The longest subagent ttl kept (a client's larger one is clamped to it).
const MAX_SUBAGENT_TTL_MS: u64 = 365 * 24 * 3600 * 1000;

impl Core {
    // --- subagents ------------------------------------------------------------

    /// Spawns a subagent session of `parent`: the engine prepares (fails
    /// closed), then the gateway creates the child; a failure after
    /// preparation rolls the engine back. Returns the child and whether the
    /// engine prepared anything.
    pub async fn spawn_subagent(
        &self,
        parent: &Session,
        child_key: &str,
        context_mode: &str,
        ttl_ms: Option<u64>,
        cancel: CancellationToken,
    ) -> Result<(Session, bool), CoreError> {
        let child_key = child_key.trim().to_owned();
        if child_key.is_empty() {
            return Err(CoreError::invalid("child_session_key", "is required"));
        }
        if child_key.len() > limits::MAX_ID_BYTES {
            return Err(CoreError::too_large("child_session_key", format!("is over {} bytes", limits::MAX_ID_BYTES)));
        }
        crate::core::printable("child_session_key", &child_key)?;
        if child_key == parent.session_key {
            return Err(CoreError::invalid("child_session_key", "must differ from the parent's key"));
        }
        let mode = match context_mode {
            "" | "isolated" => pb::SubagentContextMode::Isolated,
            "fork" => pb::SubagentContextMode::Fork,
            other => return Err(CoreError::invalid("context_mode", format!("{other:?}: expected isolated or fork"))),
        };
        if self.store.session(&parent.agent_id, &child_key, false).await?.is_some() {
            return Err(CoreError::Precondition(format!("session key {child_key:?} is already in use")));
        }
        // Spawning fails closed: an engine that cannot run here refuses.
        let host = HostProfile::embedded();
        let lease = self.engines.lease(Operation::SubagentSpawn, &host, self.provider_model(), Unmet::FailClosed)?;
        let call = Call::new(cancel);
        let grant = self.engines.grant(&lease, parent, None, None);
        let prep = pb::PrepareSubagentSpawnRequest {
            parent_session_key: parent.session_key.clone(),
            child_session_key: child_key.clone(),
            context_mode: mode as i32,
            parent_session_id: Some(parent.session_id.clone()),
            parent_session_file: Some(parent.session_key.clone()),
            child_session_id: None,
            child_session_file: Some(child_key.clone()),
            ttl_ms,
            host: grant.as_ref().map(|g| g.access.clone()),
        };
        let prepared = match lease.engine.prepare_subagent_spawn(prep, &call).await {
            Ok(p) => p,
            Err(EngineCallError::Unimplemented(_)) => pb::PrepareSubagentSpawnResult::default(),
            Err(e) => return Err(CoreError::EngineFailed(format!("Context engine subagent preparation failed: {e}"))),
        };
        drop(grant);
        let created = self.create_child(parent, &child_key, mode, ttl_ms, &prepared).await;
        match created {
            Ok(child) => Ok((child, prepared.prepared)),
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
        ttl_ms: Option<u64>,
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
            let history = self.visible_messages(parent).await?;
            let entries =
                history.into_iter().map(|m| NewEntry { turn_id: "fork".into(), entry: Entry::Message(m) }).collect();
            self.store.append(&child.session_id, entries).await?;
        }
        // A peer's ttl: at most a year, never an overflow.
        let expires_at_ms = ttl_ms.map(|t| now_unix_ms().saturating_add(t.min(MAX_SUBAGENT_TTL_MS) as i64));
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
                return Err(CoreError::invalid(
                    "reason",
                    format!("{other:?}: expected deleted, completed, swept or released"),
                ));
            }
        };
        let Some(_record) = self.store.take_subagent(agent, child_key).await? else { return Ok(false) };
        let host = HostProfile::embedded();
        let lease = self.engines.lease(Operation::SubagentSpawn, &host, self.provider_model(), Unmet::Degrade)?;
        let req = pb::OnSubagentEndedRequest {
            child_session_key: child_key.into(),
            reason: r as i32,
            agent_dir: None,
            workspace_dir: None,
        };
        match lease.engine.on_subagent_ended(req, &Call::new(cancel)).await {
            Ok(_) | Err(EngineCallError::Unimplemented(_)) => {}
            Err(e) => tracing::warn!(error = %e, child = ?child_key, "OnSubagentEnded failed"),
        }
        match r {
            pb::SubagentEndReason::Deleted => {
                self.store.delete_sessions(agent, child_key).await?;
            }
            pb::SubagentEndReason::Swept => {
                // An expired child is archived, never deleted: nothing is lost.
                self.store.archive_session(agent, child_key).await?;
            }
            _ => {}
        }
        Ok(true)
    }

    /// Ends every subagent whose ttl has run out (reason "swept").
    pub async fn sweep_subagents(&self) -> Result<usize, CoreError> {
        let expired = self.store.expired_subagents(now_unix_ms()).await?;
        let mut n = 0;
        for s in expired {
            if self.end_subagent(&s.agent_id, &s.child_key, "swept", self.call_token()).await? {
                n += 1;
            }
        }
        Ok(n)
    }
}
