//! The turn as one lifecycle value. Both drivers — the managed `RunTurn`
//! loop and an external harness — run a turn through these steps, and only
//! these: `begin` (session, busy policy, lease, host requirements,
//! admission, the outbox, bootstrap, proactive compaction) → `assemble`
//! before every model call → `append` what the model and tools produced →
//! `overflow`/`recover`/`compact` → `finish`. Dropping an open turn is an
//! abort.
//!
//! The turn owns small pieces that keep their own rules: the history it
//! sends its engine ([`history`]), what it has added ([`ledger`]), and its
//! place in the trace ([`trace`]).

mod finish;
mod history;
mod ledger;
mod tools;
mod trace;

use std::sync::Arc;

use ctxgate_proto::pb::{self, AgentMessage, transcript_entry::Entry};
use ctxgate_proto::{estimate, limits};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::core::admission::{Permit, Shed};
use crate::core::claims::{Held, SessionGate};
use crate::core::compact::Compactor;
use crate::core::engine_lease::{EngineLease, Engines, Unmet};
use crate::core::maintenance::Maintenance;
use crate::core::outbox::Delivery;
use crate::core::types::{
    Capability, CompactionDone, Context, Driver, EventSink, Failure, FailureReason, Operation, Outcome, Projection,
    Trigger, TurnEvent, TurnSpec,
};
use crate::core::{CoreError, now_unix_ms};
use crate::engines::{Call, EngineCallError, legacy};
use crate::metrics::Metrics;
use crate::store::{NewEntry, Session, Store, StoreError, TurnSession};
use crate::transcript::{self, Messages};
pub use finish::Finished;
use history::{HistoryView, Read, Source};
use ledger::Ledger;
pub use ledger::check_client_message;
pub(crate) use tools::offered as offered_tools;
use trace::{Attributes, TurnTrace};

/// Overflow compactions before the gateway gives up on compacting.
pub const MAX_OVERFLOW_COMPACTIONS: u32 = 3;

/// A turn refused by admission, at arrival or before its first durable
/// work ([`Permit::admitted`]).
pub(super) fn shed_error(metrics: &Metrics, shed: Shed) -> CoreError {
    metrics.turns_shed.inc();
    metrics.turn_limit.set(shed.limit as i64);
    CoreError::Overloaded(shed)
}

/// What `begin` gives back. Built once per turn: not worth a box.
#[allow(clippy::large_enum_variant)]
pub enum Begun {
    Open(Turn),
    /// Admitted, then failed before anything ran (the engine's outbox is
    /// blocked); the turn is closed already.
    Failed(Failure),
}

/// How a step failed.
#[derive(Debug)]
pub enum StepError {
    /// The request is refused (bad input, out of order, a store failure);
    /// the API answers with its status.
    Refused(CoreError),
    /// The turn cannot go on; the driver ends it with this failure.
    Failed(Failure),
}

impl From<CoreError> for StepError {
    fn from(e: CoreError) -> Self {
        Self::Refused(e)
    }
}

impl From<StoreError> for StepError {
    fn from(e: StoreError) -> Self {
        Self::Refused(e.into())
    }
}

/// What a turn calls: the services below it, never the [`Core`](super::Core) that
/// began it, so a turn's calls go down.
#[derive(Clone)]
pub(super) struct TurnServices {
    pub store: Arc<dyn Store>,
    pub metrics: Metrics,
    /// Grants for the engine's calls back.
    pub engines: Arc<Engines>,
    /// The outbox (CommitTurn) and DELTA cursors.
    pub delivery: Arc<Delivery>,
    /// Bootstrap before the first turn, Maintain after each.
    pub maintenance: Arc<Maintenance>,
    /// Proactive, overflow and manual compaction.
    pub compactor: Arc<Compactor>,
}

impl TurnServices {
    /// The visible history read in place, shared with the store's tail.
    pub async fn visible(&self, session: &Session) -> Result<Messages, CoreError> {
        let tail = self.store.visible_tail(&session.session_id).await?;
        Ok(Messages::Shared(transcript::SharedHistory::new(tail)))
    }
}

