//! The managed driver (`RunTurn`): the gateway's own model loop over the
//! turn's steps — assemble, the pre-prompt check, the model call, overflow
//! and timeout recovery, then finish.

use std::sync::Arc;
use std::time::Duration;

use ctxgate_proto::pb::{self, AgentMessage, Role, content_part::Part};
use ctxgate_proto::{estimate, limits};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::core::admission::Permit;
use crate::core::turn::{Begun, MAX_OVERFLOW_COMPACTIONS, StepError, Turn};
use crate::core::types::{
    BusyPolicy, Driver, EventSink, Failure, FailureReason, HostProfile, Outcome, Trigger, TurnEvent, TurnSpec,
};
use crate::core::{Core, CoreError, session_ref, text_message};
use crate::provider::{ChatRequest, ChatResponse, ModelError};
use crate::transcript::Messages;

const MAX_TIMEOUT_COMPACTIONS: u32 = 2;
/// Timeout recovery only compacts when the prompt is above this share of the budget.
const TIMEOUT_COMPACTION_SHARE: f64 = 0.65;
/// Tool results are cut to this many characters by the last-resort truncation.
const TRUNCATED_TOOL_RESULT_CHARS: usize = 2_000;

/// A model delta is sent once it holds this much text ...
const MIN_DELTA_BYTES: usize = 512;
/// ... or its first byte has waited this long.
const MAX_DELTA_DELAY: Duration = Duration::from_millis(25);

/// A validated managed turn request.
#[derive(Debug, Clone)]
pub struct ManagedTurn {
    pub agent_id: String,
    pub session_key: String,
    pub message: String,
    pub system_prompt: Option<String>,
    pub busy: BusyPolicy,
    /// The client's `traceparent`, if it sent a valid one.
    pub trace: Option<ctxgate_proto::trace::TraceParent>,
}

impl ManagedTurn {
    pub fn new(
        agent_id: &str,
        session_key: &str,
        message: String,
        system_prompt: Option<String>,
        busy: BusyPolicy,
    ) -> Result<Self, CoreError> {
        let (agent_id, session_key) = session_ref(agent_id, session_key)?;
        if message.trim().is_empty() {
            return Err(CoreError::invalid("message", "is empty"));
        }
        if message.len() > limits::MAX_MESSAGE_CONTENT_BYTES {
            return Err(CoreError::too_large(
                "message",
                format!("is {} bytes, the limit is {}", message.len(), limits::MAX_MESSAGE_CONTENT_BYTES),
            ));
        }
        Ok(Self { agent_id, session_key, message, system_prompt, busy, trace: None })
    }
}

/// How a managed turn ended (its last event).
#[derive(Debug, Clone)]
pub enum TurnEnd {
    Completed { entry_id: String, text: String, usage: pb::Usage },
    Failed(Failure),
}

impl Core {
    /// Runs one managed turn; its events go to `events`. An error is
    /// returned only before admission (or for a store failure); after
    /// admission the outcome is the returned [`TurnEnd`].
    pub async fn run_managed(
        self: &Arc<Self>,
        req: ManagedTurn,
        events: EventSink,
        cancel: CancellationToken,
        admission: Permit,
    ) -> Result<TurnEnd, CoreError> {
        let system = req.system_prompt.clone();
        let spec = TurnSpec {
            agent_id: req.agent_id,
            session_key: req.session_key,
            driver: Driver::Managed,
            host: HostProfile::embedded(),
            model: self.provider_model(),
            user_messages: vec![text_message(Role::User, req.message)],
            system_prompt_tokens: system.as_deref().map_or(0, estimate::text_tokens),
            available_tools: Vec::new(),
            busy: req.busy,
            trace: req.trace,
        };
        let turn = match self.begin(spec, events.clone(), cancel, admission).await? {
            Begun::Open(t) => t,
            Begun::Failed(f) => return Ok(TurnEnd::Failed(f)),
        };
        let span = tracing::info_span!("managed", turn = %turn.turn_id());
        self.model_loop(turn, system, events).instrument(span).await
    }

