//! The harness API (`ctxgate.v1.Harness/DriveTurn`): an external agent
//! runtime drives one turn per stream over the turn core's steps. This
//! file only translates: requests are validated into core types, each one
//! runs one step, and step results and turn events go back as
//! `HarnessEvent`s, in order.

use std::sync::Arc;
use std::time::Duration;

use ctxgate_proto::gateway::{self as api, harness_event::Event as H, harness_request::Request as R};
use ctxgate_proto::pb::{self, Role};
use ctxgate_proto::{estimate, limits};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};

use crate::api::outbound::{Backlog, Event, Outbound};
use crate::api::{
    Compaction, EventStream, STREAM_BACKLOG, STREAM_CAPACITY, busy_policy, compaction, compaction_done, failed,
    guarded, session_fields,
};
use crate::core::types::{
    Capability, Context, Driver, EventSink, Failure, FailureReason, HostProfile, ModelSpec, Outcome, TurnEvent,
    TurnSpec,
};
use crate::core::{Begun, Core, CoreError, StepError, Turn, check_client_message, session_ref};

/// Longest host label and `end.reason` accepted.
const MAX_LABEL_BYTES: usize = 1024;
/// Most tool names a turn may declare.
const MAX_TOOLS: usize = 1024;

pub struct HarnessApi {
    pub core: Arc<Core>,
}

/// While the harness is behind, compaction progress drops; the rest is kept.
impl Event for api::HarnessEvent {
    fn backlog(&self) -> Backlog {
        match self.event {
            Some(H::CompactionProgress(_)) => Backlog::Drop,
            _ => Backlog::Keep,
        }
    }
}

/// The stream to the harness (bounded: see `outbound`). Turn events raised
/// inside a step never wait; a step's answer waits for the harness to make
/// room — until a cancel or the idle limit.
struct Out {
    events: Outbound<api::HarnessEvent>,
    /// The stream's call token: fired by the client leaving, Abort, an
    /// interrupting turn, or shutdown.
    cancel: CancellationToken,
    /// `gateway.limits.harnessIdleSeconds`.
    idle: Duration,
}

impl Out {
    /// Waits until what is queued reached the harness's stream.
    async fn flush(&self) -> Result<(), Status> {
        tokio::select! {
            biased;
            () = self.cancel.cancelled() => Err(aborted()),
            r = tokio::time::timeout(self.idle, self.events.drained()) => match r {
                Ok(true) => Ok(()),
                Ok(false) => Err(aborted()),
                Err(_) => Err(Status::deadline_exceeded(format!(
                    "the harness did not take its events within {} s: the turn was aborted (gateway.limits.harnessIdleSeconds)",
                    self.idle.as_secs()
                ))),
            },
        }
    }

    async fn answer(&self, event: H) -> Result<(), Status> {
        self.events.push_kept(api::HarnessEvent { event: Some(event) });
        self.flush().await
    }

    /// The stream's last word, after what is queued (even when the turn was
    /// cancelled: the harness should hear why).
    fn fail(&self, status: Status) {
        self.events.fail(status);
    }
}

#[tonic::async_trait]
impl api::harness_server::Harness for HarnessApi {
    type DriveTurnStream = EventStream<api::HarnessEvent>;

    async fn drive_turn(
        &self,
        req: Request<Streaming<api::HarnessRequest>>,
    ) -> Result<Response<Self::DriveTurnStream>, Status> {
        let trace = crate::api::trace_of(req.metadata());
        let requests = req.into_inner();
        let cancel = self.core.call_token();
        let limits = &self.core.config().gateway.limits;
        let idle = Duration::from_secs(limits.harness_idle_seconds);
        let begin_wait = Duration::from_secs(limits.harness_begin_seconds).min(idle);
        let (events, rx) = Outbound::new(STREAM_CAPACITY, STREAM_BACKLOG, cancel.clone());
        let out = Out { events, cancel: cancel.clone(), idle };
        let core = self.core.clone();
        tokio::spawn(async move {
            let mut driver = Drive { core, requests, out, trace, begin_wait };
            if let Err(status) = driver.run().await {
                driver.out.fail(status);
            }
        });
        Ok(Response::new(guarded(rx, cancel)))
    }
}

