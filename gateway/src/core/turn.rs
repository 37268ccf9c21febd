//! The turn as one lifecycle value. Both drivers — the managed `RunTurn`
//! loop and an external harness — run a turn through these steps, and only
//! these: `begin` (session, busy policy, lease, host requirements,
//! admission, the outbox, bootstrap, proactive compaction) → `assemble`
//! before every model call → `append` what the model and tools produced →
//! `overflow`/`recover`/`compact` → `finish`. Dropping an open turn is an
//! abort.

use std::collections::HashSet;

use tracing::Instrument;

use super::admission::Permit;
use super::*;

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

/// A closed turn.
#[derive(Debug)]
pub struct Finished {
    /// Entries the close appended (the managed reply).
    pub entries: Vec<pb::TranscriptEntry>,
    /// Accepted turns: the engine holds the turn now (false: it waits in
    /// the durable outbox, or the engine is legacy).
    pub engine_committed: bool,
}

pub struct Turn {
    core: Arc<Core>,
    session: Session,
    lease: Lease,
    turn_id: String,
    admitted: Vec<pb::TranscriptEntry>,
    driver: Driver,
    system_prompt_tokens: u64,
    /// The user messages' text (AssembleRequest.prompt).
    prompt: String,
    available_tools: Vec<String>,
    events: EventSink,
    cancel: CancellationToken,
    call: Call,
    /// Entry ids of the turn's own messages (admitted and appended).
    own: HashSet<String>,
    /// Their encoded size: a turn must fit one CommitTurn.
    bytes: usize,
    /// Tool calls appended in this turn, and those a result answered.
    tool_calls: HashSet<String>,
    answered: HashSet<String>,
    contexts: u32,
    /// The session's visible history, kept current by the turn's own
    /// appends: reading the branch costs as much as an assemble, so it is
    /// read once per turn and again only after a compaction changed it.
    history: Option<Vec<AgentMessage>>,
    /// For a DELTA engine, the cursor `history` follows (what the engine
    /// holds before it); `None`: `history` is the whole visible history.
    base: Option<pb::HistoryCursor>,
    overflow_compactions: u32,
    proactive_done: bool,
    /// A history gap was resynced in this turn (at most once).
    resynced: bool,
    /// The DELTA engine failed a delta call: the rest of the turn reads
    /// the whole visible history (legacy answers it).
    full_history: bool,
    /// Why the runtime is degraded (RuntimeSettings.diagnostics).
    degraded: Option<pb::ReasonCode>,
    started: std::time::Instant,
    /// The client's span, parent of the turn's own (`call.trace`) in its
    /// exported span.
    client_span: Option<[u8; 8]>,
    started_at: std::time::SystemTime,
    span: tracing::Span,
    /// Held while the turn is open; `None` once closed.
    guard: Option<Held>,
    /// The turn's admission permit, released with the turn.
    admission: Permit,
}