pub struct Turn {
    services: TurnServices,
    session: Session,
    lease: EngineLease,
    turn_id: String,
    /// The turn's user messages as admitted (ids follow a rewrite's copies).
    admitted: Vec<pb::TranscriptEntry>,
    driver: Driver,
    system_prompt_tokens: u64,
    /// The user messages' text (AssembleRequest.prompt).
    prompt: String,
    /// The harness's own tool names (the engine's are `engine_tools`).
    available_tools: Vec<String>,
    /// The context engine's tools offered in this turn.
    engine_tools: Vec<pb::ToolDefinition>,
    /// The engine's tools not offered because the harness has a tool of
    /// the same name (said in a warning when the turn starts).
    shadowed_tools: Vec<String>,
    /// The session is a subagent's (its tools are the subagent audience's).
    subagent: bool,
    events: EventSink,
    cancel: CancellationToken,
    call: Call,
    ledger: Ledger,
    view: HistoryView,
    /// Contexts assembled so far.
    contexts: u32,
    /// The newest context's estimate: what the model was last shown, which
    /// AfterTurn reports as the current token count (OpenClaw reports the
    /// last call's prompt tokens), not the whole transcript.
    last_context_tokens: Option<u64>,
    overflow_compactions: u32,
    proactive_done: bool,
    /// Why the runtime is degraded (RuntimeSettings.diagnostics).
    degraded: Option<pb::ReasonCode>,
    trace: TurnTrace,
    /// Held while the turn is open; `None` once closed.
    guard: Option<Held>,
    /// The turn's admission permit, released with the turn.
    admission: Permit,
    /// The durable engine whose commit queue for the session the turn's
    /// start delivered to the end: the commit this turn queues is then the
    /// queue's only one, delivered without reading it back (the turn holds
    /// the session, so nothing else queues meanwhile).
    emptied_queue: Option<String>,
}

impl Turn {
    /// Begins a turn under its `admission` ([`Core::admit`](super::Core::admit)): waits for
    /// the session under the spec's busy policy (a cancel while waiting
    /// leaves no trace), leases the engine (host requirements: the managed
    /// driver degrades, a harness fails closed before admission), admits
    /// the user messages, delivers the session's queued durable commits,
    /// bootstraps and compacts proactively.
    pub(super) async fn begin(
        services: TurnServices,
        gate: &SessionGate,
        spec: TurnSpec,
        events: EventSink,
        cancel: CancellationToken,
        mut admission: Permit,
    ) -> Result<Begun, CoreError> {
        // The turn is a span of the client's trace (or of a new one); every
        // engine call of the turn is a span of its own under it.
        let mut trace = TurnTrace::start(spec.trace);
        // Both are the key's state as the turn arrives (not re-read after
        // waiting for the session, as the session itself is not).
        let TurnSession { session, subagent } = services.store.turn_session(&spec.agent_id, &spec.session_key).await?;
        // Waiting behind the session's running turn counts as the turn's
        // wait to start (admission sees the queue wherever it forms).
        let guard = gate.enter_turn(&session.session_id, &cancel, spec.busy).await?;
        let unmet = match spec.driver {
            Driver::Managed => Unmet::Degrade,
            Driver::Harness => Unmet::FailClosed,
        };
        let lease = services.engines.lease(Operation::AgentRun, &spec.host, spec.model, unmet)?;
        // The model cannot tell two tools of one name apart: the harness's
        // wins, so an engine (a peer) cannot break a harness's turns by
        // declaring the name of a tool the harness offers.
        let (engine_tools, shadowed): (Vec<_>, Vec<_>) =
            tools::offered(&lease, subagent).into_iter().partition(|e| !spec.available_tools.contains(&e.name));
        let shadowed_tools = shadowed.into_iter().map(|t| t.name).collect();
        // It holds its session and runs: from here its time is a sample.
        // Unless the limit fell since it arrived (then it is shed now), or
        // the ticks look like a surge's first ones (then it waits to see).
        // A cancel while it waits leaves no trace, as one while it waits for
        // the session does.
        let waited = tokio::select! {
            started = admission.admitted() => started.map_err(|shed| shed_error(&services.metrics, shed))?,
            () = cancel.cancelled() => return Err(CoreError::Aborted),
        };
        services.metrics.turn_wait_seconds.observe(waited.as_secs_f64());

        // Admission: the user messages are durable before anything else runs.
        let turn_id = uuid::Uuid::new_v4().simple().to_string();
        let prompt = spec.user_messages.iter().map(crate::provider::message_text).collect::<Vec<_>>().join("\n");
        let entries = spec
            .user_messages
            .into_iter()
            .map(|m| NewEntry { turn_id: turn_id.clone(), entry: Entry::Message(m) })
            .collect();
        let seen_by = if lease.remote { Some(lease.key.as_str()) } else { lease.record.as_deref() };
        let admitted = services.store.open_turn(&session.session_id, &turn_id, entries, seen_by).await?;
        services.metrics.turns_in_flight.inc();
        // One span per turn: every engine call and model request nests in it.
        trace.open(&Attributes {
            driver: spec.driver,
            session_id: &session.session_id,
            agent_id: &session.agent_id,
            session_key: &session.session_key,
            turn_id: &turn_id,
            engine: &lease.key,
        });
        let turn = Turn {
            services,
            ledger: Ledger::admitted(&admitted),
            view: HistoryView::new(&lease),
            session,
            lease,
            turn_id,
            admitted,
            driver: spec.driver,
            system_prompt_tokens: spec.system_prompt_tokens,
            prompt,
            available_tools: spec.available_tools,
            engine_tools,
            shadowed_tools,
            subagent,
            events,
            call: Call::new(cancel.clone()).traced(Some(trace.this)),
            cancel,
            contexts: 0,
            last_context_tokens: None,
            overflow_compactions: 0,
            proactive_done: false,
            degraded: None,
            trace,
            guard: Some(guard),
            admission,
            emptied_queue: None,
        };
        let span = turn.trace.span.clone();
        turn.start().instrument(span).await
    }