/// One DriveTurn stream.
struct Drive {
    core: Arc<Core>,
    requests: Streaming<api::HarnessRequest>,
    out: Out,
    /// The client's `traceparent` (the stream's metadata).
    trace: Option<ctxgate_proto::trace::TraceParent>,
    /// `gateway.limits.harnessBeginSeconds`.
    begin_wait: Duration,
}

impl Drive {
    /// The next request; `None` when the harness closed its side. A cancel
    /// (Abort, an interrupting turn, shutdown, or the client itself) ends
    /// the stream as CANCELLED.
    async fn next(&mut self) -> Result<Option<R>, Status> {
        self.out.flush().await?;
        let (cancel, idle) = (&self.out.cancel, self.out.idle);
        let message = tokio::select! {
            biased;
            () = cancel.cancelled() => return Err(aborted()),
            m = tokio::time::timeout(idle, self.requests.message()) => m.map_err(|_| {
                Status::deadline_exceeded(format!(
                    "no request for {} s: the turn was aborted (gateway.limits.harnessIdleSeconds)",
                    idle.as_secs()
                ))
            })??,
        };
        match message {
            None => Ok(None),
            Some(api::HarnessRequest { request: None }) => Err(Status::invalid_argument("request: is required")),
            Some(api::HarnessRequest { request: Some(r) }) => Ok(Some(r)),
        }
    }

    fn sink(&self) -> EventSink {
        let events = self.out.events.clone();
        Arc::new(move |e| {
            if let Some(event) = harness_event(e) {
                events.push(api::HarnessEvent { event: Some(event) });
            }
        })
    }

    async fn run(&mut self) -> Result<(), Status> {
        let wait = self.begin_wait;
        let first = tokio::time::timeout(wait, self.next()).await.map_err(|_| {
            Status::deadline_exceeded(format!(
                "no begin within {} s of the stream's start (gateway.limits.harnessBeginSeconds)",
                wait.as_secs()
            ))
        })?;
        let begin = match first? {
            None => return Ok(()),
            Some(R::Begin(b)) => b,
            Some(other) => {
                return Err(Status::failed_precondition(format!(
                    "{}: the first request of a turn must be begin",
                    request_name(&other)
                )));
            }
        };
        let spec = TurnSpec { trace: self.trace, ..turn_spec(&self.core, begin)? };
        let assembles = spec.host.has(Capability::AssembleBeforePrompt);
        let admission = self.core.admit()?;
        let mut turn = match self.core.begin(spec, self.sink(), self.out.cancel.clone(), admission).await? {
            Begun::Open(t) => t,
            Begun::Failed(f) => {
                self.out.answer(H::Failed(failed(f))).await?;
                let ended = api::Ended { outcome: api::TurnOutcome::Failed as i32, engine_committed: false };
                self.out.answer(H::Ended(ended)).await?;
                return self.after_end().await;
            }
        };
        match self.steps(&mut turn, assembles).await {
            Ok(end) => {
                let outcome = outcome(&end)?;
                // Refused: the turn is dropped, which aborts it.
                let last = turn.ending_with(end.messages, &outcome, "end.messages")?;
                let finished = turn.finish(outcome, last).await?;
                let ended = api::Ended { outcome: end.outcome, engine_committed: finished.engine_committed };
                self.out.answer(H::Ended(ended)).await?;
                self.after_end().await
            }
            Err(status) => {
                // Abort now, so the rewind is written before the harness hears why.
                if let Err(e) = turn.finish(Outcome::Aborted, Vec::new()).await {
                    tracing::warn!(error = %e, "ending an aborted harness turn failed");
                }
                Err(status)
            }
        }
    }

