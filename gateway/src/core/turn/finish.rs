//! The end of a turn: accepted (the close appends the reply; the engine is
//! told — CommitTurn through the outbox, or after-turn/Ingest — then
//! maintains), or rewound (aborted, failed, or dropped open).

use ctxgate_proto::estimate;
use ctxgate_proto::pb::{self, AgentMessage, transcript_entry::Entry};

use super::Turn;
use super::history::Source;
use super::trace::Attributes;
use crate::core::CoreError;
use crate::core::engine_lease::{host_operations, session_target};
use crate::core::maintenance::Upkeep;
use crate::core::types::{Capability, Outcome, TurnEvent};
use crate::engines::EngineCallError;
use crate::store::{NewEntry, TurnClose};
use crate::transcript;

/// A closed turn.
#[derive(Debug)]
pub struct Finished {
    /// Entries the close appended (the managed reply).
    pub entries: Vec<pb::TranscriptEntry>,
    /// Accepted turns: the engine holds the turn now (false: it waits in
    /// the durable outbox, or the engine is legacy).
    pub engine_committed: bool,
}

impl Turn {
    pub(super) async fn close(&mut self, outcome: Outcome, last: Vec<AgentMessage>) -> Result<Finished, CoreError> {
        let Some(guard) = self.guard.take() else {
            return Err(CoreError::Precondition("the turn has ended".into()));
        };
        let (store, session_id) = (self.services.store.clone(), self.session.session_id.clone());
        let rewind = async || {
            let r = store.close_turn(&session_id, TurnClose::Rewind).await;
            r.map(|_| Finished { entries: Vec::new(), engine_committed: false }).map_err(CoreError::from)
        };
        let result = match &outcome {
            // A turn that could not be accepted ends as an abort, rewound
            // before the caller hears of it (a no-op once the accepting
            // close is written).
            Outcome::Accepted => match self.accept(last).await {
                Err(e) => {
                    if let Err(re) = rewind().await {
                        tracing::error!(error = %re, "rewinding a refused turn failed");
                    }
                    Err(e)
                }
                ok => ok,
            },
            Outcome::Aborted | Outcome::Failed(_) => rewind().await,
        };
        let label = if result.is_ok() { outcome.label() } else { "error" };
        let metrics = &self.services.metrics;
        metrics.turns_in_flight.dec();
        metrics.turn_finished(self.driver.as_str(), label, self.trace.started.elapsed());
        self.trace.export(metrics, &self.attributes(), label, &outcome);
        guard.release().await;
        result
    }