    async fn start(mut self) -> Result<Begun, CoreError> {
        self.emit(TurnEvent::Admitted {
            session_id: self.session.session_id.clone(),
            turn_id: self.turn_id.clone(),
            entry_ids: self.admitted.iter().map(|e| e.id.clone()).collect(),
        });
        self.emit(TurnEvent::EngineSelected {
            engine_id: self.lease.key.clone(),
            selection: self.lease.selection(),
            warning: self.lease.degraded.clone(),
        });
        if !self.shadowed_tools.is_empty() {
            self.emit(TurnEvent::Warning(format!(
                "context engine \"{}\"'s tools {:?} are not offered in this turn: the harness has tools of those names",
                self.lease.key, self.shadowed_tools
            )));
        }
        // Durable engines get earlier turns first; a turn the engine has not
        // accepted blocks this session only.
        if self.lease.remote && crate::engines::durable(&self.lease.info) {
            let backlog = self
                .services
                .delivery
                .drain_commits(&self.session.session_id, &self.lease.key, &self.cancel, false)
                .await?;
            if self.cancel.is_cancelled() {
                self.close(Outcome::Aborted, Vec::new()).await?;
                return Ok(Begun::Failed(Failure::aborted()));
            }
            if backlog.waiting > 0 {
                let failure = Failure::new(FailureReason::EngineBacklog, backlog.reason(&self.lease.key));
                self.close(Outcome::Failed(failure.clone()), Vec::new()).await?;
                return Ok(Begun::Failed(failure));
            }
            self.emptied_queue = Some(self.lease.key.clone());
        }
        let budget = self.budget(0);
        let fence = self.admitted[0].id.clone();
        let remap =
            self.services.maintenance.bootstrap_if_new(&self.lease, &self.session, &fence, budget, &self.call).await;
        // Maintain(bootstrap) may have copied the branch, admitted entries
        // included: the fence and positions follow the copies.
        for e in &mut self.admitted {
            if let Some(new) = remap.get(&e.id) {
                // A copied message keeps its message id (the old entry id):
                // both name the turn's own message.
                self.ledger.copied(new.clone());
                e.id.clone_from(new);
            }
        }

        // Proactive compaction: tokens ≥ window − min(20000, 25 % of window).
        // Engines that own compaction are judged by what they assemble.
        let tokens = self.history().await?.tokens();
        if !self.lease.info.owns_compaction && tokens >= self.threshold() {
            self.proactive_done = true;
            if let Err(f) = self.recover(Trigger::Proactive).await {
                self.close(Outcome::Aborted, Vec::new()).await?;
                return Ok(Begun::Failed(f));
            }
        }
        Ok(Begun::Open(self))
    }

    pub fn turn_id(&self) -> &str {
        &self.turn_id
    }

    /// The turn waits on the model or the client until
    /// [`Turn::back_in_gateway`]: not the gateway's work (admission).
    pub fn outside_gateway(&mut self) {
        self.admission.away();
    }

    pub fn back_in_gateway(&mut self) {
        self.admission.back();
    }

    pub fn cancel(&self) -> &CancellationToken {
        &self.cancel
    }

    /// Whether the engine owns compaction (the managed precheck skips).
    pub fn engine_owns_compaction(&self) -> bool {
        self.lease.info.owns_compaction
    }