    /// The turn's requests after `begin`, each one step, until `end`.
    async fn steps(&mut self, turn: &mut Turn, assembles: bool) -> Result<api::End, Status> {
        if assembles {
            self.context(turn, Vec::new(), "begin").await?;
        }
        loop {
            // The harness closing its side before `end` is an abort.
            // The harness's own model and tools run while the gateway waits:
            // not the gateway's work (nor is a wait that ended in an error).
            turn.outside_gateway();
            let next = self.next().await;
            turn.back_in_gateway();
            let Some(request) = next? else { return Err(aborted()) };
            match request {
                R::Begin(_) => return Err(Status::failed_precondition("begin: this turn has begun already")),
                R::Assemble(a) => self.context(turn, a.pending, "assemble.pending").await?,
                R::Append(a) => match turn.append(a.messages, "append.messages").await {
                    Ok(entry_ids) => self.out.answer(H::Appended(api::Appended { entry_ids })).await?,
                    Err(e) => self.step_failed(e).await?,
                },
                R::Overflow(o) => match turn.overflow().await {
                    Ok(true) => self.context(turn, o.pending, "overflow.pending").await?,
                    Ok(false) => {
                        let f = Failure::new(
                            FailureReason::ContextOverflow,
                            "The conversation does not fit the model's context window even after 3 compactions. End the turn failed, or shorten what the model sees.",
                        );
                        self.out.answer(H::Failed(failed(f))).await?;
                    }
                    Err(_) => return Err(aborted()),
                },
                R::Compact(c) => match turn.compact(c.custom_instructions).await {
                    // The compaction's own events carried its `done`.
                    Ok(_) => self.out.flush().await?,
                    Err(CoreError::Aborted) => return Err(aborted()),
                    Err(e) => {
                        let done =
                            crate::core::types::CompactionDone { reason: Some(e.for_client()), ..Default::default() };
                        self.out.answer(H::CompactionDone(compaction_done(done))).await?;
                    }
                },
                R::CallTool(c) => match turn.call_tool(&c.tool_call_id, "call_tool.tool_call_id").await {
                    Ok(a) => {
                        let result = api::ToolResult { message: Some(a.message), entry_id: a.entry_id };
                        self.out.answer(H::ToolResult(result)).await?;
                    }
                    Err(e) => self.step_failed(e).await?,
                },
                R::End(e) => {
                    outcome(&e)?;
                    return Ok(e);
                }
            }
        }
    }

    /// Assembles and sends the context.
    async fn context(&mut self, turn: &mut Turn, pending: Vec<pb::AgentMessage>, field: &str) -> Result<(), Status> {
        match turn.assemble(&pending, field).await {
            Ok(ctx) => self.out.answer(H::Context(context(ctx))).await,
            Err(e) => self.step_failed(e).await,
        }
    }

    /// A refused step ends the stream with its status, an aborted one as
    /// CANCELLED; a failed one is a `failed` event (the harness ends the
    /// turn).
    async fn step_failed(&self, e: StepError) -> Result<(), Status> {
        match e {
            StepError::Refused(e) => Err(e.into()),
            StepError::Failed(f) if f.reason == FailureReason::Aborted => Err(aborted()),
            StepError::Failed(f) => self.out.answer(H::Failed(failed(f))).await,
        }
    }

    /// After `ended`: the harness closes its side; anything else is late.
    async fn after_end(&mut self) -> Result<(), Status> {
        match self.next().await? {
            None => Ok(()),
            Some(r) => Err(Status::failed_precondition(format!(
                "{}: the turn has ended; start a new DriveTurn for the next turn",
                request_name(&r)
            ))),
        }
    }
}

fn aborted() -> Status {
    Status::cancelled("the turn was aborted (Abort, an interrupting turn, or shutdown)")
}

fn request_name(r: &R) -> &'static str {
    match r {
        R::Begin(_) => "begin",
        R::Assemble(_) => "assemble",
        R::Append(_) => "append",
        R::Overflow(_) => "overflow",
        R::Compact(_) => "compact",
        R::CallTool(_) => "call_tool",
        R::End(_) => "end",
    }
}

