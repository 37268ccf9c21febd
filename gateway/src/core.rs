//! The turn core: managed turns and compaction for one gateway, independent
//! of the API that drives them. Events go out through a channel; the caller
//! going away cancels the work.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use ctxgate_proto::gateway as api;
use ctxgate_proto::pb::{self, AgentMessage, ContentPart, Role, content_part::Part, transcript_entry::Entry};
use ctxgate_proto::{estimate, limits};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::compaction::{self, CompactionError, Outcome};
use crate::config::{Config, IdentifierPolicy, ProviderKind};
use crate::engine::{CompactReply, Engine, EngineCallError};
use crate::metrics::Metrics;
use crate::provider::{ChatRequest, ModelError, ModelProvider};
use crate::store::{NewEntry, Session, Store, StoreError};
use crate::summarize::{Extractive, ModelSummarizer, Summarizer};
use crate::transcript::{self, Visible};

/// Errors the API maps to statuses (before a turn is admitted, and for
/// every non-turn call).
#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    #[error("{field}: {problem}")]
    Invalid { field: &'static str, problem: String },
    #[error("{field}: {problem}")]
    TooLarge { field: &'static str, problem: String },
    #[error("no session with key {0:?}")]
    NoSession(String),
    #[error("compaction timed out: {0}")]
    CompactionTimeout(String),
    #[error("compaction failed: {0}")]
    CompactionFailed(String),
    #[error("aborted")]
    Aborted,
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Overflow compactions before the gateway tries truncating tool results.
const MAX_OVERFLOW_COMPACTIONS: u32 = 3;
const MAX_TIMEOUT_COMPACTIONS: u32 = 2;
/// Timeout recovery only compacts when the prompt is above this share of the budget.
const TIMEOUT_COMPACTION_SHARE: f64 = 0.65;
/// Tool results are cut to this many characters by the last-resort truncation.
const TRUNCATED_TOOL_RESULT_CHARS: usize = 2_000;

/// Where compaction events go: to a turn's event stream or a Compact stream.
pub type CompactionSink<'a> = dyn Fn(api::compaction_event::Event) + Send + Sync + 'a;

pub struct Core {
    pub config: Arc<Config>,
    pub store: Arc<dyn Store>,
    pub provider: Arc<dyn ModelProvider>,
    pub engine: Arc<dyn Engine>,
    pub metrics: Metrics,
    summarizer: Arc<dyn Summarizer>,
    /// Per session: serialises its turns and compactions, and holds the
    /// token that Abort fires.
    running: Mutex<HashMap<String, Running>>,
    shutdown: CancellationToken,
}

struct Running {
    lock: Arc<tokio::sync::Mutex<()>>,
    cancel: Option<CancellationToken>,
}

/// Holds a session's lock; registers the work's cancel token for Abort.
struct SessionGuard<'a> {
    core: &'a Core,
    session_id: String,
    _lock: tokio::sync::OwnedMutexGuard<()>,
}

impl Drop for SessionGuard<'_> {
    fn drop(&mut self) {
        let mut running = self.core.running.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(r) = running.get_mut(&self.session_id) {
            r.cancel = None;
            // Only the map and this guard hold the lock: nobody waits, forget it.
            if Arc::strong_count(&r.lock) <= 2 {
                running.remove(&self.session_id);
            }
        }
    }
}

fn text_message(role: Role, text: String) -> AgentMessage {
    AgentMessage {
        role: role as i32,
        content: vec![ContentPart { part: Some(Part::Text(text)) }],
        created_at_unix_ms: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as i64),
        ..Default::default()
    }
}

fn event(e: api::turn_event::Event) -> api::TurnEvent {
    api::TurnEvent { event: Some(e) }
}

fn failed(reason: &str, message: impl Into<String>) -> api::turn_event::Event {
    api::turn_event::Event::Failed(api::Failed { reason: reason.into(), message: message.into() })
}

