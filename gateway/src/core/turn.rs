//! A managed turn: admission, lease, proactive compaction, assemble,
//! pre-prompt check, model call, overflow and timeout recovery, finalize.

use super::*;

impl Core {
    // --- turns -----------------------------------------------------------

    /// Runs one managed turn; every event goes to `events`. Errors are
    /// returned only before admission; after it, the outcome is an event.
    pub async fn run_turn(
        self: &Arc<Self>,
        req: api::RunTurnRequest,
        events: mpsc::UnboundedSender<api::TurnEvent>,
        cancel: CancellationToken,
    ) -> Result<(), CoreError> {
        let (agent, key) = validate_turn(&req)?;
        let session = self.store.session(&agent, &key, true).await?.ok_or(CoreError::NoSession(key.clone()))?;
        let _guard = self.enter(&session.session_id, &cancel).await;
        let started = std::time::Instant::now();
        self.metrics.turns_in_flight.inc();
        // One span per turn: every engine call and model request nests in it.
        let span = tracing::info_span!("turn", agent = %agent, session = %session.session_id, key = %key);
        let outcome = tracing::Instrument::instrument(self.turn(&session, req, &events, &cancel), span).await;
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
    pub(super) async fn turn(
        self: &Arc<Self>,
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
        let admitted_id = admitted[0].id.clone();
        send(E::Admitted(api::Admitted {
            session_id: session.session_id.clone(),
            turn_id: turn_id.clone(),
            entry_id: admitted_id.clone(),
        }));

        // Engine selection: the lease is pinned from here on.
        let lease = self.lease("agent-run");
        let reason = match &lease.degraded {
            Some(w) => {
                send(E::Warning(api::Warning { message: w.clone() }));
                "degraded".to_owned()
            }
            None if lease.remote => "configured".to_owned(),
            None => "default".to_owned(),
        };
        send(E::EngineSelected(api::EngineSelected { engine_id: lease.info.id.clone(), reason }));
        let call = Call::new(cancel.clone());

        let system = req.system_prompt.as_deref();
        let budget = self.token_budget(system);
        // Durable engines get earlier turns first; a turn the engine has not
        // accepted blocks this session only.
        if lease.remote && crate::engines::durable(&lease.info) {
            let waiting = self.drain_commits(&session.session_id, cancel).await?;
            if waiting > 0 {
                return Ok(Some(failed(
                    "engine_backlog",
                    format!(
                        "The context engine \"{}\" has not accepted {waiting} earlier turn(s) of this session yet; they are retried in the background. Try again shortly.",
                        lease.key
                    ),
                )));
            }
        }
        self.bootstrap_if_new(&lease, session, &admitted_id, budget, &call).await;
        let sink = |e: api::compaction_event::Event| {
            let mapped = match e {
                api::compaction_event::Event::Started(s) => E::CompactionStarted(s),
                api::compaction_event::Event::Progress(p) => E::CompactionProgress(p),
                api::compaction_event::Event::Done(d) => E::CompactionDone(d),
            };
            let _ = events.send(event(mapped));
        };

        // Proactive compaction: tokens ≥ window − min(20000, 25 % of window).
        // Engines that own compaction are judged by what they assemble.
        let window = self.config.models.context_window;
        let threshold = window - (window / 4).min(20_000);
        let mut visible = self.visible(&session.session_id).await?;
        let mut proactive_done = false;
        if !lease.info.owns_compaction && visible.tokens() >= threshold {
            proactive_done = true;
            if let Err(e) = self.compact(&lease, session, "proactive", Some(budget), None, &sink, cancel).await {
                if cancel.is_cancelled() {
                    return Ok(Some(aborted()));
                }
                send(E::Warning(api::Warning { message: format!("proactive compaction failed: {e}") }));
            }
            visible = self.visible(&session.session_id).await?;
        }

        let (mut overflow_compactions, mut timeout_compactions, mut truncated) = (0, 0, false);
        let mut degraded_reason = None;
        for attempt in 1.. {
            if cancel.is_cancelled() {
                return Ok(Some(aborted()));
            }
            let rendered = visible.render();
            let pre_assembly_tokens = estimate::messages_tokens(&rendered);
            let grant = self.grant(&lease, session, Some(&admitted_id), None);
            let assembled = lease
                .engine
                .assemble(
                    pb::AssembleRequest {
                        session_id: session.session_id.clone(),
                        session_key: Some(session.session_key.clone()),
                        messages: rendered.clone(),
                        token_budget: Some(budget),
                        prompt: Some(req.message.clone()),
                        model: Some(self.provider.model().to_owned()),
                        runtime_settings: Some(self.runtime_settings(&lease, budget, degraded_reason)),
                        runtime_context: Some(self.runtime_context(session, budget, pre_assembly_tokens)),
                        host: grant.as_ref().map(|g| g.access.clone()),
                        ..Default::default()
                    },
                    &call,
                )
                .await;
            drop(grant);
            let assembled = match assembled {
                Ok(a) => a,
                Err(EngineCallError::Cancelled) => return Ok(Some(aborted())),
                Err(e) => {
                    return Ok(Some(failed(
                        "engine_error",
                        format!("The context engine could not assemble the prompt: {e}."),
                    )));
                }
            };
            let mut messages = assembled.messages;
            if let Some(addition) = assembled.system_prompt_addition.as_deref().filter(|a| !a.trim().is_empty()) {
                messages.insert(0, text_message(Role::System, addition.to_owned()));
            }
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
            if lease.info.owns_compaction && !proactive_done && estimated >= threshold {
                proactive_done = true;
                if let Err(e) = self.compact(&lease, session, "proactive", Some(budget), None, &sink, cancel).await {
                    send(E::Warning(api::Warning { message: format!("proactive compaction failed: {e}") }));
                }
                visible = self.visible(&session.session_id).await?;
                continue;
            }

            // Pre-prompt check: a prompt over budget is an overflow without
            // spending a model call. Engines owning compaction skip it unless
            // they say the pre-assembly history may overflow.
            let may_overflow = assembled.prompt_authority == pb::PromptAuthority::PreassemblyMayOverflow as i32;
            let checked = if may_overflow { estimated.max(pre_assembly_tokens) } else { estimated };
            let precheck = !lease.info.owns_compaction || may_overflow;
            let result = if precheck && checked > budget {
                Err(ModelError::ContextOverflow(format!("the prompt is {checked} tokens, the budget {budget}")))
            } else {
                self.call_model(system, messages, events, cancel).await
            };
            match result {
                Ok(reply) => {
                    let done = self
                        .finalize(&lease, session, &turn_id, &admitted[0], reply, rendered, budget, events, cancel)
                        .await?;
                    self.schedule_background_maintenance(lease, session.clone(), budget);
                    return Ok(Some(done));
                }
                Err(ModelError::Cancelled) => return Ok(Some(aborted())),
                Err(ModelError::ContextOverflow(why)) => {
                    degraded_reason = Some(pb::ReasonCode::ContextOverflow);
                    if overflow_compactions < MAX_OVERFLOW_COMPACTIONS {
                        overflow_compactions += 1;
                        // A failing engine is quarantined inside; the next
                        // attempts then use built-in compaction.
                        if let Err(e) =
                            self.compact(&lease, session, "overflow", Some(budget), None, &sink, cancel).await
                        {
                            if cancel.is_cancelled() {
                                return Ok(Some(aborted()));
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
                        degraded_reason = Some(pb::ReasonCode::ProviderTimeout);
                        if let Err(e) =
                            self.compact(&lease, session, "timeout", Some(budget), None, &sink, cancel).await
                        {
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

    pub(super) async fn call_model(
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

    /// Appends the reply and tells the engine (after-turn, or ingest for
    /// engines without it); returns the Completed event.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn finalize(
        &self,
        lease: &Lease,
        session: &Session,
        turn_id: &str,
        admitted: &pb::TranscriptEntry,
        reply: crate::provider::ChatResponse,
        mut history: Vec<AgentMessage>,
        budget: u64,
        events: &mpsc::UnboundedSender<api::TurnEvent>,
        cancel: &CancellationToken,
    ) -> Result<api::turn_event::Event, CoreError> {
        let mut m = text_message(Role::Assistant, reply.text.clone());
        m.usage = Some(reply.usage);
        m.metadata.insert("model".into(), self.provider.model().into());
        let entry = NewEntry { turn_id: turn_id.into(), entry: Entry::Message(m) };
        if lease.remote && crate::engines::durable(&lease.info) {
            // Durable: the reply and the turn's commit are stored together,
            // then delivered; the engine gets no after-turn or ingest for it.
            let draft = self.commit_draft(lease, session, turn_id, admitted, history.len());
            let stored = self.store.append_with_commit(&session.session_id, vec![entry], draft).await?;
            let waiting = self.drain_commits(&session.session_id, cancel).await?;
            if waiting > 0 {
                let _ = events.send(event(api::turn_event::Event::Warning(api::Warning {
                    message: "the context engine has not accepted this turn yet; it stays queued and is retried".into(),
                })));
            }
            if lease.info.turn_maintenance_mode != pb::TurnMaintenanceMode::Background as i32 {
                self.maintain(lease, session, pb::MaintainReason::Turn, budget, &Call::new(cancel.clone())).await;
            }
            return Ok(api::turn_event::Event::Completed(api::Completed {
                entry_id: stored[0].id.clone(),
                text: reply.text,
                usage: Some(reply.usage),
            }));
        }
        let stored = self.store.append(&session.session_id, vec![entry]).await?;
        // Everything before the admitted user message existed before the prompt.
        let pre_prompt = history.len().saturating_sub(1) as u64;
        if let Some(Entry::Message(reply_message)) = stored[0].entry.clone() {
            history.push(reply_message);
        }
        let new_messages: Vec<AgentMessage> = history[pre_prompt as usize..].to_vec();
        let call = Call::new(cancel.clone());
        let grant = self.grant(lease, session, None, None);
        let tokens = estimate::messages_tokens(&history);
        let after = pb::AfterTurnRequest {
            session_id: session.session_id.clone(),
            session_key: Some(session.session_key.clone()),
            session_target: Some(target(session)),
            session_file: session.session_key.clone(),
            pre_prompt_message_count: pre_prompt,
            messages: history,
            token_budget: Some(budget),
            runtime_settings: Some(self.runtime_settings(lease, budget, None)),
            runtime_context: Some(self.runtime_context(session, budget, tokens)),
            host: grant.as_ref().map(|g| g.access.clone()),
            ..Default::default()
        };
        let warn = |e: EngineCallError| {
            let _ = events.send(event(api::turn_event::Event::Warning(api::Warning {
                message: format!("after-turn failed: {e}"),
            })));
        };
        match lease.engine.after_turn(after, &call).await {
            Ok(_) | Err(EngineCallError::Cancelled) => {}
            // Without after-turn, the engine learns the turn through Ingest.
            Err(EngineCallError::Unimplemented(_)) => {
                for message in new_messages {
                    let req = pb::IngestRequest {
                        session_id: session.session_id.clone(),
                        session_key: Some(session.session_key.clone()),
                        message: Some(message),
                        is_heartbeat: false,
                    };
                    if let Err(e) = lease.engine.ingest(req, &call).await {
                        warn(e);
                        break;
                    }
                }
            }
            Err(e) => warn(e),
        }
        if lease.info.turn_maintenance_mode != pb::TurnMaintenanceMode::Background as i32 {
            self.maintain(lease, session, pb::MaintainReason::Turn, budget, &call).await;
        }
        Ok(api::turn_event::Event::Completed(api::Completed {
            entry_id: stored[0].id.clone(),
            text: reply.text,
            usage: Some(reply.usage),
        }))
    }
}