impl Core {
    /// Begins a turn: waits for the session under the spec's busy policy
    /// (a cancel while waiting leaves no trace), leases the engine (host
    /// requirements: the managed driver degrades, a harness fails closed
    /// before admission), admits the user messages, delivers the session's
    /// queued durable commits, bootstraps and compacts proactively.
    pub async fn begin(
        self: &Arc<Self>,
        spec: TurnSpec,
        events: EventSink,
        cancel: CancellationToken,
    ) -> Result<Begun, CoreError> {
        // The turn is a span of the client's trace (or of a new one); every
        // engine call of the turn is a span of its own under it.
        let (started_at, client_span) = (std::time::SystemTime::now(), spec.trace.map(|t| t.parent_id));
        let trace = spec.trace.map_or_else(ctxgate_proto::trace::TraceParent::root, |t| t.child());
        // Admission control: shed at once over the limit, before any work.
        let mut admission = self.admission.try_admit().map_err(|shed| {
            self.metrics.turns_shed.inc();
            self.metrics.turn_limit.set(shed.limit as i64);
            CoreError::Overloaded(shed)
        })?;
        self.metrics.turn_limit.set(admission.limit() as i64);
        let session = self
            .store
            .session(&spec.agent_id, &spec.session_key, true)
            .await?
            .ok_or_else(|| CoreError::NoSession(spec.session_key.clone()))?;
        let limit = self.config.gateway.limits.queued_turns_per_session;
        let guard = self.hold(&session.session_id, &cancel, spec.busy, Some(limit)).await?;
        let unmet = match spec.driver {
            Driver::Managed => Unmet::Degrade,
            Driver::Harness => Unmet::FailClosed,
        };
        let lease = self.lease(Operation::AgentRun, &spec.host, spec.model, unmet)?;
        // It holds its session and runs: from here its time is a sample.
        admission.admitted();

        // Admission: the user messages are durable before anything else runs.
        let turn_id = uuid::Uuid::new_v4().simple().to_string();
        let prompt = spec.user_messages.iter().map(crate::provider::message_text).collect::<Vec<_>>().join("\n");
        let entries = spec
            .user_messages
            .into_iter()
            .map(|m| NewEntry { turn_id: turn_id.clone(), entry: Entry::Message(m) })
            .collect();
        let seen_by = if lease.remote { Some(lease.key.as_str()) } else { lease.record.as_deref() };
        let admitted = self.store.open_turn(&session.session_id, &turn_id, entries, seen_by).await?;
        let own = admitted.iter().map(|e| e.id.clone()).collect();
        let bytes = admitted.iter().map(prost::Message::encoded_len).sum();
        self.metrics.turns_in_flight.inc();
        // One span per turn: every engine call and model request nests in it.
        let span = tracing::info_span!("turn", driver = spec.driver.as_str(), agent = %session.agent_id,
            session = %session.session_id, key = %session.session_key, trace_id = %trace.trace_id_hex());
        let turn = Turn {
            core: self.clone(),
            session,
            lease,
            turn_id,
            admitted,
            driver: spec.driver,
            system_prompt_tokens: spec.system_prompt_tokens,
            prompt,
            available_tools: spec.available_tools,
            events,
            call: Call::new(cancel.clone()).traced(Some(trace)),
            cancel,
            own,
            bytes,
            tool_calls: HashSet::new(),
            answered: HashSet::new(),
            contexts: 0,
            history: None,
            base: None,
            overflow_compactions: 0,
            proactive_done: false,
            resynced: false,
            full_history: false,
            degraded: None,
            started: std::time::Instant::now(),
            client_span,
            started_at,
            span: span.clone(),
            guard: Some(guard),
            admission,
        };
        turn.start().instrument(span).await
    }
}

