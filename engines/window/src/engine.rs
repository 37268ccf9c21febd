//! The window engine: the last N turns verbatim plus a rolling summary of
//! everything older. It owns compaction.

use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use ctxgate_engine_sdk::pb::{self, AgentMessage, content_part::Part};
use ctxgate_engine_sdk::proto::Method;
use ctxgate_engine_sdk::{
    CallContext, CompactOutcome, ContextEngine, EngineError, Progress, READ_TRANSCRIPT, estimate,
};

use crate::retrieval;
use crate::store::{self, Store, Summary};
use crate::summary::{self, Source};
use crate::turns;

/// Tuning knobs (command-line flags of the binary).
#[derive(Debug, Clone)]
pub struct Config {
    /// Turns kept verbatim after a compaction.
    pub keep_turns: usize,
    /// A turn's end (AfterTurn, CommitTurn) compacts once this many turns
    /// beyond `keep_turns` are unsummarised.
    pub auto_compact_after: usize,
    /// Maintain elides older tool results larger than this.
    pub max_tool_result_bytes: usize,
    /// Messages per summarisation step (one progress event each).
    pub chunk_messages: usize,
}

impl Default for Config {
    fn default() -> Self {
        Self { keep_turns: 4, auto_compact_after: 4, max_tool_result_bytes: 4096, chunk_messages: 40 }
    }
}

pub struct WindowEngine {
    store: Store,
    config: Config,
}

fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

/// The summary as the message the model sees first.
fn summary_message(session_id: &str, s: &Summary) -> AgentMessage {
    AgentMessage {
        id: format!("window-summary:{session_id}:{}", s.covered_seq),
        role: pb::Role::User as i32,
        content: vec![pb::ContentPart { part: Some(Part::Text(s.text.clone())) }],
        metadata: [
            ("ctxgate.window".to_owned(), "summary".to_owned()),
            ("ctxgate.kind".to_owned(), "summary".to_owned()),
        ]
        .into(),
        ..Default::default()
    }
}

impl WindowEngine {
    pub fn open(state_dir: &Path, config: Config) -> Result<Self, EngineError> {
        Ok(Self { store: Store::open(state_dir)?, config })
    }

    /// Imports the session's visible history from the host when the engine
    /// has never seen the session and the grant allows reading it.
    async fn import_if_new(
        &self,
        ctx: &CallContext,
        session_id: &str,
        key: Option<&str>,
    ) -> Result<Option<u64>, EngineError> {
        let sid = session_id.to_owned();
        if self.store.read(move |c| store::session_known(c, &sid)).await? {
            return Ok(None);
        }
        let Some(host) = ctx.host().filter(|h| h.allows(READ_TRANSCRIPT) && h.session_id() == session_id) else {
            return Ok(None);
        };
        let messages: Vec<AgentMessage> = host
            .read_transcript(ctx, true)
            .await?
            .into_iter()
            .filter_map(|e| match e.entry {
                Some(pb::transcript_entry::Entry::Message(m)) => Some(m),
                _ => None,
            })
            .collect();
        ctxgate_engine_sdk::validate::messages(&messages, "host.transcript")?;
        let n = self.ingest_messages(session_id, key, messages).await?;
        Ok(Some(n))
    }

    async fn ingest_messages(
        &self,
        session_id: &str,
        key: Option<&str>,
        messages: Vec<AgentMessage>,
    ) -> Result<u64, EngineError> {
        let (sid, key) = (session_id.to_owned(), key.map(str::to_owned));
        self.store
            .write(move |c| {
                store::touch_session(c, &sid, key.as_deref(), None)?;
                store::insert_messages(c, &sid, &messages)
            })
            .await
    }

    /// Whether Maintain has an oversized tool result to look at.
    async fn maintenance_due(&self, session_id: &str) -> Result<bool, EngineError> {
        let (sid, limit) = (session_id.to_owned(), self.config.max_tool_result_bytes);
        self.store.read(move |c| store::maintenance_due(c, &sid, limit)).await
    }

    /// What a turn's answer says of Maintain, so most turns skip that call.
    /// The turn is stored already: a failed check leaves the hint unset
    /// (the gateway then asks, as always) rather than fail the turn.
    async fn maintenance_hint(&self, session_id: &str) -> Option<bool> {
        match self.maintenance_due(session_id).await {
            Ok(due) => Some(due),
            Err(e) => {
                tracing::warn!(session = session_id, error = %e, "maintenance check failed; Maintain is asked");
                None
            }
        }
    }