    /// What the turn's exported span says of it.
    fn attributes(&self) -> Attributes<'_> {
        Attributes {
            driver: self.driver,
            session_id: &self.session.session_id,
            agent_id: &self.session.agent_id,
            session_key: &self.session.session_key,
            turn_id: &self.turn_id,
            engine: &self.lease.key,
        }
    }

    async fn accept(&mut self, last: Vec<AgentMessage>) -> Result<Finished, CoreError> {
        // A model shown a tool call without its result refuses the history.
        if let Some(open) = self.ledger.unanswered() {
            return Err(CoreError::Precondition(format!(
                "tool call {open:?} has no result: append its result, or end the turn failed"
            )));
        }
        let (services, lease, session) = (self.services.clone(), self.lease.clone(), self.session.clone());
        // The turn is closing: its history is taken, not copied.
        let fence = self.fence();
        let from = Source { services: &services, lease: &lease, session: &session, fence: &fence, call: &self.call };
        // Only a durable record (its position) and a remote after-turn read
        // the history here: legacy's turn does not read it again.
        let after_turn = lease.remote && lease.host.has(Capability::AfterTurn);
        let (mut history, cursor) = if lease.record.is_some() || after_turn {
            self.view.take(&from).await?.into_parts()
        } else {
            (Vec::new(), None)
        };
        // Queued for the durable engine even when legacy served the turn.
        let commit = match lease.record.as_deref() {
            None => None,
            Some(engine) => {
                let position = match &cursor {
                    None => self.ledger.position_in(&history),
                    // A delta holds only what follows the cursor, and the
                    // cursor counts what the engine holds — not an aborted
                    // turn's user message left before it, which is visible.
                    Some(_) => {
                        transcript::index_of_last_run(&services.store.visible_tail(&session.session_id).await?, |m| {
                            self.ledger.is_own(m)
                        })
                    }
                };
                Some(services.delivery.commit_draft(
                    engine,
                    &session,
                    &self.turn_id,
                    &self.admitted[0],
                    position as u64,
                    self.commit_context(&lease, &session),
                    &host_operations(&lease),
                ))
            }
        };
        let entries =
            last.into_iter().map(|m| NewEntry { turn_id: self.turn_id.clone(), entry: Entry::Message(m) }).collect();
        let closed = services.store.close_turn(&session.session_id, TurnClose::Accept { entries, commit }).await?;
        // The after-turn request carries the turn's last messages too.
        if after_turn {
            history.extend(closed.entries.iter().filter_map(|e| match &e.entry {
                Some(Entry::Message(m)) => Some(m.clone()),
                _ => None,
            }));
        }
        let budget = self.budget(0);
        let (engine_committed, upkeep) = if let Some(engine) = lease.record.as_deref() {
            // The engine gets no after-turn or ingest for a durable turn. The
            // turn is accepted and its commit queued: a failure to deliver
            // it now is the outbox's to retry, not the turn's.
            let delivered = match closed.queued {
                Some(queued) if self.emptied_queue.as_deref() == Some(engine) => {
                    services.delivery.deliver_commits(&session.session_id, engine, &[queued], &self.cancel, false).await
                }
                _ => services.delivery.drain_commits(&session.session_id, engine, &self.cancel, false).await,
            };
            let (waiting, upkeep) = match delivered {
                Ok(b) => (b.waiting, b.upkeep),
                Err(e) => {
                    tracing::warn!(error = %e, "delivering queued commits failed; they stay queued");
                    (1, Upkeep::Due)
                }
            };
            if waiting > 0 && lease.remote {
                self.emit(TurnEvent::Warning(
                    "the context engine has not accepted this turn yet; it stays queued and is retried".into(),
                ));
            }
            (waiting == 0, upkeep)
        } else if after_turn {
            // Legacy keeps nothing of its own: no after-turn to build.
            self.after_turn(history, cursor, budget).await
        } else {
            (false, Upkeep::Due)
        };
        if upkeep == Upkeep::Due {
            services.maintenance.maintain_after_turn(&lease, &session, budget, &self.call).await;
        }
        Ok(Finished { entries: closed.entries, engine_committed })
    }

    /// after-turn with the history sent since `cursor` (all of it without
    /// one), or Ingest of the turn's messages for engines without it. True
    /// when the engine took it, with what it said of its upkeep.
    async fn after_turn(
        &self,
        history: Vec<AgentMessage>,
        cursor: Option<pb::HistoryCursor>,
        budget: u64,
    ) -> (bool, Upkeep) {
        let (services, lease, session) = (&self.services, &self.lease, &self.session);
        // Everything before the admitted user message existed before the prompt.
        let pre_prompt = self.ledger.position_in(&history);
        let new_messages: Vec<AgentMessage> = history[pre_prompt..].to_vec();
        let grant = services.engines.grant(lease, session, None, None);
        let tokens = self
            .last_context_tokens
            .unwrap_or_else(|| cursor.as_ref().map_or(0, |c| c.tokens) + estimate::messages_tokens(&history));
        let after = pb::AfterTurnRequest {
            cursor: cursor.clone(),
            session_id: session.session_id.clone(),
            session_key: Some(session.session_key.clone()),
            session_target: Some(session_target(session)),
            session_file: session.session_key.clone(),
            pre_prompt_message_count: pre_prompt as u64,
            messages: history,
            token_budget: Some(budget),
            runtime_settings: Some(lease.runtime_settings(budget, None)),
            runtime_context: Some(lease.runtime_context(session, budget, tokens)),
            host: grant.as_ref().map(|g| g.access.clone()),
            ..Default::default()
        };
        let warn = |e: EngineCallError| self.emit(TurnEvent::Warning(format!("after-turn failed: {e}")));
        match lease.engine.after_turn(after, &self.call).await {
            Ok(r) => {
                if let Some(base) = &cursor
                    && let Err(e) = services.delivery.advance_cursor(lease, session, base).await
                {
                    tracing::warn!(error = %e, "advancing the engine's cursor failed; the next turn resyncs");
                }
                return (true, Upkeep::hinted(r.maintenance_due));
            }
            Err(EngineCallError::Cancelled) => {}
            // Without after-turn, the engine learns the turn through Ingest.
            Err(EngineCallError::Unimplemented(_)) => {
                for message in new_messages {
                    let req = pb::IngestRequest {
                        session_id: session.session_id.clone(),
                        session_key: Some(session.session_key.clone()),
                        message: Some(message),
                        is_heartbeat: false,
                    };
                    if let Err(e) = lease.engine.ingest(req, &self.call).await {
                        warn(e);
                        return (false, Upkeep::Due);
                    }
                }
                return (true, Upkeep::Due);
            }
            Err(e) => warn(e),
        }
        (false, Upkeep::Due)
    }
}

impl Drop for Turn {
    /// An open turn dropped (stream gone, client cancel, a refused step) is
    /// an abort: its messages leave the branch. The session stays held
    /// until that is written, so the next turn starts after it.
    fn drop(&mut self) {
        let Some(guard) = self.guard.take() else { return };
        self.cancel.cancel();
        let metrics = self.services.metrics.clone();
        metrics.turns_in_flight.dec();
        metrics.turn_finished(self.driver.as_str(), Outcome::Aborted.label(), self.trace.started.elapsed());
        let (store, session_id) = (self.services.store.clone(), self.session.session_id.clone());
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        runtime.spawn(async move {
            if let Err(e) = store.close_turn(&session_id, TurnClose::Rewind).await {
                tracing::error!(session = %session_id, error = %e, "rewinding an aborted turn failed");
            }
            drop(guard);
        });
    }
}