/// Validates a turn request; returns (agent, key).
pub fn validate_turn(req: &api::RunTurnRequest) -> Result<(String, String), CoreError> {
    let at = session_ref(req.session.as_ref())?;
    if req.message.trim().is_empty() {
        return Err(CoreError::Invalid { field: "message", problem: "is empty".into() });
    }
    if req.message.len() > limits::MAX_MESSAGE_CONTENT_BYTES {
        return Err(CoreError::TooLarge {
            field: "message",
            problem: format!("is {} bytes, the limit is {}", req.message.len(), limits::MAX_MESSAGE_CONTENT_BYTES),
        });
    }
    Ok(at)
}

/// Validates a session reference; returns (agent, key).
pub fn session_ref(r: Option<&api::SessionRef>) -> Result<(String, String), CoreError> {
    let r = r.ok_or(CoreError::Invalid { field: "session", problem: "is required".into() })?;
    let key = r.session_key.trim();
    if key.is_empty() {
        return Err(CoreError::Invalid { field: "session.session_key", problem: "is required".into() });
    }
    if key.len() > limits::MAX_ID_BYTES || r.agent_id.len() > limits::MAX_ID_BYTES {
        return Err(CoreError::TooLarge {
            field: "session",
            problem: format!("ids are limited to {} bytes", limits::MAX_ID_BYTES),
        });
    }
    let agent = if r.agent_id.trim().is_empty() { "main" } else { r.agent_id.trim() };
    Ok((agent.to_owned(), key.to_owned()))
}

impl Core {
    pub fn new(
        config: Arc<Config>,
        store: Arc<dyn Store>,
        provider: Arc<dyn ModelProvider>,
        engine: Arc<dyn Engine>,
        metrics: Metrics,
    ) -> Self {
        let summarizer: Arc<dyn Summarizer> = match provider.kind() {
            ProviderKind::Offline => Arc::new(Extractive),
            ProviderKind::Openai => Arc::new(ModelSummarizer { provider: provider.clone(), max_tokens: 2_048 }),
        };
        Self {
            config,
            store,
            provider,
            engine,
            metrics,
            summarizer,
            running: Mutex::default(),
            shutdown: CancellationToken::new(),
        }
    }

    /// A token for one API call: fired when the caller goes away (the API
    /// cancels it) or when the gateway shuts down.
    pub fn call_token(&self) -> CancellationToken {
        self.shutdown.child_token()
    }

    /// Cancels every running turn and compaction (gateway shutdown).
    pub fn shutdown(&self) {
        self.shutdown.cancel();
    }

    pub fn turns_in_flight(&self) -> u32 {
        self.running.lock().unwrap_or_else(|e| e.into_inner()).values().filter(|r| r.cancel.is_some()).count() as u32
    }

