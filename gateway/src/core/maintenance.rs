//! An engine's upkeep of a session: Bootstrap (then maintain(bootstrap))
//! the first time this process sees it, and maintain after every turn — in
//! the foreground, or on the session's background lane for engines that
//! ask for it. Rewrites are applied as a new branch.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use ctxgate_proto::pb::{AgentMessage, transcript_entry::Entry};
use ctxgate_proto::{Method, pb};
use tokio_util::sync::CancellationToken;

use crate::core::claims::SessionGate;
use crate::core::engine_lease::{EngineLease, Engines, session_target};
use crate::core::outbox::Delivery;
use crate::core::rewrite_rate::RewriteRate;
use crate::core::types::Capability;
use crate::core::{CoreError, Forgetful, Remap};
use crate::engines::{Call, EngineCallError};
use crate::store::{Session, Store};

/// (engine, session) pairs remembered as bootstrapped before the set starts
/// over (a Bootstrap is idempotent: forgetting one costs a repeated call,
/// never memory).
const MAX_BOOTSTRAPPED: usize = 65_536;

/// Whether an engine has Maintain(TURN) work after a turn, as its
/// CommitTurn or AfterTurn answer says (`maintenance_due`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Upkeep {
    /// Unset or true: ask, as after every turn.
    #[default]
    Due,
    /// The engine said false: skip the round trip.
    NotDue,
}

impl Upkeep {
    pub fn hinted(maintenance_due: Option<bool>) -> Self {
        if maintenance_due == Some(false) { Self::NotDue } else { Self::Due }
    }

    /// Due if either is: several commits delivered at once skip Maintain
    /// only if none of them asked for it.
    pub fn and(self, other: Self) -> Self {
        if self == Self::NotDue && other == Self::NotDue { Self::NotDue } else { Self::Due }
    }
}

/// Engines' upkeep of sessions: Bootstrap once per (engine, session) in
/// this process, Maintain after turns (on a background lane per session
/// for engines that ask for it), their rewrites applied as a new branch.
pub struct Maintenance {
    store: Arc<dyn Store>,
    engines: Arc<Engines>,
    delivery: Arc<Delivery>,
    gate: Arc<SessionGate>,
    /// (engine, session) pairs bootstrapped by this process.
    bootstrapped: Mutex<Forgetful<(String, String)>>,
    /// Background lanes: sessions with a run going, and whether a
    /// follow-up is queued.
    lanes: Mutex<HashMap<String, bool>>,
    /// Rewrites applied per session an hour (`maintainRewritesPerSessionPerHour`).
    rewrites: Mutex<RewriteRate>,
    shutdown: CancellationToken,
}

impl Maintenance {
    pub fn new(
        store: Arc<dyn Store>,
        engines: Arc<Engines>,
        delivery: Arc<Delivery>,
        gate: Arc<SessionGate>,
        rewrites_per_hour: u32,
        shutdown: CancellationToken,
    ) -> Self {
        Self {
            store,
            engines,
            delivery,
            gate,
            bootstrapped: Mutex::new(Forgetful::new(MAX_BOOTSTRAPPED)),
            lanes: Mutex::default(),
            rewrites: Mutex::new(RewriteRate::new(rewrites_per_hour)),
            shutdown,
        }
    }