fn outcome(e: &api::End) -> Result<Outcome, CoreError> {
    if e.reason.len() > MAX_LABEL_BYTES {
        return Err(CoreError::too_large("end.reason", format!("is over {MAX_LABEL_BYTES} bytes")));
    }
    Ok(match api::TurnOutcome::try_from(e.outcome) {
        Ok(api::TurnOutcome::Accepted) => Outcome::Accepted,
        Ok(api::TurnOutcome::Aborted) => Outcome::Aborted,
        Ok(api::TurnOutcome::Failed) => Outcome::Failed(Failure::new(FailureReason::HarnessFailed, e.reason.clone())),
        Ok(api::TurnOutcome::Unspecified) => return Err(CoreError::invalid("end.outcome", "is required")),
        Err(_) => return Err(CoreError::invalid("end.outcome", format!("unknown outcome {}", e.outcome))),
    })
}

/// A validated `begin`.
fn turn_spec(core: &Core, b: api::Begin) -> Result<TurnSpec, CoreError> {
    let (agent, key) = session_fields(b.session.as_ref()).map_err(|e| e.under("begin"))?;
    let (agent_id, session_key) = session_ref(agent, key).map_err(|e| e.under("begin"))?;
    let host = host_profile(b.host)?;
    let model = b.model.ok_or_else(|| CoreError::invalid("begin.model", "is required"))?;
    if model.id.trim().is_empty() {
        return Err(CoreError::invalid("begin.model.id", "is required"));
    }
    if model.id.len() > limits::MAX_ID_BYTES || model.provider.len() > limits::MAX_ID_BYTES {
        return Err(CoreError::too_large("begin.model", format!("ids are limited to {} bytes", limits::MAX_ID_BYTES)));
    }
    if model.context_window == 0 {
        return Err(CoreError::invalid("begin.model.context_window", "must be positive"));
    }
    let reserve =
        if model.max_output_tokens > 0 { model.max_output_tokens } else { core.reserve_for(model.context_window) };
    if reserve >= model.context_window {
        return Err(CoreError::invalid("begin.model.max_output_tokens", "must be below context_window"));
    }
    let system_prompt_tokens = match (&b.system_prompt, b.system_prompt_tokens) {
        (Some(p), _) if p.len() > limits::MAX_MESSAGE_CONTENT_BYTES => {
            return Err(CoreError::too_large(
                "begin.system_prompt",
                format!("is {} bytes, the limit is {}", p.len(), limits::MAX_MESSAGE_CONTENT_BYTES),
            ));
        }
        (Some(p), n) => estimate::text_tokens(p).max(n.unwrap_or(0)),
        (None, n) => n.unwrap_or(0),
    };
    if b.available_tools.len() > MAX_TOOLS {
        return Err(CoreError::too_large("begin.available_tools", format!("has over {MAX_TOOLS} names")));
    }
    for (i, t) in b.available_tools.iter().enumerate() {
        ctxgate_proto::validate::id(t, &format!("begin.available_tools[{i}]"))?;
    }
    let user_messages = user_messages(b.user_messages)?;
    Ok(TurnSpec {
        agent_id,
        session_key,
        driver: Driver::Harness,
        host,
        model: ModelSpec {
            id: model.id,
            provider: model.provider,
            context_window: model.context_window,
            reserve_tokens: reserve,
            max_output_tokens: reserve,
        },
        user_messages,
        system_prompt_tokens,
        available_tools: b.available_tools,
        busy: busy_policy(b.busy_policy, "begin.busy_policy")?,
        trace: None,
    })
}