    /// Waits for the session's lock, then registers `cancel` for Abort.
    async fn enter(&self, session_id: &str, cancel: &CancellationToken) -> SessionGuard<'_> {
        let lock = {
            let mut running = self.running.lock().unwrap_or_else(|e| e.into_inner());
            running
                .entry(session_id.to_owned())
                .or_insert_with(|| Running { lock: Arc::default(), cancel: None })
                .lock
                .clone()
        };
        let guard = lock.lock_owned().await;
        if let Some(r) = self.running.lock().unwrap_or_else(|e| e.into_inner()).get_mut(session_id) {
            r.cancel = Some(cancel.clone());
        }
        SessionGuard { core: self, session_id: session_id.to_owned(), _lock: guard }
    }

    /// Fires the running turn's or compaction's token. True if one ran.
    pub async fn abort(&self, agent: &str, key: &str) -> Result<bool, CoreError> {
        let Some(s) = self.store.session(agent, key, false).await? else { return Ok(false) };
        let running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        Ok(match running.get(&s.session_id).and_then(|r| r.cancel.as_ref()) {
            Some(c) => {
                c.cancel();
                true
            }
            None => false,
        })
    }

    fn token_budget(&self, system: Option<&str>) -> u64 {
        let m = &self.config.models;
        m.context_window
            .saturating_sub(self.config.reserve_tokens())
            .saturating_sub(system.map_or(0, estimate::text_tokens))
    }

    async fn visible(&self, session_id: &str) -> Result<Visible, CoreError> {
        Ok(transcript::visible(&self.store.visible_tail(session_id).await?))
    }

    /// Runs one managed turn; every event goes to `events`. Errors are
    /// returned only before admission; after it, the outcome is an event.
    pub async fn run_turn(
        &self,
        req: api::RunTurnRequest,
        events: mpsc::UnboundedSender<api::TurnEvent>,
        cancel: CancellationToken,
    ) -> Result<(), CoreError> {
        let (agent, key) = validate_turn(&req)?;
        let session = self.store.session(&agent, &key, true).await?.ok_or(CoreError::NoSession(key.clone()))?;
        let _guard = self.enter(&session.session_id, &cancel).await;
        let started = Instant::now();
        self.metrics.turns_in_flight.inc();
        let outcome = self.turn(&session, req, &events, &cancel).await;
        self.metrics.turns_in_flight.dec();
        let label = match &outcome {
            Ok(Some(api::turn_event::Event::Failed(f))) => f.reason.clone(),
            Ok(_) => "completed".into(),
            Err(_) => "error".into(),
        };
        self.metrics.turn_finished(&label, started.elapsed());
        if let Some(last) = outcome? {
            let _ = events.send(event(last));
        }
        Ok(())
    }

    /// The turn after validation; returns the terminal event.
    async fn turn(
        &self,
        session: &Session,
        req: api::RunTurnRequest,
        events: &mpsc::UnboundedSender<api::TurnEvent>,
        cancel: &CancellationToken,
    ) -> Result<Option<api::turn_event::Event>, CoreError> {
        use api::turn_event::Event as E;
        // A client that went away stops reading; the cancel token tells the work.
        let send = |e: E| {
            let _ = events.send(event(e));
        };
        // Admission: the user message is durable before anything else runs.
        let turn_id = uuid::Uuid::new_v4().simple().to_string();
        let user =
            NewEntry { turn_id: turn_id.clone(), entry: Entry::Message(text_message(Role::User, req.message.clone())) };
        let admitted = self.store.append(&session.session_id, vec![user]).await?;
        send(E::Admitted(api::Admitted {
            session_id: session.session_id.clone(),
            turn_id: turn_id.clone(),
            entry_id: admitted[0].id.clone(),
        }));
        let info = self.engine.info();
        send(E::EngineSelected(api::EngineSelected { engine_id: info.id.clone(), reason: "default".into() }));

        let system = req.system_prompt.as_deref();
        let budget = self.token_budget(system);
        let sink = |e: api::compaction_event::Event| {
            let mapped = match e {
                api::compaction_event::Event::Started(s) => E::CompactionStarted(s),
                api::compaction_event::Event::Progress(p) => E::CompactionProgress(p),
                api::compaction_event::Event::Done(d) => E::CompactionDone(d),
            };
            let _ = events.send(event(mapped));
        };

        // Proactive compaction: tokens ≥ window − min(20000, 25 % of window).
        let window = self.config.models.context_window;
        let threshold = window - (window / 4).min(20_000);
        // Read once; re-read only after something appended a compaction.
        let mut visible = self.visible(&session.session_id).await?;
        if visible.tokens() >= threshold && !info.owns_compaction {
            let r = self.compact(session, "proactive", Some(budget), None, &sink, cancel).await;
            if let Err(e) = r {
                if cancel.is_cancelled() {
                    return Ok(Some(failed("aborted", "The turn was aborted.")));
                }
                send(E::Warning(api::Warning { message: format!("proactive compaction failed: {e}") }));
            }
            visible = self.visible(&session.session_id).await?;
        }

        let (mut overflow_compactions, mut timeout_compactions, mut truncated) = (0, 0, false);
        for attempt in 1.. {
            if cancel.is_cancelled() {
                return Ok(Some(failed("aborted", "The turn was aborted.")));
            }
            let assembled = match self
                .engine
                .assemble(pb::AssembleRequest {
                    session_id: session.session_id.clone(),
                    session_key: Some(session.session_key.clone()),
                    messages: visible.render(),
                    token_budget: Some(budget),
                    prompt: Some(req.message.clone()),
                    model: Some(self.provider.model().to_owned()),
                    ..Default::default()
                })
                .await
            {
                Ok(a) => a,
                Err(e) => {
                    return Ok(Some(failed(
                        "engine_error",
                        format!("The context engine could not assemble the prompt: {e}."),
                    )));
                }
            };
            let mut messages = assembled.messages;
            if truncated {
                truncate_tool_results(&mut messages);
            }
            let estimated = estimate::messages_tokens(&messages);
            send(E::Assembled(api::Assembled {
                messages: messages.len() as u32,
                estimated_tokens: estimated,
                token_budget: budget,
                attempt,
            }));

            // Pre-prompt check: a prompt over budget is an overflow without
            // spending a model call.
            let precheck = !info.owns_compaction
                || assembled.prompt_authority == pb::PromptAuthority::PreassemblyMayOverflow as i32;
            let result = if precheck && estimated > budget {
                Err(ModelError::ContextOverflow(format!("the prompt is {estimated} tokens, the budget {budget}")))
            } else {
                self.call_model(system, messages, events, cancel).await
            };
            match result {
                Ok(reply) => {
                    return self.finalize(session, &turn_id, reply, visible.render(), events).await.map(Some);
                }
                Err(ModelError::Cancelled) => return Ok(Some(failed("aborted", "The turn was aborted."))),
                Err(ModelError::ContextOverflow(why)) => {
                    if overflow_compactions < MAX_OVERFLOW_COMPACTIONS {
                        overflow_compactions += 1;
                        if let Err(e) = self.compact(session, "overflow", Some(budget), None, &sink, cancel).await {
                            if cancel.is_cancelled() {
                                return Ok(Some(failed("aborted", "The turn was aborted.")));
                            }
                            send(E::Warning(api::Warning { message: format!("overflow compaction failed: {e}") }));
                        }
                        visible = self.visible(&session.session_id).await?;
                    } else if !truncated {
                        truncated = true;
                        send(E::Warning(api::Warning {
                            message: "still over the context window: truncating large tool results for this turn"
                                .into(),
                        }));
                    } else {
                        return Ok(Some(failed(
                            "context_overflow",
                            format!(
                                "The conversation does not fit the model's context window even after {MAX_OVERFLOW_COMPACTIONS} compactions ({why}). Run /compact with instructions to summarise harder, or /new to start a fresh session."
                            ),
                        )));
                    }
                }
                Err(ModelError::Timeout(after)) => {
                    let share = estimated as f64 / budget.max(1) as f64;
                    if timeout_compactions < MAX_TIMEOUT_COMPACTIONS && share > TIMEOUT_COMPACTION_SHARE {
                        timeout_compactions += 1;
                        if let Err(e) = self.compact(session, "timeout", Some(budget), None, &sink, cancel).await {
                            send(E::Warning(api::Warning { message: format!("timeout compaction failed: {e}") }));
                        }
                        visible = self.visible(&session.session_id).await?;
                    } else {
                        return Ok(Some(failed(
                            "model_timeout",
                            format!(
                                "The model did not answer within {after:?}. Try again, or /compact to make the prompt smaller."
                            ),
                        )));
                    }
                }
                Err(e) => {
                    return Ok(Some(failed(
                        "model_error",
                        format!("The model call failed: {e}. Check the gateway's model settings and try again."),
                    )));
                }
            }
        }
        unreachable!("the attempt loop returns")
    }

    async fn call_model(
        &self,
        system: Option<&str>,
        messages: Vec<AgentMessage>,
        events: &mpsc::UnboundedSender<api::TurnEvent>,
        cancel: &CancellationToken,
    ) -> Result<crate::provider::ChatResponse, ModelError> {
        let (dtx, mut drx) = mpsc::channel::<String>(64);
        let events = events.clone();
        let forward = tokio::spawn(async move {
            while let Some(text) = drx.recv().await {
                let _ = events.send(event(api::turn_event::Event::ModelDelta(api::ModelDelta { text })));
            }
        });
        let req = ChatRequest {
            system: system.map(str::to_owned),
            messages,
            max_tokens: self.config.models.max_output_tokens,
        };
        let r = self.provider.complete(req, Some(dtx), cancel).await;
        let _ = forward.await;
        r
    }

    /// Appends the reply and runs after-turn with the prompt's history plus
    /// the reply; returns the Completed event.
    async fn finalize(
        &self,
        session: &Session,
        turn_id: &str,
        reply: crate::provider::ChatResponse,
        mut history: Vec<AgentMessage>,
        events: &mpsc::UnboundedSender<api::TurnEvent>,
    ) -> Result<api::turn_event::Event, CoreError> {
        let mut m = text_message(Role::Assistant, reply.text.clone());
        m.usage = Some(reply.usage);
        m.metadata.insert("model".into(), self.provider.model().into());
        let stored = self
            .store
            .append(&session.session_id, vec![NewEntry { turn_id: turn_id.into(), entry: Entry::Message(m) }])
            .await?;
        // Everything before the admitted user message existed before the prompt.
        let pre_prompt = history.len().saturating_sub(1) as u64;
        if let Some(Entry::Message(reply_message)) = stored[0].entry.clone() {
            history.push(reply_message);
        }
        let after = pb::AfterTurnRequest {
            session_id: session.session_id.clone(),
            session_key: Some(session.session_key.clone()),
            session_file: session.session_key.clone(),
            pre_prompt_message_count: pre_prompt,
            messages: history,
            ..Default::default()
        };
        if let Err(e) = self.engine.after_turn(after).await {
            let _ = events.send(event(api::turn_event::Event::Warning(api::Warning {
                message: format!("after-turn failed: {e}"),
            })));
        }
        Ok(api::turn_event::Event::Completed(api::Completed {
            entry_id: stored[0].id.clone(),
            text: reply.text,
            usage: Some(reply.usage),
        }))
    }

    /// Manual compaction (`/compact`): target=threshold, force.
    pub async fn compact_session(
        &self,
        req: api::CompactSessionRequest,
        sink: &CompactionSink<'_>,
        cancel: CancellationToken,
    ) -> Result<(), CoreError> {
        let (agent, key) = session_ref(req.session.as_ref())?;
        let session = self.store.session(&agent, &key, false).await?.ok_or(CoreError::NoSession(key))?;
        let _guard = self.enter(&session.session_id, &cancel).await;
        self.compact(&session, "manual", None, req.custom_instructions, sink, &cancel).await.map(|_| ())
    }

    /// Runs the engine's compaction (or the built-in one it delegates to) and
    /// appends the compaction entry. The caller holds the session lock.
    async fn compact(
        &self,
        session: &Session,
        trigger: &str,
        budget: Option<u64>,
        instructions: Option<String>,
        sink: &CompactionSink<'_>,
        cancel: &CancellationToken,
    ) -> Result<api::CompactionDone, CoreError> {
        use api::compaction_event::Event as C;
        let started = Instant::now();
        let visible = self.visible(&session.session_id).await?;
        let tokens_before = visible.tokens();
        sink(C::Started(api::CompactionStarted { trigger: trigger.into(), tokens_before }));
        let target = if budget.is_some() { pb::CompactionTarget::Budget } else { pb::CompactionTarget::Threshold };
        let request = pb::CompactRequest {
            session_id: session.session_id.clone(),
            session_key: session.session_key.clone(),
            agent_id: Some(session.agent_id.clone()),
            token_budget: budget,
            force: true,
            current_token_count: Some(tokens_before),
            compaction_target: target as i32,
            custom_instructions: instructions.clone(),
            ..Default::default()
        };
        let result = match self.engine.compact(request).await {
            Ok(CompactReply::DelegateToHost(d)) => {
                let instructions = d.custom_instructions.or(instructions);
                self.builtin(&visible, budget, instructions, sink, cancel).await
            }
            Ok(CompactReply::Done(r)) => Ok(engine_outcome(r, tokens_before)),
            Err(EngineCallError::Cancelled) => Err(CompactionError::Cancelled),
            Err(e) => Err(CompactionError::Model(ModelError::Unavailable(e.to_string()))),
        };
        let done = match result {
            Ok(Outcome::Compacted { summary, first_kept_entry_id, tokens_before, tokens_after }) => {
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
                    trigger,
                    "compacted",
                    started.elapsed(),
                    Some((tokens_before, tokens_after)),
                );
                api::CompactionDone {
                    compacted: true,
                    reason: None,
                    tokens_before,
                    tokens_after,
                    entry_id: Some(stored[0].id.clone()),
                    summary_chars: summary.chars().count() as u32,
                }
            }
            Ok(Outcome::Kept { reason, tokens_before }) => {
                self.metrics.compaction_finished(trigger, "kept", started.elapsed(), None);
                api::CompactionDone {
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
                self.metrics.compaction_finished(trigger, outcome, started.elapsed(), None);
                return Err(err);
            }
        };
        sink(C::Done(done.clone()));
        Ok(done)
    }

    async fn builtin(
        &self,
        visible: &Visible,
        budget: Option<u64>,
        instructions: Option<String>,
        sink: &CompactionSink<'_>,
        cancel: &CancellationToken,
    ) -> Result<Outcome, CompactionError> {
        let c = &self.config.agents.defaults.compaction;
        let settings = compaction::Settings {
            keep_recent_tokens: c.keep_recent_tokens,
            recent_turns_preserve: c.recent_turns_preserve,
            chunk_tokens: (self.config.models.context_window / 2).clamp(1_000, 30_000),
            request_timeout: self.config.compaction_timeout(),
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
            sink(api::compaction_event::Event::Progress(api::CompactionProgress {
                stage: "summarising".into(),
                done,
                total,
                message,
            }));
        };
        compaction::compact(input, self.summarizer.as_ref(), &settings, cancel, &mut progress).await
    }

    // --- sessions -------------------------------------------------------

    pub async fn session_info(&self, s: &Session) -> Result<api::SessionInfo, CoreError> {
        let branch = self.store.branch(&s.session_id).await?;
        let compactions = branch.iter().filter(|e| matches!(e.entry, Some(Entry::Compaction(_)))).count() as u32;
        Ok(api::SessionInfo {
            agent_id: s.agent_id.clone(),
            session_key: s.session_key.clone(),
            session_id: s.session_id.clone(),
            state: s.state.clone(),
            created_at_unix_ms: s.created_at_ms,
            entries: branch.len() as u32,
            compactions,
            visible_tokens: transcript::visible(&branch).tokens(),
        })
    }

    pub async fn session(&self, r: Option<&api::SessionRef>) -> Result<Session, CoreError> {
        let (agent, key) = session_ref(r)?;
        self.store.session(&agent, &key, false).await?.ok_or(CoreError::NoSession(key))
    }
}

/// An engine's own compaction result as an outcome.
fn engine_outcome(r: pb::CompactResult, tokens_before: u64) -> Outcome {
    match (r.ok && r.compacted, r.summary, r.first_kept_entry_id) {
        (true, Some(summary), Some(first)) => Outcome::Compacted {
            summary,
            first_kept_entry_id: first,
            tokens_before: if r.tokens_before > 0 { r.tokens_before } else { tokens_before },
            tokens_after: r.tokens_after.unwrap_or(tokens_before),
        },
        _ => Outcome::Kept { reason: r.reason.unwrap_or_else(|| "the engine did not compact".into()), tokens_before },
    }
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