    fn rewrites(&self) -> std::sync::MutexGuard<'_, RewriteRate> {
        self.rewrites.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Forgets which sessions were bootstrapped (new engines: they are
    /// bootstrapped again).
    pub fn forget_bootstraps(&self) {
        self.bootstrapped.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    /// Bootstrap (then maintain(bootstrap)) a session the remote engine has
    /// not seen in this process, for hosts with the bootstrap capability.
    /// Returns the rewrite's id map (empty when nothing was rewritten).
    pub(super) async fn bootstrap_if_new(
        &self,
        lease: &EngineLease,
        session: &Session,
        fence: &str,
        budget: u64,
        call: &Call,
    ) -> Remap {
        if !lease.remote || !lease.host.has(Capability::Bootstrap) {
            return Remap::new();
        }
        let key = (lease.key.clone(), session.session_id.clone());
        if !self.bootstrapped.lock().unwrap_or_else(|e| e.into_inner()).first_time(key) {
            return Remap::new();
        }
        let grant = self.engines.grant(lease, session, Some(fence), call.deadline);
        let req = pb::BootstrapRequest {
            session_id: session.session_id.clone(),
            session_key: Some(session.session_key.clone()),
            session_target: Some(session_target(session)),
            session_file: session.session_key.clone(),
            runtime_settings: Some(lease.runtime_settings(budget, None)),
            runtime_context: Some(lease.runtime_context(session, budget, 0)),
            host: grant.as_ref().map(|g| g.access.clone()),
        };
        match lease.engine.bootstrap(req, call).await {
            Ok(r) if r.bootstrapped => {
                // A DELTA engine that imported the history holds it: no resync.
                if let Some(n) = r.imported_messages.filter(|_| crate::engines::delta(&lease.info))
                    && let Err(e) = self.delivery.adopt_import(lease, session, fence, n).await
                {
                    tracing::warn!(error = %e, "recording the bootstrapped engine's cursor failed; it is resynced");
                }
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
        lease: &EngineLease,
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
        let grant = self.engines.grant(lease, session, None, call.deadline);
        let req = pb::MaintainRequest {
            session_id: session.session_id.clone(),
            session_key: Some(session.session_key.clone()),
            session_target: Some(session_target(session)),
            session_file: session.session_key.clone(),
            reason: reason as i32,
            runtime_settings: Some(lease.runtime_settings(budget, None)),
            runtime_context: Some(pb::RuntimeContext {
                allow_deferred_compaction_execution: call.deadline.is_none() && reason == pb::MaintainReason::Turn,
                ..lease.runtime_context(session, budget, 0)
            }),
            host: grant.as_ref().map(|g| g.access.clone()),
        };
        match lease.engine.maintain(req, call).await {
            Ok(r) if !r.replacements.is_empty() => {
                let replacements: Vec<(String, AgentMessage)> =
                    r.replacements.into_iter().filter_map(|x| Some((x.entry_id, x.message?))).collect();
                match self.refused(&session.session_id, &replacements).await {
                    Ok(None) => {}
                    Ok(Some(why)) => {
                        tracing::warn!(
                            engine = %lease.key, session = %session.session_id, why,
                            "context engine maintenance asked for a rewrite it may not make; the transcript is unchanged"
                        );
                        return Remap::new();
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "reading the branch for maintenance rewrites failed");
                        return Remap::new();
                    }
                }
                if !self.rewrites().allows(&session.session_id) {
                    tracing::warn!(
                        engine = %lease.key, session = %session.session_id,
                        "context engine maintenance is over this session's rewrites for the hour \
                         (gateway.limits.maintainRewritesPerSessionPerHour); the transcript is unchanged"
                    );
                    return Remap::new();
                }
                match self.store.rewrite(&session.session_id, replacements).await {
                    Ok(o) if o.changed => {
                        self.rewrites().applied(&session.session_id);
                        tracing::info!(
                            session = %session.session_id, rewritten = o.rewritten_entries, bytes_freed = o.bytes_freed,
                            "context engine maintenance changed the transcript"
                        );
                        return o.remap;
                    }
                    Ok(o) => {
                        tracing::debug!(reason = %crate::peer_text::capped(&o.reason, 300), "maintenance rewrote nothing")
                    }
                    Err(e) => tracing::warn!(error = %e, "applying maintenance rewrites failed"),
                }
            }
            Ok(_) | Err(EngineCallError::Unimplemented(_) | EngineCallError::Cancelled) => {}
            Err(e) => tracing::warn!(error = %e, "context engine maintain failed"),
        }
        Remap::new()
    }

    /// Why the engine may not make `replacements` (one it may not make
    /// refuses them all), read against the session's branch.
    async fn refused(
        &self,
        session_id: &str,
        replacements: &[(String, AgentMessage)],
    ) -> Result<Option<String>, CoreError> {
        let branch = self.store.branch(session_id).await?;
        for e in &branch {
            let Some(Entry::Message(old)) = &e.entry else { continue };
            let Some((_, new)) = replacements.iter().find(|(id, new)| *id == old.id && new.content != old.content)
            else {
                continue;
            };
            if let Err(why) = may_replace(old, new) {
                return Ok(Some(format!("message {}: {why}", old.id)));
            }
        }
        Ok(None)
    }

    /// After a turn: maintain(turn) in the foreground, or — for engines that
    /// ask for it — on the session's background lane: one run at a time,
    /// plus one coalesced follow-up, each under the session's lock (so it
    /// never rewrites a branch a turn is writing), cancelled on shutdown.
    pub(super) async fn maintain_after_turn(
        self: &Arc<Self>,
        lease: &EngineLease,
        session: &Session,
        budget: u64,
        call: &Call,
    ) {
        if lease.info.turn_maintenance_mode != pb::TurnMaintenanceMode::Background as i32 {
            self.maintain(lease, session, pb::MaintainReason::Turn, budget, call).await;
            return;
        }
        {
            let mut lanes = self.lanes.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(follow_up) = lanes.get_mut(&session.session_id) {
                *follow_up = true;
                return;
            }
            lanes.insert(session.session_id.clone(), false);
        }
        let (this, lease, session) = (self.clone(), lease.clone(), session.clone());
        let stop = self.shutdown.child_token();
        tokio::spawn(async move {
            loop {
                if let Ok(_guard) = this.gate.enter(&session.session_id, &stop, false).await {
                    this.maintain(&lease, &session, pb::MaintainReason::Turn, budget, &Call::new(stop.clone())).await;
                }
                let mut lanes = this.lanes.lock().unwrap_or_else(|e| e.into_inner());
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

/// Whether an engine's Maintain may replace `old` with `new` (OpenClaw
/// lets an engine rewrite anything; ctxgate's engines are peers): never a
/// user's or a system message — what the user said is not the engine's to
/// change — the role kept, and the content not grown: maintenance makes
/// room, it does not write into the history.
fn may_replace(old: &AgentMessage, new: &AgentMessage) -> Result<(), &'static str> {
    use pb::Role;
    if matches!(Role::try_from(old.role), Ok(Role::User | Role::System) | Err(_)) {
        return Err("a user's or a system message is never rewritten");
    }
    if new.role != old.role {
        return Err("a replacement keeps the message's role");
    }
    if ctxgate_proto::validate::content_bytes(new) > ctxgate_proto::validate::content_bytes(old) {
        return Err("a replacement may not grow the message");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::Upkeep::{self, Due, NotDue};
    use super::{AgentMessage, may_replace, pb};

    #[test]
    fn maintain_is_skipped_only_when_every_answer_said_so() {
        assert_eq!([None, Some(true), Some(false)].map(Upkeep::hinted), [Due, Due, NotDue]);
        assert_eq!(NotDue.and(NotDue), NotDue);
        assert_eq!([Due.and(NotDue), NotDue.and(Due), Due.and(Due)], [Due; 3]);
    }

    fn message(role: pb::Role, text: &str) -> AgentMessage {
        AgentMessage {
            id: "m".into(),
            role: role as i32,
            content: vec![pb::ContentPart { part: Some(pb::content_part::Part::Text(text.into())) }],
            ..Default::default()
        }
    }

    #[test]
    fn maintenance_may_shrink_an_assistant_or_tool_message_and_nothing_else() {
        use pb::Role::*;
        assert!(may_replace(&message(Assistant, "a long answer"), &message(Assistant, "short")).is_ok());
        assert!(may_replace(&message(Tool, "a long result"), &message(Tool, "elided")).is_ok());
        assert_eq!(
            may_replace(&message(User, "my words"), &message(User, "yours")),
            Err("a user's or a system message is never rewritten")
        );
        assert!(may_replace(&message(System, "rules"), &message(System, "none")).is_err());
        assert_eq!(
            may_replace(&message(Tool, "a long result"), &message(User, "short")),
            Err("a replacement keeps the message's role")
        );
        assert_eq!(
            may_replace(&message(Assistant, "short"), &message(Assistant, "a much longer answer")),
            Err("a replacement may not grow the message")
        );
    }
}