    /// Owning compaction means compacting on our own schedule: after a turn
    /// (AfterTurn or CommitTurn), once enough turns are unsummarised. Best
    /// effort: the turn is already stored; a failure is retried next turn.
    async fn compact_on_schedule(&self, ctx: &CallContext, session_id: &str, key: Option<&str>) {
        if let Err(e) = self.compact_if_due(ctx, session_id, key).await {
            tracing::warn!(session = session_id, error = %e, "scheduled compaction failed; retried after the next turn");
        }
    }

    async fn compact_if_due(&self, ctx: &CallContext, session_id: &str, key: Option<&str>) -> Result<(), EngineError> {
        // Most turns are below the threshold: count their user messages
        // instead of decoding them (each starts a turn, and the first
        // message may start one more, so under the threshold means fewer
        // user messages than it).
        let sid = session_id.to_owned();
        let users =
            self.store.read(move |c| store::user_messages_after(c, &sid, store::summary(c, &sid)?.covered_seq)).await?;
        if users < (self.config.keep_turns + self.config.auto_compact_after) as u64 {
            return Ok(());
        }
        let auto = pb::CompactRequest {
            session_id: session_id.to_owned(),
            session_key: key.unwrap_or_default().to_owned(),
            force: false,
            compaction_target: pb::CompactionTarget::Threshold as i32,
            ..Default::default()
        };
        self.compact_session(ctx, session_id, &auto, None).await.map(drop)
    }

    /// Folds everything older than the kept tail into the summary.
    async fn compact_session(
        &self,
        ctx: &CallContext,
        session_id: &str,
        req: &pb::CompactRequest,
        progress: Option<&Progress>,
    ) -> Result<pb::CompactResult, EngineError> {
        let sid = session_id.to_owned();
        let (prev, pending) = self
            .store
            .read(move |c| {
                let s = store::summary(c, &sid)?;
                let pending = store::messages_after(c, &sid, s.covered_seq)?;
                Ok((s, pending))
            })
            .await?;
        let messages: Vec<AgentMessage> = pending.iter().map(|s| s.message.clone()).collect();
        let summary_tokens = if prev.text.is_empty() { 0 } else { estimate::text_tokens(&prev.text) };
        let tokens_before = summary_tokens + estimate::messages_tokens(&messages);
        let not_compacted = |reason: &str| pb::CompactResult {
            ok: true,
            compacted: false,
            reason: Some(reason.to_owned()),
            tokens_before,
            ..Default::default()
        };

        let mut keep = self.config.keep_turns.max(1);
        if req.compaction_target != pb::CompactionTarget::Threshold as i32
            && let Some(budget) = req.token_budget
        {
            // Target the budget: keep fewer turns while the tail alone is over it.
            while keep > 1 && estimate::messages_tokens(&messages[turns::keep_last_turns(&messages, keep)..]) > budget {
                keep -= 1;
            }
        }
        let cut = turns::keep_last_turns(&messages, keep);
        if cut == 0 {
            return Ok(not_compacted("nothing older than the kept turns"));
        }
        let unsummarised_turns = turns::turn_starts(&messages).len();
        if !req.force && unsummarised_turns <= self.config.keep_turns + self.config.auto_compact_after {
            return Ok(not_compacted("below the compaction threshold"));
        }

        let older = &messages[..cut];
        let chunks: Vec<&[AgentMessage]> = older.chunks(self.config.chunk_messages.max(1)).collect();
        let total = chunks.len() as u64;
        let mut text = prev.text.clone();
        let mut source = Source::Extractive;
        for (i, chunk) in chunks.iter().enumerate() {
            ctx.check()?;
            if let Some(p) = progress {
                p.report("summarising", i as u64, total, format!("summarising {} messages", chunk.len())).await?;
            }
            let (next, s) = summary::fold(ctx, &text, chunk, req.custom_instructions.as_deref()).await?;
            text = next;
            if s == Source::Llm {
                source = Source::Llm;
            }
        }
        ctx.check()?;
        let next =
            Summary { text, covered_seq: pending[cut - 1].seq, first_kept_id: messages.get(cut).map(|m| m.id.clone()) };
        let (sid, saved) = (session_id.to_owned(), next.clone());
        self.store.write(move |c| store::set_summary(c, &sid, &saved)).await?;
        if let Some(p) = progress {
            p.report("summarising", total, total, "summary saved").await?;
        }
        let tokens_after = estimate::text_tokens(&next.text) + estimate::messages_tokens(&messages[cut..]);
        Ok(pb::CompactResult {
            ok: true,
            compacted: true,
            reason: None,
            summary: Some(next.text),
            first_kept_entry_id: next.first_kept_id,
            tokens_before,
            tokens_after: Some(tokens_after),
            details_json: Some(
                serde_json::json!({"summarised_messages": cut, "kept_turns": keep, "source": source.as_str()})
                    .to_string(),
            ),
            ..Default::default()
        })
    }
}