    /// What a durable engine's CommitTurn says of the run, as OpenClaw's
    /// turn outbox persists it: the provider, the model and its window, the
    /// token budget (an engine such as lossless-claw 1.x decides on
    /// compaction from them). The window has no field of its own: it goes
    /// in `extra` as OpenClaw names it.
    fn commit_context(&self, lease: &EngineLease, session: &Session) -> pb::RuntimeContext {
        let mut context = lease.runtime_context(session, self.budget(0), 0);
        context.current_token_count = None;
        context.extra.insert("modelContextWindow".into(), lease.model.context_window.to_string());
        context
    }

    /// Tokens the assembled history may take: window − reserve − rendered
    /// system prompt − `pending`.
    pub fn budget(&self, pending: u64) -> u64 {
        let m = &self.lease.model;
        m.context_window
            .saturating_sub(m.reserve_tokens)
            .saturating_sub(self.system_prompt_tokens)
            .saturating_sub(pending)
    }

    fn threshold(&self) -> u64 {
        let window = self.lease.model.context_window;
        window - (window / 4).min(20_000)
    }

    fn emit(&self, e: TurnEvent) {
        (self.events)(e);
    }

    fn aborted(&self) -> StepError {
        StepError::Failed(Failure::aborted())
    }

    /// Every tool the model may call in this turn: the harness's, then the
    /// engine's (Assemble's `available_tools`).
    fn tool_names(&self) -> Vec<String> {
        let engine = self.engine_tools.iter().map(|t| t.name.clone());
        self.available_tools.iter().cloned().chain(engine).collect()
    }

    /// The message id of the turn's first user message (rewrites keep it):
    /// a resync sends the engine everything before it.
    fn fence(&self) -> String {
        match &self.admitted[0].entry {
            Some(Entry::Message(m)) => m.id.clone(),
            _ => self.admitted[0].id.clone(),
        }
    }

    /// The history the engine is sent now (read when needed).
    async fn history(&mut self) -> Result<&Read, CoreError> {
        let fence = self.fence();
        let from = Source {
            services: &self.services,
            lease: &self.lease,
            session: &self.session,
            fence: &fence,
            call: &self.call,
        };
        self.view.get(&from).await
    }

    /// The context for the next model call: the engine assembles the
    /// visible history (which holds everything appended so far) within the
    /// budget left by `pending`, the messages the caller will show after it.
    /// Engines owning compaction that assemble past the proactive threshold
    /// compact once and assemble again.
    pub async fn assemble(&mut self, pending: &[AgentMessage], field: &str) -> Result<Context, StepError> {
        let span = self.trace.span.clone();
        self.assemble_inner(pending, field).instrument(span).await
    }

