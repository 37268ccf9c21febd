//! Compaction: manual, or inside a turn; the engine's own or the built-in
//! one it delegates to, in one safety window.

use std::sync::Arc;
use std::time::Duration;

use ctxgate_proto::pb::{self, transcript_entry::Entry};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::compaction::{self, CompactionError};
use crate::config::{Config, IdentifierPolicy};
use crate::core::claims::SessionGate;
use crate::core::engine_lease::{EngineLease, Engines, Unmet, session_target};
use crate::core::types::{CompactionDone, CompactionEvent, HostProfile, ModelSpec, Operation, Trigger};
use crate::core::{CompactionSink, CoreError};
use crate::engines::{Call, CompactReply, EngineCallError};
use crate::metrics::Metrics;
use crate::provider::ModelError;
use crate::store::{NewEntry, Session, Store};
use crate::summarize::Summarizer;
use crate::transcript::{self, Visible};

/// Compaction of a session: the engine's own, or the built-in one (the
/// summarizer's) it delegates to, within one safety window.
pub struct Compactor {
    config: Arc<Config>,
    store: Arc<dyn Store>,
    engines: Arc<Engines>,
    gate: Arc<SessionGate>,
    summarizer: Arc<dyn Summarizer>,
    metrics: Metrics,
    /// The gateway's own model (a manual compaction runs against it).
    model: ModelSpec,
}

impl Compactor {
    pub fn new(
        config: Arc<Config>,
        store: Arc<dyn Store>,
        engines: Arc<Engines>,
        gate: Arc<SessionGate>,
        summarizer: Arc<dyn Summarizer>,
        metrics: Metrics,
        model: ModelSpec,
    ) -> Self {
        Self { config, store, engines, gate, summarizer, metrics, model }
    }

    async fn visible(&self, session_id: &str) -> Result<Visible, CoreError> {
        Ok(transcript::visible(&self.store.visible_tail(session_id).await?))
    }

    /// Manual compaction (`/compact`): target=threshold, force. Waits for
    /// a running turn of the session (the caller's cancel ends the wait).
    pub async fn compact_session(
        &self,
        session: &Session,
        instructions: Option<String>,
        sink: &CompactionSink<'_>,
        cancel: CancellationToken,
    ) -> Result<CompactionDone, CoreError> {
        let _guard = self.gate.enter(&session.session_id, &cancel, true).await?;
        let host = HostProfile::embedded();
        let lease = self.engines.lease(Operation::ManualCompact, &host, self.model.clone(), Unmet::Degrade)?;
        self.compact(&lease, session, Trigger::Manual, None, instructions, sink, &cancel).await
    }