impl Turn {
    async fn start(mut self) -> Result<Begun, CoreError> {
        (self.events)(TurnEvent::Admitted {
            session_id: self.session.session_id.clone(),
            turn_id: self.turn_id.clone(),
            entry_ids: self.admitted.iter().map(|e| e.id.clone()).collect(),
        });
        (self.events)(TurnEvent::EngineSelected {
            engine_id: self.lease.info.id.clone(),
            selection: self.lease.selection(),
            warning: self.lease.degraded.clone(),
        });
        // Durable engines get earlier turns first; a turn the engine has not
        // accepted blocks this session only.
        if self.lease.remote && crate::engines::durable(&self.lease.info) {
            let backlog =
                self.core.drain_commits(&self.session.session_id, &self.lease.key, &self.cancel, false).await?;
            if self.cancel.is_cancelled() {
                self.close(Outcome::Aborted, Vec::new()).await?;
                return Ok(Begun::Failed(Failure::aborted()));
            }
            if backlog.waiting > 0 {
                let failure = Failure::new(FailureReason::EngineBacklog, backlog.reason(&self.lease.key));
                self.close(Outcome::Failed(failure.clone()), Vec::new()).await?;
                return Ok(Begun::Failed(failure));
            }
        }
        let budget = self.budget(0);
        let fence = self.admitted[0].id.clone();
        let remap = self.core.bootstrap_if_new(&self.lease, &self.session, &fence, budget, &self.call).await;
        // Maintain(bootstrap) may have copied the branch, admitted entries
        // included: the fence and positions follow the copies.
        for e in &mut self.admitted {
            if let Some(new) = remap.get(&e.id) {
                // A copied message keeps its message id (the old entry id):
                // both name the turn's own message.
                self.own.insert(new.clone());
                e.id.clone_from(new);
            }
        }

        // Proactive compaction: tokens ≥ window − min(20000, 25 % of window).
        // Engines that own compaction are judged by what they assemble.
        let tokens = self.history_tokens().await?;
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

    /// Time the turn waited on the model or the client (admission control
    /// does not count it as the gateway's latency).
    pub fn outside_gateway(&mut self, waited: std::time::Duration) {
        self.admission.outside(waited);
    }

    pub fn cancel(&self) -> &CancellationToken {
        &self.cancel
    }

    /// Whether the engine owns compaction (the managed precheck skips).
    pub fn engine_owns_compaction(&self) -> bool {
        self.lease.info.owns_compaction
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

    /// The context for the next model call: the engine assembles the
    /// visible history (which holds everything appended so far) within the
    /// budget left by `pending`, the messages the caller will show after it.
    /// Engines owning compaction that assemble past the proactive threshold
    /// compact once and assemble again.
    pub async fn assemble(&mut self, pending: &[AgentMessage], field: &str) -> Result<Context, StepError> {
        let span = self.span.clone();
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
        self.check_turn_messages(pending, field)?;
        let budget = self.budget(estimate::messages_tokens(pending));
        loop {
            if self.cancel.is_cancelled() {
                return Err(self.aborted());
            }
            let rendered = self.history().await?.to_vec();
            let pre_assembly_tokens = self.history_tokens().await?;
            let grant = self.core.grant(&self.lease, &self.session, Some(&self.admitted[0].id), None);
            let request = pb::AssembleRequest {
                session_id: self.session.session_id.clone(),
                session_key: Some(self.session.session_key.clone()),
                messages: rendered,
                token_budget: Some(budget),
                available_tools: self.available_tools.clone(),
                prompt: Some(self.prompt.clone()),
                model: Some(self.lease.model.id.clone()),
                runtime_settings: Some(self.core.runtime_settings(&self.lease, budget, self.degraded)),
                runtime_context: Some(self.core.runtime_context(
                    &self.lease,
                    &self.session,
                    budget,
                    pre_assembly_tokens,
                )),
                host: grant.as_ref().map(|g| g.access.clone()),
                cursor: self.base.clone(),
                ..Default::default()
            };
            let assembled = self.lease.engine.assemble(request, &self.call).await;
            drop(grant);
            let assembled = match assembled {
                Ok(a) => a,
                Err(EngineCallError::Cancelled) => return Err(self.aborted()),
                // The engine lost what the cursor says it holds: resync
                // once (the next history read), then assemble again.
                Err(EngineCallError::HistoryGap { .. }) if !std::mem::replace(&mut self.resynced, true) => {
                    self.core.drop_cursor(&self.lease, &self.session).await?;
                    self.history = None;
                    continue;
                }
                // Shed, failed or quarantined on a delta: once more with the
                // whole history, which legacy can answer.
                Err(_) if self.base.is_some() && !std::mem::replace(&mut self.full_history, true) => {
                    self.history = None;
                    continue;
                }
                Err(e) => {
                    return Err(StepError::Failed(Failure::new(
                        FailureReason::EngineError,
                        format!("The context engine could not assemble the prompt: {e}."),
                    )));
                }
            };
            let addition = assembled.system_prompt_addition.filter(|a| !a.trim().is_empty());
            let estimated_tokens =
                estimate::messages_tokens(&assembled.messages) + addition.as_deref().map_or(0, estimate::text_tokens);
            if self.lease.info.owns_compaction && !self.proactive_done && estimated_tokens >= self.threshold() {
                self.proactive_done = true;
                self.recover(Trigger::Proactive).await.map_err(StepError::Failed)?;
                continue;
            }
            let projection = self.projection(assembled.projection).await?;
            self.contexts += 1;
            return Ok(Context {
                messages: assembled.messages,
                system_prompt_addition: addition,
                estimated_tokens,
                pre_assembly_tokens,
                may_overflow: assembled.prompt_authority == pb::PromptAuthority::PreassemblyMayOverflow as i32,
                budget,
                projection,
                sequence: self.contexts,
            });
        }
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
                self.lease.info.id
            )));
            return Ok(None);
        }
        let fingerprint = p.fingerprint.as_deref().map(str::trim).unwrap_or_default();
        let limit = limits::MAX_ID_BYTES;
        if epoch.len() > limit || fingerprint.len() > limit {
            self.emit(TurnEvent::Warning(format!(
                "context engine \"{}\" sent a projection epoch or fingerprint over {limit} bytes; using per-turn projection",
                self.lease.info.id
            )));
            return Ok(None);
        }
        let reinject = self
            .core
            .store
            .record_projection(&self.session.session_id, &self.lease.host.id, epoch, fingerprint)
            .await?;
        Ok(Some(Projection { epoch: epoch.to_owned(), fingerprint: fingerprint.to_owned(), reinject }))
    }

    /// Checks messages a caller adds to this turn: assistant or tool roles,
    /// well formed and within the size limits, tool call ids new to the
    /// turn, every tool result answering a call of this turn (earlier, or
    /// before it in `list`) that no result answered yet. Returns the calls
    /// and answers `list` adds.
    fn check_turn_messages(
        &self,
        list: &[AgentMessage],
        field: &str,
    ) -> Result<(HashSet<String>, HashSet<String>), CoreError> {
        if list.len() > limits::MAX_MESSAGES {
            return Err(CoreError::too_large(
                field,
                format!("has {} messages, the limit is {}", list.len(), limits::MAX_MESSAGES),
            ));
        }
        let (mut calls, mut answers) = (HashSet::new(), HashSet::new());
        for (i, m) in list.iter().enumerate() {
            let at = format!("{field}[{i}]");
            let role = Role::try_from(m.role).unwrap_or(Role::Unspecified);
            if !matches!(role, Role::Assistant | Role::Tool) {
                return Err(CoreError::invalid(format!("{at}.role"), "must be ROLE_ASSISTANT or ROLE_TOOL"));
            }
            if m.content.is_empty() {
                return Err(CoreError::invalid(format!("{at}.content"), "is empty"));
            }
            check_client_message(m, &at)?;
            for (j, p) in m.content.iter().enumerate() {
                let part = format!("{at}.content[{j}]");
                match &p.part {
                    Some(Part::ToolCall(c)) => {
                        if role != Role::Assistant {
                            return Err(CoreError::invalid(
                                format!("{part}.tool_call"),
                                "only assistant messages call tools",
                            ));
                        }
                        if self.tool_calls.contains(&c.id) || !calls.insert(c.id.clone()) {
                            return Err(CoreError::invalid(
                                format!("{part}.tool_call.id"),
                                format!("{:?} is already a tool call of this turn", c.id),
                            ));
                        }
                    }
                    Some(Part::ToolResult(r)) => {
                        let id = &r.tool_call_id;
                        if !self.tool_calls.contains(id) && !calls.contains(id) {
                            return Err(CoreError::invalid(
                                format!("{part}.tool_result.tool_call_id"),
                                format!("{id:?} is not a tool call of this turn"),
                            ));
                        }
                        if self.answered.contains(id) || !answers.insert(id.clone()) {
                            return Err(CoreError::invalid(
                                format!("{part}.tool_result.tool_call_id"),
                                format!("tool call {id:?} already has a result"),
                            ));
                        }
                    }
                    Some(_) if role == Role::Tool => {
                        return Err(CoreError::invalid(part, "a tool message carries tool results only"));
                    }
                    _ => {}
                }
            }
        }
        Ok((calls, answers))
    }

    /// Appends what the model and tools produced; durable when it returns.
    /// Returns the entry ids, in order.
    pub async fn append(&mut self, messages: Vec<AgentMessage>, field: &str) -> Result<Vec<String>, StepError> {
        if messages.is_empty() {
            return Err(CoreError::invalid(field, "is required").into());
        }
        if self.own.len() + messages.len() > limits::MAX_MESSAGES {
            return Err(
                CoreError::too_large(field, format!("a turn holds at most {} messages", limits::MAX_MESSAGES)).into()
            );
        }
        let bytes: usize = messages.iter().map(prost::Message::encoded_len).sum();
        if self.bytes + bytes > MAX_TURN_BYTES {
            return Err(CoreError::too_large(
                field,
                format!(
                    "a turn's messages are limited to {} MiB in all (its CommitTurn must fit one gRPC message)",
                    MAX_TURN_BYTES >> 20
                ),
            )
            .into());
        }
        let (calls, answers) = self.check_turn_messages(&messages, field)?;
        let entries = messages
            .into_iter()
            .map(|mut m| {
                if m.created_at_unix_ms == 0 {
                    m.created_at_unix_ms = now_unix_ms();
                }
                NewEntry { turn_id: self.turn_id.clone(), entry: Entry::Message(m) }
            })
            .collect();
        let stored = self.core.store.append(&self.session.session_id, entries).await?;
        self.tool_calls.extend(calls);
        self.answered.extend(answers);
        self.own.extend(stored.iter().map(|e| e.id.clone()));
        self.bytes += bytes;
        self.remember(&stored);
        Ok(stored.into_iter().map(|e| e.id).collect())
    }

    /// Extends the remembered history with entries just stored.
    fn remember(&mut self, stored: &[pb::TranscriptEntry]) {
        if let Some(h) = &mut self.history {
            h.extend(stored.iter().filter_map(|e| match &e.entry {
                Some(Entry::Message(m)) => Some(m.clone()),
                _ => None,
            }));
        }
    }

    /// The visible history now (for a DELTA engine, what follows its
    /// cursor): remembered, or read when a compaction changed the branch.
    async fn history(&mut self) -> Result<&[AgentMessage], CoreError> {
        if self.history.is_none() {
            let h = if self.lease.remote && crate::engines::delta(&self.lease.info) && !self.full_history {
                self.delta_history().await?
            } else {
                self.base = None;
                self.core.visible(&self.session.session_id).await?.render()
            };
            self.history = Some(h);
        }
        Ok(self.history.as_deref().unwrap_or_default())
    }

    /// Tokens of the whole visible history, the engine's share included.
    async fn history_tokens(&mut self) -> Result<u64, CoreError> {
        let own = estimate::messages_tokens(self.history().await?);
        Ok(self.base.as_ref().map_or(0, |b| b.tokens) + own)
    }

    /// What follows the DELTA engine's cursor, resyncing it first when it
    /// is missing or no longer on the branch; the whole visible history if
    /// the engine failed meanwhile (legacy answers then).
    async fn delta_history(&mut self) -> Result<Vec<AgentMessage>, CoreError> {
        let (core, sid) = (self.core.clone(), self.session.session_id.clone());
        let mut cursor = core.store.cursor(&sid, &self.lease.key).await?;
        for _ in 0..2 {
            if let Some(c) = &cursor
                && let Some(after) = core.store.branch_after(&sid, c).await?
                // A host compaction since the cursor changed what is visible.
                && after.iter().all(|e| matches!(e.entry, Some(Entry::Message(_))))
            {
                self.base = Some(c.clone());
                return Ok(after
                    .into_iter()
                    .filter_map(|e| match e.entry {
                        Some(Entry::Message(m)) => Some(m),
                        _ => None,
                    })
                    .collect());
            }
            let fence = match &self.admitted[0].entry {
                Some(Entry::Message(m)) => m.id.clone(),
                _ => self.admitted[0].id.clone(),
            };
            cursor = core.resync(&self.lease, &self.session, &fence, &self.call).await?;
            if cursor.is_none() {
                break;
            }
        }
        self.base = None;
        Ok(core.visible(&sid).await?.render())
    }

    /// Compaction inside the turn (force, target=budget) after `trigger`
    /// said the prompt is too large: a failure is a warning and the turn
    /// goes on; only an abort ends it.
    pub async fn recover(&mut self, trigger: Trigger) -> Result<(), Failure> {
        let span = self.span.clone();
        async {
            let budget = self.budget(0);
            let events = self.events.clone();
            let sink = move |e| events(TurnEvent::Compaction(e));
            let result =
                self.core.compact(&self.lease, &self.session, trigger, Some(budget), None, &sink, &self.cancel).await;
            self.history = None;
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
    /// [`MAX_OVERFLOW_COMPACTIONS`] times a turn. `Ok(false)`: no
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
        self.history = None;
        let span = self.span.clone();
        let events = self.events.clone();
        let sink = move |e| events(TurnEvent::Compaction(e));
        self.core
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
        let span = self.span.clone();
        self.close(outcome, last).instrument(span).await
    }

    async fn close(&mut self, outcome: Outcome, last: Vec<AgentMessage>) -> Result<Finished, CoreError> {
        let Some(guard) = self.guard.take() else {
            return Err(CoreError::Precondition("the turn has ended".into()));
        };
        let (store, session_id) = (self.core.store.clone(), self.session.session_id.clone());
        let rewind = async || {
            let r = store.close_turn(&session_id, crate::store::TurnClose::Rewind).await;
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
        self.core.metrics.turns_in_flight.dec();
        self.core.metrics.turn_finished(self.driver.as_str(), label, self.started.elapsed());
        self.export_span(label, &outcome);
        guard.release().await;
        result
    }

    /// The turn's span, when spans are exported (`gateway.otlp`).
    fn export_span(&self, label: &str, outcome: &Outcome) {
        let (Some(spans), Some(this)) = (&self.core.metrics.spans, self.call.trace) else { return };
        let error = match outcome {
            Outcome::Failed(f) => Some(f.message.clone()),
            _ if label == "error" => Some("the turn could not be accepted".into()),
            _ => None,
        };
        spans.record(ctxgate_engine_sdk::otlp::Span {
            name: format!("ctxgate.turn/{}", self.driver.as_str()),
            kind: ctxgate_engine_sdk::otlp::Kind::Server,
            this,
            parent: self.client_span,
            start: self.started_at,
            end: std::time::SystemTime::now(),
            attributes: vec![
                ("ctxgate.session_id", self.session.session_id.clone()),
                ("ctxgate.agent_id", self.session.agent_id.clone()),
                ("ctxgate.turn_id", self.turn_id.clone()),
                ("ctxgate.engine", self.lease.info.id.clone()),
                ("ctxgate.outcome", label.to_owned()),
            ],
            error,
        });
    }

    async fn accept(&mut self, last: Vec<AgentMessage>) -> Result<Finished, CoreError> {
        // A model shown a tool call without its result refuses the history.
        if let Some(open) = self.tool_calls.iter().find(|c| !self.answered.contains(*c)) {
            return Err(CoreError::Precondition(format!(
                "tool call {open:?} has no result: append its result, or end the turn failed"
            )));
        }
        let (core, lease, session) = (self.core.clone(), self.lease.clone(), self.session.clone());
        // The turn is closing: its history is taken, not copied.
        self.history().await?;
        let mut history = self.history.take().unwrap_or_default();
        // Queued for the durable engine even when legacy served the turn.
        let commit = lease.record.as_deref().map(|engine| {
            let held = self.base.as_ref().map_or(0, |b| b.message_count as usize);
            let position = held + self.position_in(&history);
            core.commit_draft(engine, &session, &self.turn_id, &self.admitted[0], position as u64)
        });
        let entries =
            last.into_iter().map(|m| NewEntry { turn_id: self.turn_id.clone(), entry: Entry::Message(m) }).collect();
        let stored =
            core.store.close_turn(&session.session_id, crate::store::TurnClose::Accept { entries, commit }).await?;
        history.extend(stored.iter().filter_map(|e| match &e.entry {
            Some(Entry::Message(m)) => Some(m.clone()),
            _ => None,
        }));
        let budget = self.budget(0);
        let engine_committed = if let Some(engine) = lease.record.as_deref() {
            // The engine gets no after-turn or ingest for a durable turn. The
            // turn is accepted and its commit queued: a failure to deliver
            // it now is the outbox's to retry, not the turn's.
            let waiting = match core.drain_commits(&session.session_id, engine, &self.cancel, false).await {
                Ok(b) => b.waiting,
                Err(e) => {
                    tracing::warn!(error = %e, "delivering queued commits failed; they stay queued");
                    1
                }
            };
            if waiting > 0 && lease.remote {
                self.emit(TurnEvent::Warning(
                    "the context engine has not accepted this turn yet; it stays queued and is retried".into(),
                ));
            }
            waiting == 0
        } else if lease.remote && lease.host.has(Capability::AfterTurn) {
            // Legacy keeps nothing of its own: no after-turn to build.
            self.after_turn(history, budget).await
        } else {
            false
        };
        core.maintain_after_turn(&lease, &session, budget, &self.call).await;
        Ok(Finished { entries: stored, engine_committed })
    }

    /// Where the turn's own messages start in `history`: its first message
    /// still visible (a compaction mid-turn may have summarised the first
    /// ones), else the end.
    fn position_in(&self, history: &[AgentMessage]) -> usize {
        history.iter().position(|m| self.own.contains(&m.id)).unwrap_or(history.len())
    }

    /// after-turn with the visible history, or Ingest of the turn's
    /// messages for engines without it. True when the engine took it.
    async fn after_turn(&self, history: Vec<AgentMessage>, budget: u64) -> bool {
        let (core, lease, session) = (&self.core, &self.lease, &self.session);
        // Everything before the admitted user message existed before the prompt.
        let pre_prompt = self.position_in(&history);
        let new_messages: Vec<AgentMessage> = history[pre_prompt..].to_vec();
        let grant = core.grant(lease, session, None, None);
        let tokens = self.base.as_ref().map_or(0, |b| b.tokens) + estimate::messages_tokens(&history);
        let after = pb::AfterTurnRequest {
            cursor: self.base.clone(),
            session_id: session.session_id.clone(),
            session_key: Some(session.session_key.clone()),
            session_target: Some(target(session)),
            session_file: session.session_key.clone(),
            pre_prompt_message_count: pre_prompt as u64,
            messages: history,
            token_budget: Some(budget),
            runtime_settings: Some(core.runtime_settings(lease, budget, None)),
            runtime_context: Some(core.runtime_context(lease, session, budget, tokens)),
            host: grant.as_ref().map(|g| g.access.clone()),
            ..Default::default()
        };
        let warn = |e: EngineCallError| self.emit(TurnEvent::Warning(format!("after-turn failed: {e}")));
        match lease.engine.after_turn(after, &self.call).await {
            Ok(_) => {
                if let Some(base) = &self.base
                    && let Err(e) = core.advance_cursor(lease, session, base).await
                {
                    tracing::warn!(error = %e, "advancing the engine's cursor failed; the next turn resyncs");
                }
                return true;
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
                        return false;
                    }
                }
                return true;
            }
            Err(e) => warn(e),
        }
        false
    }
}