    async fn assemble_inner(&mut self, pending: &[AgentMessage], field: &str) -> Result<Context, StepError> {
        if !self.lease.host.has(Capability::AssembleBeforePrompt) {
            return Err(CoreError::Precondition(format!(
                "this turn is capture-only: host \"{}\" lacks the capability \"{}\"",
                self.lease.host.id,
                Capability::AssembleBeforePrompt.as_str()
            ))
            .into());
        }
        // Pending messages obey the append rules, without being stored.
        self.ledger.check(pending, field)?;
        let budget = self.budget(estimate::messages_tokens(pending));
        loop {
            if self.cancel.is_cancelled() {
                return Err(self.aborted());
            }
            let history = self.history().await?;
            let (cursor, pre_assembly_tokens) = (history.cursor().cloned(), history.tokens());
            let delta = history.delta().map(<[AgentMessage]>::to_vec);
            let assembled = match delta {
                // Legacy passes the history through: the model is shown the
                // store's shared tail itself, never a copy of it.
                None if !self.lease.remote => {
                    let shared = self.view.take_full().unwrap_or_default();
                    let messages = legacy::assemble(shared).map_err(|e| self.assemble_failed(e))?;
                    Assembled { messages, addition: None, may_overflow: false, projection: None }
                }
                delta => {
                    // The whole history is moved into the request, a delta copied.
                    let messages = match delta {
                        Some(m) => m,
                        None => self.view.take_full().unwrap_or_default().into_vec(),
                    };
                    let grant =
                        self.services.engines.grant(&self.lease, &self.session, Some(&self.admitted[0].id), None);
                    let request = pb::AssembleRequest {
                        session_id: self.session.session_id.clone(),
                        session_key: Some(self.session.session_key.clone()),
                        messages,
                        token_budget: Some(budget),
                        available_tools: self.tool_names(),
                        prompt: Some(self.prompt.clone()),
                        model: Some(self.lease.model.id.clone()),
                        runtime_settings: Some(self.lease.runtime_settings(budget, self.degraded)),
                        runtime_context: Some(self.lease.runtime_context(&self.session, budget, pre_assembly_tokens)),
                        host: grant.as_ref().map(|g| g.access.clone()),
                        cursor,
                        ..Default::default()
                    };
                    let assembled = self.lease.engine.assemble(request, &self.call).await;
                    drop(grant);
                    match assembled {
                        Ok(a) => Assembled {
                            may_overflow: a.prompt_authority == pb::PromptAuthority::PreassemblyMayOverflow as i32,
                            addition: a.system_prompt_addition.filter(|a| !a.trim().is_empty()),
                            messages: a.messages.into(),
                            projection: a.projection,
                        },
                        Err(EngineCallError::Cancelled) => return Err(self.aborted()),
                        // The engine lost what the cursor says it holds: resync
                        // once (the next history read), then assemble again.
                        Err(EngineCallError::HistoryGap { .. }) if self.view.resync_after_gap() => {
                            self.services.delivery.drop_cursor(&self.lease, &self.session).await?;
                            continue;
                        }
                        // Shed, failed or quarantined on a delta: once more with the
                        // whole history, which legacy can answer.
                        Err(_) if self.view.fall_back_to_full() => continue,
                        Err(e) => return Err(self.assemble_failed(e)),
                    }
                }
            };
            // A shared history's estimate is kept with the store's tail.
            let estimated_tokens = assembled
                .messages
                .tokens()
                .saturating_add(assembled.addition.as_deref().map_or(0, estimate::text_tokens));
            if self.lease.info.owns_compaction && !self.proactive_done && estimated_tokens >= self.threshold() {
                self.proactive_done = true;
                self.recover(Trigger::Proactive).await.map_err(StepError::Failed)?;
                continue;
            }
            let projection = self.projection(assembled.projection).await?;
            self.contexts += 1;
            self.last_context_tokens = Some(estimated_tokens);
            return Ok(Context {
                messages: assembled.messages,
                system_prompt_addition: assembled.addition,
                estimated_tokens,
                pre_assembly_tokens,
                may_overflow: assembled.may_overflow,
                budget,
                projection,
                sequence: self.contexts,
                engine_tools: self.engine_tools.clone(),
            });
        }
    }

    fn assemble_failed(&self, e: EngineCallError) -> StepError {
        StepError::Failed(Failure::new(
            FailureReason::EngineError,
            format!("The context engine \"{}\" could not assemble the prompt: {e}.", self.lease.key),
        ))
    }

    /// A thread-bootstrap projection, for hosts that keep threads: the
    /// epoch is recorded per session and host, so the host knows when to
    /// re-inject (reference §1.8). Anything else is per-turn projection.
    async fn projection(&self, p: Option<pb::ContextProjection>) -> Result<Option<Projection>, StepError> {
        let Some(p) = p.filter(|p| p.mode == pb::ProjectionMode::ThreadBootstrap as i32) else { return Ok(None) };
        if !self.lease.host.has(Capability::ThreadBootstrapProjection) {
            return Ok(None);
        }
        let epoch = p.epoch.as_deref().map(str::trim).unwrap_or_default();
        if epoch.is_empty() {
            self.emit(TurnEvent::Warning(format!(
                "context engine \"{}\" asked for thread_bootstrap projection without an epoch; using per-turn projection",
                self.lease.key
            )));
            return Ok(None);
        }
        let fingerprint = p.fingerprint.as_deref().map(str::trim).unwrap_or_default();
        let limit = limits::MAX_ID_BYTES;
        if epoch.len() > limit || fingerprint.len() > limit {
            self.emit(TurnEvent::Warning(format!(
                "context engine \"{}\" sent a projection epoch or fingerprint over {limit} bytes; using per-turn projection",
                self.lease.key
            )));
            return Ok(None);
        }
        let reinject = self
            .services
            .store
            .record_projection(&self.session.session_id, &self.lease.host.id, epoch, fingerprint)
            .await?;
        Ok(Some(Projection { epoch: epoch.to_owned(), fingerprint: fingerprint.to_owned(), reinject }))
    }