    async fn model_loop(
        &self,
        mut turn: Turn,
        system: Option<String>,
        events: EventSink,
    ) -> Result<TurnEnd, CoreError> {
        let (mut timeout_compactions, mut truncated, mut tool_rounds) = (0, false, 0);
        let max_tool_rounds = self.config.agents.defaults.max_tool_rounds;
        for attempt in 1.. {
            let ctx = match turn.assemble(&[], "messages").await {
                Ok(c) => c,
                Err(StepError::Failed(f)) => return fail(turn, f).await,
                Err(StepError::Refused(e)) => return Err(e),
            };
            let mut messages = ctx.messages;
            if let Some(addition) = ctx.system_prompt_addition {
                messages.to_mut().insert(0, text_message(Role::System, addition));
            }
            // The context's estimate counts the addition as this message;
            // only truncated results change it.
            let estimated = if truncated {
                truncate_tool_results(messages.to_mut());
                estimate::messages_tokens(messages.iter())
            } else {
                ctx.estimated_tokens
            };
            events(TurnEvent::Assembled {
                messages: messages.len() as u32,
                estimated_tokens: estimated,
                token_budget: ctx.budget,
                attempt,
            });
            // Pre-prompt check: a prompt over budget is an overflow without
            // spending a model call. Engines owning compaction skip it unless
            // they say the pre-assembly history may overflow.
            let checked = if ctx.may_overflow { estimated.max(ctx.pre_assembly_tokens) } else { estimated };
            let precheck = !turn.engine_owns_compaction() || ctx.may_overflow;
            let result = if precheck && checked > ctx.budget {
                Err(ModelError::ContextOverflow(format!("the prompt is {checked} tokens, the budget {}", ctx.budget)))
            } else {
                let tools = ctx.engine_tools;
                // The model's time is not the gateway's work: admission
                // control neither counts nor samples it.
                turn.outside_gateway();
                let r = self.call_model(system.as_deref(), messages, tools, &events, turn.cancel()).await;
                turn.back_in_gateway();
                r
            };
            match result {
                // The model called the engine's tools: their results join the
                // turn and the model is asked again, with the context assembled anew.
                Ok(reply) if !reply.tool_calls.is_empty() => {
                    tool_rounds += 1;
                    if tool_rounds > max_tool_rounds {
                        let f = Failure::new(
                            FailureReason::ToolRounds,
                            format!(
                                "The model kept calling tools ({max_tool_rounds} rounds, agents.defaults.maxToolRounds) without answering; the turn was stopped. Ask again, more specifically."
                            ),
                        );
                        return fail(turn, f).await;
                    }
                    if let Err(f) = self.run_tools(&mut turn, reply, &events).await {
                        return fail(turn, f).await;
                    }
                }
                Ok(reply) => {
                    let mut m = text_message(Role::Assistant, reply.text.clone());
                    m.usage = Some(reply.usage);
                    m.metadata.insert("model".into(), self.provider.model().into());
                    let finished = turn.finish(Outcome::Accepted, vec![m]).await?;
                    let entry_id = finished.entries.first().map(|e| e.id.clone()).unwrap_or_default();
                    return Ok(TurnEnd::Completed { entry_id, text: reply.text, usage: reply.usage });
                }
                Err(ModelError::Cancelled) => return fail(turn, Failure::aborted()).await,
                Err(ModelError::ContextOverflow(why)) => match turn.overflow().await {
                    Ok(true) => {}
                    Ok(false) if !truncated => {
                        truncated = true;
                        events(TurnEvent::Warning(
                            "still over the context window: truncating large tool results for this turn".into(),
                        ));
                    }
                    Ok(false) => {
                        let f = Failure::new(
                            FailureReason::ContextOverflow,
                            format!(
                                "The conversation does not fit the model's context window even after {MAX_OVERFLOW_COMPACTIONS} compactions ({why}). Run /compact with instructions to summarise harder, or /new to start a fresh session."
                            ),
                        );
                        return fail(turn, f).await;
                    }
                    Err(f) => return fail(turn, f).await,
                },
                Err(ModelError::Timeout(after)) => {
                    let share = estimated as f64 / ctx.budget.max(1) as f64;
                    if timeout_compactions < MAX_TIMEOUT_COMPACTIONS && share > TIMEOUT_COMPACTION_SHARE {
                        timeout_compactions += 1;
                        turn.note_timeout();
                        if let Err(f) = turn.recover(Trigger::Timeout).await {
                            return fail(turn, f).await;
                        }
                    } else {
                        let f = Failure::new(
                            FailureReason::ModelTimeout,
                            format!(
                                "The model did not answer within {after:?}. Try again, or /compact to make the prompt smaller."
                            ),
                        );
                        return fail(turn, f).await;
                    }
                }
                Err(e) => {
                    // The provider's words (capped, without the URL) stay in
                    // the log, under the id the client gets.
                    let id = crate::core::new_error_id();
                    tracing::warn!(error_id = %id, error = %e, "the model call failed");
                    let f = Failure::new(
                        FailureReason::ModelError,
                        format!(
                            "The model call failed ({}; error id {id}). Check the gateway's model settings and try again.",
                            e.class()
                        ),
                    );
                    return fail(turn, f).await;
                }
            }
        }
        unreachable!("the attempt loop returns")
    }