    /// Runs the engine's compaction — or the built-in one it delegates to —
    /// inside one safety window. Built-in results become a compaction entry
    /// in the transcript; an engine that compacts itself keeps its own
    /// state, and the transcript stays whole. The caller holds the session
    /// lock.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn compact(
        &self,
        lease: &EngineLease,
        session: &Session,
        trigger: Trigger,
        budget: Option<u64>,
        instructions: Option<String>,
        sink: &CompactionSink<'_>,
        cancel: &CancellationToken,
    ) -> Result<CompactionDone, CoreError> {
        let started = Instant::now();
        let window_end = started + self.config.compaction_timeout();
        let visible = self.visible(&session.session_id).await?;
        let tokens_before = visible.tokens();
        sink(CompactionEvent::Started { trigger, tokens_before });
        let target_kind = if budget.is_some() { pb::CompactionTarget::Budget } else { pb::CompactionTarget::Threshold };
        let call = Call::new(cancel.clone()).with_deadline(window_end);
        let grant = self.engines.grant(lease, session, None, Some(window_end));
        let (force_reason, preflight) = match trigger {
            Trigger::Manual => (Some("manual".to_owned()), None),
            Trigger::Proactive => (Some("preflight_required".to_owned()), Some("tokens".to_owned())),
            Trigger::Overflow | Trigger::Timeout => (None, None),
        };
        let request = pb::CompactRequest {
            session_id: session.session_id.clone(),
            session_key: session.session_key.clone(),
            agent_id: Some(session.agent_id.clone()),
            session_target: Some(session_target(session)),
            token_budget: budget,
            force: true,
            current_token_count: Some(tokens_before),
            compaction_target: target_kind as i32,
            custom_instructions: instructions.clone(),
            runtime_settings: Some(lease.runtime_settings(budget.unwrap_or_default(), None)),
            runtime_context: Some(pb::RuntimeContext {
                force_reason,
                preflight_compaction_trigger: preflight,
                ..lease.runtime_context(session, budget.unwrap_or_default(), tokens_before)
            }),
            host: grant.as_ref().map(|g| g.access.clone()),
        };
        let progress = |p: pb::CompactProgress| {
            sink(CompactionEvent::Progress { stage: p.stage, done: p.done, total: p.total, message: p.message });
        };
        let reply = lease.engine.compact(request, &call, &progress).await;
        drop(grant);
        let result = match reply {
            Ok(CompactReply::DelegateToHost(d)) => {
                let instructions = d.custom_instructions.or(instructions);
                self.builtin(lease, &visible, budget, instructions, sink, cancel, window_end).await
            }
            Ok(CompactReply::Done(r)) => {
                // The engine compacted its own state: report it; the
                // transcript keeps every entry.
                let outcome = if r.ok && r.compacted { "compacted" } else { "kept" };
                self.metrics.compaction_finished(trigger.as_str(), outcome, started.elapsed(), None);
                let done = CompactionDone {
                    compacted: r.ok && r.compacted,
                    // The engine's words, capped: they reach the client.
                    reason: r.reason.map(|r| crate::peer_text::capped(&r, 500)),
                    tokens_before: if r.tokens_before > 0 { r.tokens_before } else { tokens_before },
                    tokens_after: r.tokens_after.unwrap_or(tokens_before),
                    entry_id: None,
                    summary_chars: r.summary.map_or(0, |s| s.chars().count() as u32),
                };
                sink(CompactionEvent::Done(done.clone()));
                return Ok(done);
            }
            Err(EngineCallError::Cancelled) => Err(CompactionError::Cancelled),
            Err(EngineCallError::DeadlineExceeded { after, .. }) => Err(CompactionError::Timeout(after)),
            Err(e) => Err(CompactionError::Model(ModelError::Unavailable(e.to_string()))),
        };
        let done = match result {
            Ok(compaction::Outcome::Compacted { summary, first_kept_entry_id, tokens_before, tokens_after }) => {
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
                    trigger.as_str(),
                    "compacted",
                    started.elapsed(),
                    Some((tokens_before, tokens_after)),
                );
                CompactionDone {
                    compacted: true,
                    reason: None,
                    tokens_before,
                    tokens_after,
                    entry_id: Some(stored[0].id.clone()),
                    summary_chars: summary.chars().count() as u32,
                }
            }
            Ok(compaction::Outcome::Kept { reason, tokens_before }) => {
                self.metrics.compaction_finished(trigger.as_str(), "kept", started.elapsed(), None);
                CompactionDone {
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
                self.metrics.compaction_finished(trigger.as_str(), outcome, started.elapsed(), None);
                return Err(err);
            }
        };
        sink(CompactionEvent::Done(done.clone()));
        Ok(done)
    }

    /// Built-in compaction, each model request bounded by the safety
    /// timeout but never past the end of the caller's window.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn builtin(
        &self,
        lease: &EngineLease,
        visible: &Visible,
        budget: Option<u64>,
        instructions: Option<String>,
        sink: &CompactionSink<'_>,
        cancel: &CancellationToken,
        window_end: Instant,
    ) -> Result<compaction::Outcome, CompactionError> {
        let c = &self.config.agents.defaults.compaction;
        let left = window_end.saturating_duration_since(Instant::now());
        let settings = compaction::Settings {
            keep_recent_tokens: c.keep_recent_tokens,
            recent_turns_preserve: c.recent_turns_preserve,
            chunk_tokens: (lease.model.context_window / 2).clamp(1_000, 30_000),
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
            sink(CompactionEvent::Progress { stage: "summarising".into(), done, total, message });
        };
        compaction::compact(input, self.summarizer.as_ref(), &settings, cancel, &mut progress).await
    }
}