    /// Appends what the model and tools produced; durable when it returns.
    /// Returns the entry ids, in order.
    pub async fn append(&mut self, messages: Vec<AgentMessage>, field: &str) -> Result<Vec<String>, StepError> {
        let additions = self.ledger.check_append(&messages, field)?;
        let entries =
            stamped(messages).map(|m| NewEntry { turn_id: self.turn_id.clone(), entry: Entry::Message(m) }).collect();
        let stored = self.services.store.append(&self.session.session_id, entries).await?;
        self.ledger.record(additions, &stored);
        self.view.remember(&stored);
        Ok(stored.into_iter().map(|e| e.id).collect())
    }

    /// The messages a harness ends its turn with (`field`), checked as an
    /// append of them is, for [`Turn::finish`] to store with the turn's end.
    /// Only an accepted turn ends with messages.
    pub fn ending_with(
        &mut self,
        messages: Vec<AgentMessage>,
        outcome: &Outcome,
        field: &str,
    ) -> Result<Vec<AgentMessage>, CoreError> {
        if messages.is_empty() {
            return Ok(messages);
        }
        if !matches!(outcome, Outcome::Accepted) {
            return Err(CoreError::invalid(field, "only an accepted turn ends with messages"));
        }
        let additions = self.ledger.check_append(&messages, field)?;
        // Recorded now so that the close sees their tool calls answered;
        // their entry ids come with the close.
        self.ledger.record(additions, &[]);
        Ok(stamped(messages).collect())
    }

    /// Compaction inside the turn (force, target=budget) after `trigger`
    /// said the prompt is too large: a failure is a warning and the turn
    /// goes on; only an abort ends it.
    pub async fn recover(&mut self, trigger: Trigger) -> Result<(), Failure> {
        let span = self.trace.span.clone();
        async {
            let budget = self.budget(0);
            let events = self.events.clone();
            let sink = move |e| events(TurnEvent::Compaction(e));
            let result = self
                .services
                .compactor
                .compact(&self.lease, &self.session, trigger, Some(budget), None, &sink, &self.cancel)
                .await;
            self.view.forget();
            if self.cancel.is_cancelled() {
                return Err(Failure::aborted());
            }
            if let Err(e) = result {
                self.emit(TurnEvent::Warning(format!("{trigger} compaction failed: {e}")));
            }
            Ok(())
        }
        .instrument(span)
        .await
    }

    /// The model rejected the prompt as too long: compacts, at most
    /// `MAX_OVERFLOW_COMPACTIONS` times a turn. `Ok(false)`: no
    /// compaction is left to try.
    pub async fn overflow(&mut self) -> Result<bool, Failure> {
        self.degraded = Some(pb::ReasonCode::ContextOverflow);
        if self.overflow_compactions >= MAX_OVERFLOW_COMPACTIONS {
            return Ok(false);
        }
        self.overflow_compactions += 1;
        self.recover(Trigger::Overflow).await?;
        Ok(true)
    }

    /// Notes a model timeout for the runtime settings the engine sees next.
    pub fn note_timeout(&mut self) {
        self.degraded = Some(pb::ReasonCode::ProviderTimeout);
    }

    /// Manual compaction mid-turn (target=threshold).
    pub async fn compact(&mut self, instructions: Option<String>) -> Result<CompactionDone, CoreError> {
        self.view.forget();
        let span = self.trace.span.clone();
        let events = self.events.clone();
        let sink = move |e| events(TurnEvent::Compaction(e));
        self.services
            .compactor
            .compact(&self.lease, &self.session, Trigger::Manual, None, instructions, &sink, &self.cancel)
            .instrument(span)
            .await
    }

    /// Ends the turn. Accepted: `last` (the managed reply; a harness has
    /// appended everything already) is appended and the engine is told —
    /// CommitTurn through the outbox for durable engines (queued in the
    /// same transaction), else after-turn (or Ingest) for hosts with that
    /// capability — then maintain. Aborted or failed: nothing reaches the
    /// engine, and the turn's own messages leave the active branch.
    pub async fn finish(mut self, outcome: Outcome, last: Vec<AgentMessage>) -> Result<Finished, CoreError> {
        let span = self.trace.span.clone();
        self.close(outcome, last).instrument(span).await
    }
}

/// An engine's answer to Assemble, as the turn uses it.
struct Assembled {
    messages: Messages,
    addition: Option<String>,
    may_overflow: bool,
    projection: Option<pb::ContextProjection>,
}

/// A client's messages, those without a creation time given now's.
fn stamped(messages: Vec<AgentMessage>) -> impl Iterator<Item = AgentMessage> {
    messages.into_iter().map(|mut m| {
        if m.created_at_unix_ms == 0 {
            m.created_at_unix_ms = now_unix_ms();
        }
        m
    })
}