impl ContextEngine for WindowEngine {
    async fn get_info(&self, _ctx: &CallContext) -> Result<pb::EngineInfo, EngineError> {
        Ok(pb::EngineInfo {
            id: "window".into(),
            name: "Window engine".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            contract_version: ctxgate_engine_sdk::proto::CONTRACT_VERSION.into(),
            owns_compaction: true,
            turn_maintenance_mode: pb::TurnMaintenanceMode::Background as i32,
            accepted_host_params: None,
            transcript_semantics: Some(pb::TranscriptSemantics {
                current_turn_fence: pb::CurrentTurnFence::BeforeCurrentTurnEntryV1 as i32,
                turn_advancement_idempotency: pb::TurnAdvancementIdempotency::AtomicIdempotentV1 as i32,
            }),
            host_requirements: vec![],
            // It implements every method of the contract.
            implemented_methods: Method::ALL.iter().map(|m| m.name().to_owned()).collect(),
            // It holds every session's history: Assemble sends what is new.
            history_delivery: pb::HistoryDelivery::Delta as i32,
            // Each replica keeps its own sessions: a session's calls go to one.
            replica_affinity: pb::ReplicaAffinity::Session as i32,
            tools: retrieval::tools(),
        })
    }

    async fn bootstrap(
        &self,
        ctx: &CallContext,
        req: pb::BootstrapRequest,
    ) -> Result<pb::BootstrapResult, EngineError> {
        match self.import_if_new(ctx, &req.session_id, req.session_key.as_deref()).await? {
            Some(n) => Ok(pb::BootstrapResult { bootstrapped: true, imported_messages: Some(n), reason: None }),
            None => Ok(pb::BootstrapResult {
                bootstrapped: false,
                imported_messages: None,
                reason: Some("session already known, or no transcript access was granted".into()),
            }),
        }
    }

    async fn ingest(&self, _ctx: &CallContext, req: pb::IngestRequest) -> Result<pb::IngestResult, EngineError> {
        let message = req.message.into_iter().collect();
        let n = self.ingest_messages(&req.session_id, req.session_key.as_deref(), message).await?;
        Ok(pb::IngestResult { ingested: n > 0 })
    }

    async fn ingest_batch(
        &self,
        _ctx: &CallContext,
        req: pb::IngestBatchRequest,
    ) -> Result<pb::IngestBatchResult, EngineError> {
        let n = self.ingest_messages(&req.session_id, req.session_key.as_deref(), req.messages).await?;
        Ok(pb::IngestBatchResult { ingested_count: n })
    }

    async fn assemble(&self, _ctx: &CallContext, req: pb::AssembleRequest) -> Result<pb::AssembleResult, EngineError> {
        let (sid, cursor, budget, messages) =
            (req.session_id.clone(), req.cursor.clone(), req.token_budget, req.messages);
        // DELTA (a cursor): the summary + the newest turns it holds
        // unsummarised + the request's new messages; with a budget, only
        // the turns that can fit it are read, so the work is bounded by the
        // budget, not the session's age. FULL: the request's history minus
        // what the summary covers.
        let (head, own, new) = self
            .store
            .read(move |c| {
                let s = store::summary(c, &sid)?;
                let head = (!s.text.is_empty()).then(|| summary_message(&sid, &s));
                let Some(k) = cursor else {
                    let covered = store::covered_ids(c, &sid, s.covered_seq)?;
                    let new = messages.into_iter().filter(|m| !covered.contains(&m.id)).collect();
                    return Ok(Ok((head, Vec::new(), new)));
                };
                let (count, last) = store::held(c, &sid)?;
                if !k.message_id.is_empty() && (count < k.message_count || !store::has_message(c, &sid, &k.message_id)?)
                {
                    let held = last.map(|(id, seq)| pb::HistoryCursor {
                        message_id: id,
                        seq: seq as u64,
                        message_count: count,
                        tokens: 0,
                    });
                    return Ok(Err(EngineError::HistoryGap { held }));
                }
                // A message sent again that the engine already holds (or
                // has summarised) is not counted twice.
                let mut new = Vec::with_capacity(messages.len());
                for m in messages {
                    if !store::has_message(c, &sid, &m.id)? {
                        new.push(m);
                    }
                }
                let own = match budget {
                    Some(budget) => {
                        let room = budget
                            .saturating_sub(head.as_ref().map_or(0, estimate::message_tokens))
                            .saturating_sub(estimate::messages_tokens(&new));
                        store::newest_turns_after(c, &sid, s.covered_seq, room)?
                    }
                    None => store::messages_after(c, &sid, s.covered_seq)?,
                };
                Ok(Ok((head, own.into_iter().map(|m| m.message).collect(), new)))
            })
            .await??;
        let tail = turns::drop_orphan_results(own.into_iter().chain(new).collect());
        let tail = match budget {
            Some(budget) => {
                let room = budget.saturating_sub(head.as_ref().map_or(0, estimate::message_tokens));
                turns::fit_turns(tail, room)
            }
            None => tail,
        };
        let messages: Vec<AgentMessage> = head.into_iter().chain(tail).collect();
        Ok(pb::AssembleResult {
            estimated_tokens: estimate::messages_tokens(&messages),
            messages,
            prompt_authority: pb::PromptAuthority::Assembled as i32,
            system_prompt_addition: Some(retrieval::POLICY.into()),
            projection: None,
        })
    }