/// A message a client adds (user or turn message): well formed, within the
/// content limit, metadata bounded. Ids are the gateway's (entry ids), so
/// the rest is checked with a stand-in id.
pub fn check_client_message(m: &AgentMessage, at: &str) -> Result<(), CoreError> {
    let probe = AgentMessage { id: "m".into(), ..m.clone() };
    ctxgate_proto::validate::message(&probe, at)?;
    let meta: usize = m.metadata.iter().map(|(k, v)| k.len() + v.len()).sum();
    if m.metadata.len() > MAX_METADATA_ENTRIES || meta > MAX_METADATA_BYTES {
        return Err(CoreError::too_large(
            format!("{at}.metadata"),
            format!("is limited to {MAX_METADATA_ENTRIES} entries and {MAX_METADATA_BYTES} bytes"),
        ));
    }
    Ok(())
}

/// A turn's messages in all: its CommitTurn (16 MiB at most, with anchors
/// and host params) must fit.
const MAX_TURN_BYTES: usize = 12 << 20;

/// Bounds on a client message's free-form metadata.
const MAX_METADATA_ENTRIES: usize = 64;
const MAX_METADATA_BYTES: usize = 16 * 1024;

impl Drop for Turn {
    /// An open turn dropped (stream gone, client cancel, a refused step) is
    /// an abort: its messages leave the branch. The session stays held
    /// until that is written, so the next turn starts after it.
    fn drop(&mut self) {
        let Some(guard) = self.guard.take() else { return };
        self.cancel.cancel();
        let metrics = self.core.metrics.clone();
        metrics.turns_in_flight.dec();
        metrics.turn_finished(self.driver.as_str(), Outcome::Aborted.label(), self.started.elapsed());
        let (store, session_id) = (self.core.store.clone(), self.session.session_id.clone());
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        runtime.spawn(async move {
            if let Err(e) = store.close_turn(&session_id, crate::store::TurnClose::Rewind).await {
                tracing::error!(session = %session_id, error = %e, "rewinding an aborted turn failed");
            }
            drop(guard);
        });
    }
}