fn host_profile(h: Option<api::HostProfile>) -> Result<HostProfile, CoreError> {
    let h = h.ok_or_else(|| CoreError::invalid("begin.host", "is required"))?;
    let name = h.id.strip_prefix("agent-harness:").map(str::trim).unwrap_or_default();
    if name.is_empty() {
        return Err(CoreError::invalid("begin.host.id", format!("{:?}: expected \"agent-harness:<name>\"", h.id)));
    }
    if h.id.len() > limits::MAX_ID_BYTES || h.label.len() > MAX_LABEL_BYTES {
        return Err(CoreError::too_large("begin.host", "the id or label is too long"));
    }
    let mut capabilities = Vec::new();
    for (i, c) in h.capabilities.iter().enumerate() {
        let cap = Capability::parse(c).ok_or_else(|| {
            let known: Vec<&str> = Capability::ALL.iter().map(|c| c.as_str()).collect();
            CoreError::invalid(
                format!("begin.host.capabilities[{i}]"),
                format!("unknown capability {c:?}; expected one of {}", known.join(", ")),
            )
        })?;
        if !capabilities.contains(&cap) {
            capabilities.push(cap);
        }
    }
    let label = if h.label.trim().is_empty() { format!("agent harness \"{name}\"") } else { h.label };
    Ok(HostProfile { id: h.id, label, capabilities })
}

fn user_messages(list: Vec<pb::AgentMessage>) -> Result<Vec<pb::AgentMessage>, CoreError> {
    if list.is_empty() {
        return Err(CoreError::invalid("begin.user_messages", "needs at least one message"));
    }
    if list.len() > limits::MAX_MESSAGES {
        return Err(CoreError::too_large("begin.user_messages", format!("is over {} messages", limits::MAX_MESSAGES)));
    }
    list.into_iter()
        .enumerate()
        .map(|(i, mut m)| {
            let at = format!("begin.user_messages[{i}]");
            match Role::try_from(m.role) {
                Ok(Role::User) => {}
                Ok(Role::Unspecified) => m.role = Role::User as i32,
                _ => return Err(CoreError::invalid(format!("{at}.role"), "must be ROLE_USER")),
            }
            if m.content.is_empty() {
                return Err(CoreError::invalid(format!("{at}.content"), "is empty"));
            }
            check_client_message(&m, &at)?;
            if m.content
                .iter()
                .any(|p| !matches!(p.part, Some(pb::content_part::Part::Text(_) | pb::content_part::Part::Image(_))))
            {
                return Err(CoreError::invalid(format!("{at}.content"), "a user message carries text and images only"));
            }
            if m.created_at_unix_ms == 0 {
                m.created_at_unix_ms = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as i64);
            }
            Ok(m)
        })
        .collect()
}

fn context(c: Context) -> api::Context {
    api::Context {
        messages: c.messages.into_vec(),
        system_prompt_addition: c.system_prompt_addition,
        estimated_tokens: c.estimated_tokens,
        token_budget: c.budget,
        projection: c.projection.map(|p| api::Projection {
            mode: pb::ProjectionMode::ThreadBootstrap as i32,
            epoch: p.epoch,
            fingerprint: p.fingerprint,
            reinject: p.reinject,
        }),
        sequence: c.sequence,
        engine_tools: c.engine_tools,
    }
}

/// A turn event as the harness sees it (managed-only events are dropped).
fn harness_event(e: TurnEvent) -> Option<H> {
    Some(match e {
        TurnEvent::Admitted { session_id, turn_id, entry_ids } => H::Admitted(api::Admitted {
            session_id,
            turn_id,
            entry_id: entry_ids.last().cloned().unwrap_or_default(),
            entry_ids,
        }),
        TurnEvent::EngineSelected { engine_id, selection, warning } => {
            H::EngineSelected(api::EngineSelected { engine_id, reason: selection.as_str().into(), warning })
        }
        TurnEvent::Compaction(c) => match compaction(c) {
            Compaction::Started(s) => H::CompactionStarted(s),
            Compaction::Progress(p) => H::CompactionProgress(p),
            Compaction::Done(d) => H::CompactionDone(d),
        },
        TurnEvent::Warning(message) => H::Warning(api::Warning { message }),
        // The harness asked for its tool calls itself (`tool_result` answers).
        TurnEvent::Assembled { .. }
        | TurnEvent::ModelDelta(_)
        | TurnEvent::ToolCalled { .. }
        | TurnEvent::ToolAnswered(_) => return None,
    })
}