    async fn compact(
        &self,
        ctx: &CallContext,
        req: pb::CompactRequest,
        progress: Progress,
    ) -> Result<CompactOutcome, EngineError> {
        self.import_if_new(ctx, &req.session_id, Some(&req.session_key)).await?;
        let result = self.compact_session(ctx, &req.session_id, &req, Some(&progress)).await?;
        Ok(CompactOutcome::Done(result))
    }

    async fn after_turn(
        &self,
        ctx: &CallContext,
        req: pb::AfterTurnRequest,
    ) -> Result<pb::AfterTurnResult, EngineError> {
        self.ingest_messages(&req.session_id, req.session_key.as_deref(), req.messages).await?;
        self.compact_on_schedule(ctx, &req.session_id, req.session_key.as_deref()).await;
        Ok(pb::AfterTurnResult { maintenance_due: self.maintenance_hint(&req.session_id).await })
    }

    async fn commit_turn(
        &self,
        ctx: &CallContext,
        req: pb::CommitTurnRequest,
    ) -> Result<pb::CommitTurnResult, EngineError> {
        let (sid, key) = (req.session_id.clone(), req.session_key.clone());
        let committed = self
            .store
            .write(move |c| {
                store::touch_session(c, &req.session_id, req.session_key.as_deref(), None)?;
                let fresh = store::record_commit(c, &req.session_id, &req.advancement_key)?;
                if fresh {
                    store::insert_messages(c, &req.session_id, &req.messages)?;
                }
                Ok(fresh)
            })
            .await?;
        if committed {
            self.compact_on_schedule(ctx, &sid, key.as_deref()).await;
        }
        let status = if committed { pb::CommitStatus::Committed } else { pb::CommitStatus::Duplicate };
        Ok(pb::CommitTurnResult { status: status as i32, maintenance_due: self.maintenance_hint(&sid).await })
    }

    async fn maintain(&self, _ctx: &CallContext, req: pb::MaintainRequest) -> Result<pb::MaintainResult, EngineError> {
        let (keep, limit) = (self.config.keep_turns.max(1), self.config.max_tool_result_bytes);
        // Most turns bring nothing to elide: ask the index before decoding.
        let oversized = self.maintenance_due(&req.session_id).await?;
        let elide = move |c: &rusqlite::Connection| {
            // Only what the summary does not cover yet: older messages
            // were looked at when they left the kept turns.
            let covered = store::summary(c, &req.session_id)?.covered_seq;
            let all: Vec<AgentMessage> =
                store::messages_after(c, &req.session_id, covered)?.into_iter().map(|s| s.message).collect();
            let cut = turns::keep_last_turns(&all, keep);
            let mut out = Vec::new();
            for m in &all[..cut] {
                if let Some(new) = elide_tool_results(m, limit) {
                    store::replace_message(c, &req.session_id, &new)?;
                    out.push(pb::TranscriptReplacement { entry_id: new.id.clone(), message: Some(new) });
                }
            }
            Ok(out)
        };
        let replacements = if oversized { self.store.write(elide).await? } else { Vec::new() };
        let n = replacements.len();
        Ok(pb::MaintainResult {
            changed: n > 0,
            reason: Some(if n > 0 {
                format!("elided {n} old oversized tool results")
            } else {
                "nothing to elide".into()
            }),
            replacements,
            allowed_rewrite_suffix_entry_ids: vec![],
        })
    }