    /// Appends the model's tool calls (with its text) and each call's
    /// result: the engine's tool, or an error result for a tool that is not
    /// the engine's. A malformed call (an empty or repeated id) fails the
    /// turn: the model broke the tool protocol.
    async fn run_tools(&self, turn: &mut Turn, reply: ChatResponse, events: &EventSink) -> Result<(), Failure> {
        let mut content = Vec::new();
        if !reply.text.is_empty() {
            content.push(pb::ContentPart { part: Some(Part::Text(reply.text)) });
        }
        content.extend(reply.tool_calls.iter().map(|c| pb::ContentPart { part: Some(Part::ToolCall(c.clone())) }));
        let mut m =
            AgentMessage { role: Role::Assistant as i32, content, usage: Some(reply.usage), ..Default::default() };
        m.metadata.insert("model".into(), self.provider.model().into());
        let refused = |e: CoreError| {
            Failure::new(
                FailureReason::ModelError,
                format!("The model's tool call could not be recorded: {}.", e.for_client()),
            )
        };
        match turn.append(vec![m], "model.tool_calls").await {
            Ok(_) => {}
            Err(StepError::Refused(e)) => return Err(refused(e)),
            Err(StepError::Failed(f)) => return Err(f),
        }
        for call in reply.tool_calls {
            events(TurnEvent::ToolCalled {
                id: call.id.clone(),
                name: call.name.clone(),
                arguments: call.arguments_json.clone(),
            });
            let answer = if turn.is_engine_tool(&call.name) {
                turn.call_tool(&call.id, "model.tool_call").await
            } else {
                let text = format!("There is no tool named {:?} here.", call.name);
                turn.answer(&call.id, &call.name, text, true, "model.tool_call").await
            };
            match answer {
                Ok(a) => events(TurnEvent::ToolAnswered(Box::new(a))),
                Err(StepError::Refused(e)) => return Err(refused(e)),
                Err(StepError::Failed(f)) => return Err(f),
            }
        }
        Ok(())
    }

    /// One model request, its streamed text forwarded as `ModelDelta`s,
    /// coalesced: a delta goes out once it holds [`MIN_DELTA_BYTES`] or its
    /// first byte is [`MAX_DELTA_DELAY`] old. Models stream a few bytes at a
    /// time, and HTTP/2 clients (h2 ≥ 0.4.20) end a connection that buffers
    /// too many small DATA frames unread.
    async fn call_model(
        &self,
        system: Option<&str>,
        messages: Messages,
        tools: Vec<pb::ToolDefinition>,
        events: &EventSink,
        cancel: &CancellationToken,
    ) -> Result<ChatResponse, ModelError> {
        let (dtx, mut drx) = tokio::sync::mpsc::channel::<String>(64);
        let events = events.clone();
        let forward = tokio::spawn(async move {
            let mut pending = String::new();
            let mut due: Option<Instant> = None;
            loop {
                let next = match due {
                    Some(at) => tokio::select! {
                        t = drx.recv() => t,
                        () = tokio::time::sleep_until(at) => {
                            events(TurnEvent::ModelDelta(std::mem::take(&mut pending)));
                            due = None;
                            continue;
                        }
                    },
                    None => drx.recv().await,
                };
                let Some(text) = next else { break };
                if pending.is_empty() {
                    due = Some(Instant::now() + MAX_DELTA_DELAY);
                }
                pending.push_str(&text);
                if pending.len() >= MIN_DELTA_BYTES {
                    events(TurnEvent::ModelDelta(std::mem::take(&mut pending)));
                    due = None;
                }
            }
            if !pending.is_empty() {
                events(TurnEvent::ModelDelta(pending));
            }
        });
        let req = ChatRequest {
            system: system.map(str::to_owned),
            messages,
            max_tokens: self.config.models.max_output_tokens,
            tools,
        };
        let r = self.provider.complete(req, Some(dtx), cancel).await;
        let _ = forward.await;
        r
    }
}

/// Ends the turn with `f` (aborted or failed) and reports it.
async fn fail(turn: Turn, f: Failure) -> Result<TurnEnd, CoreError> {
    let outcome = if f.reason == FailureReason::Aborted { Outcome::Aborted } else { Outcome::Failed(f.clone()) };
    turn.finish(outcome, Vec::new()).await?;
    Ok(TurnEnd::Failed(f))
}

/// The last-resort recovery: shortens every long tool result of this
/// prompt (the transcript keeps them whole).
fn truncate_tool_results(messages: &mut [AgentMessage]) {
    for m in messages {
        for p in &mut m.content {
            if let Some(Part::ToolResult(r)) = &mut p.part
                && r.text.chars().count() > TRUNCATED_TOOL_RESULT_CHARS
            {
                let cut: String = r.text.chars().take(TRUNCATED_TOOL_RESULT_CHARS).collect();
                r.text = format!("{cut}\n[… truncated by ctxgate to fit the context window]");
            }
        }
    }
}