    async fn prepare_subagent_spawn(
        &self,
        _ctx: &CallContext,
        req: pb::PrepareSubagentSpawnRequest,
    ) -> Result<pb::PrepareSubagentSpawnResult, EngineError> {
        if req.context_mode != pb::SubagentContextMode::Fork as i32 {
            return Ok(pb::PrepareSubagentSpawnResult { prepared: false, rollback_token: None });
        }
        let keep = self.config.keep_turns.max(1);
        let token = format!("window-spawn:{}:{}", req.child_session_key, now_ms());
        let expires = req.ttl_ms.map(|t| now_ms().saturating_add(t as i64));
        let tok = token.clone();
        self.store
            .write(move |c| {
                let parent = match req.parent_session_id.clone() {
                    Some(id) => Some(id),
                    None => store::session_by_key(c, &req.parent_session_key)?,
                };
                let child = req.child_session_id.clone().unwrap_or_else(|| req.child_session_key.clone());
                store::touch_session(c, &child, Some(&req.child_session_key), None)?;
                if let Some(parent) = parent {
                    // The child starts from the parent's summary and tail.
                    let s = store::summary(c, &parent)?;
                    let pending: Vec<AgentMessage> =
                        store::messages_after(c, &parent, s.covered_seq)?.into_iter().map(|m| m.message).collect();
                    let tail = &pending[turns::keep_last_turns(&pending, keep)..];
                    store::insert_messages(c, &child, tail)?;
                    if !s.text.is_empty() {
                        store::set_summary(
                            c,
                            &child,
                            &Summary {
                                text: s.text,
                                covered_seq: 0,
                                first_kept_id: tail.first().map(|m| m.id.clone()),
                            },
                        )?;
                    }
                }
                store::add_spawn(c, &tok, &child, expires)?;
                Ok(())
            })
            .await?;
        Ok(pb::PrepareSubagentSpawnResult { prepared: true, rollback_token: Some(token) })
    }

    async fn rollback_subagent_spawn(
        &self,
        _ctx: &CallContext,
        req: pb::RollbackSubagentSpawnRequest,
    ) -> Result<pb::RollbackSubagentSpawnResult, EngineError> {
        self.store
            .write(move |c| {
                if let Some(child) = store::take_spawn(c, &req.rollback_token)? {
                    store::delete_session(c, &child)?;
                }
                Ok(())
            })
            .await?;
        Ok(pb::RollbackSubagentSpawnResult {})
    }

    async fn on_subagent_ended(
        &self,
        _ctx: &CallContext,
        req: pb::OnSubagentEndedRequest,
    ) -> Result<pb::OnSubagentEndedResult, EngineError> {
        use pb::SubagentEndReason as R;
        let forget = matches!(R::try_from(req.reason), Ok(R::Deleted | R::Swept));
        self.store
            .write(move |c| {
                // A spawn prepared before the child had a session id keeps
                // the child under its key; its turns then add a session
                // with the real id. Both are the child.
                let mut children = store::sessions_by_key(c, &req.child_session_key)?;
                if !children.contains(&req.child_session_key) {
                    children.push(req.child_session_key.clone());
                }
                for child in &children {
                    store::drop_spawns_of(c, child)?;
                    if forget {
                        store::delete_session(c, child)?;
                    }
                }
                Ok(())
            })
            .await?;
        Ok(pb::OnSubagentEndedResult {})
    }

    async fn forget_session(
        &self,
        _ctx: &CallContext,
        req: pb::ForgetSessionRequest,
    ) -> Result<pb::ForgetSessionResult, EngineError> {
        self.store
            .write(move |c| {
                store::drop_spawns_of(c, &req.session_id)?;
                store::delete_session(c, &req.session_id)?;
                Ok(())
            })
            .await?;
        Ok(pb::ForgetSessionResult {})
    }

    async fn call_tool(&self, _ctx: &CallContext, req: pb::CallToolRequest) -> Result<pb::CallToolResult, EngineError> {
        retrieval::call(&self.store, req).await
    }

    async fn dispose(&self, _ctx: &CallContext) -> Result<pb::DisposeResult, EngineError> {
        self.store.read(|c| c.execute_batch("PRAGMA wal_checkpoint(TRUNCATE);")).await?;
        Ok(pb::DisposeResult {})
    }
}

/// The message with every tool result over `limit` bytes replaced by a
/// short placeholder, or `None` if nothing was over.
fn elide_tool_results(m: &AgentMessage, limit: usize) -> Option<AgentMessage> {
    let mut out = m.clone();
    let mut changed = false;
    for p in &mut out.content {
        if let Some(Part::ToolResult(r)) = &mut p.part
            && r.text.len() > limit
        {
            r.text = format!("[tool result of {} bytes elided by the window engine]", r.text.len());
            changed = true;
        }
    }
    changed.then_some(out)
}
