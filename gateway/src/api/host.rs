//! The `Host` service engines call back (`contextengine.v1.Host`). Every
//! callback needs a live grant ([`crate::grants`]) for its session and
//! operation.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ctxgate_proto::pb::{self, host_server::Host};
use tokio_stream::Stream;
use tokio_util::sync::{CancellationToken, DropGuard};
use tonic::{Request, Response, Status};

use crate::core::{Core, EngineModelError};
use crate::grants::{Callback, GrantError, HostOperation};
use crate::provider::ChatRequest;
use crate::store::{PageOutcome, PageRequest};

/// The longest `LlmCompleteRequest.purpose` accepted (it is logged and audited).
const MAX_PURPOSE_BYTES: usize = 128;

impl From<GrantError> for Status {
    fn from(e: GrantError) -> Self {
        match e {
            GrantError::Missing | GrantError::Unknown => Status::unauthenticated(e.to_string()),
            GrantError::Expired | GrantError::OtherSession | GrantError::NotAllowed(_) => {
                Status::permission_denied(e.to_string())
            }
            GrantError::OverLimit(_) => Status::resource_exhausted(e.to_string()),
        }
    }
}

/// Entries one ReadTranscript answers at most (a smaller `limit` is
/// honoured); the last chunk's cursor resumes after them.
const READ_PAGE_ENTRIES: usize = 1_000;
/// Stored bytes one ReadTranscript answers at most (about; a single larger
/// entry is sent alone).
const READ_PAGE_BYTES: usize = 4 * 1024 * 1024;
/// Messages one LlmComplete may carry.
const MAX_LLM_MESSAGES: usize = 1_024;
/// Bytes of system prompt and message content one LlmComplete may carry.
const MAX_LLM_BYTES: usize = 4 * 1024 * 1024;

/// One page of entries as chunks of [`CHUNK_ENTRIES`] and about
/// [`CHUNK_BYTES`] at most (a larger entry alone); each chunk's cursor
/// resumes after it, the last one's only when `more` follows. Small chunks
/// let the connection's flow control hold back what the engine does not
/// read, in the stream (see [`TranscriptStream`]).
fn chunks(entries: Vec<pb::TranscriptEntry>, more: bool) -> Vec<pb::TranscriptChunk> {
    let mut chunks: Vec<pb::TranscriptChunk> = Vec::new();
    let mut bytes = 0;
    for e in entries {
        let size = prost::Message::encoded_len(&e);
        match chunks.last_mut() {
            Some(c) if c.entries.len() < CHUNK_ENTRIES && bytes + size <= CHUNK_BYTES => {
                bytes += size;
                c.next_cursor.clone_from(&e.id);
                c.entries.push(e);
            }
            _ => {
                bytes = size;
                chunks.push(pb::TranscriptChunk { next_cursor: e.id.clone(), entries: vec![e] });
            }
        }
    }
    if let Some(last) = chunks.last_mut().filter(|_| !more) {
        last.next_cursor.clear();
    }
    chunks
}

/// Purposes that ask for a summary (OpenClaw's compaction purposes and
/// anything naming a summary).
fn summary_purpose(purpose: &str) -> bool {
    purpose.contains("compaction") || purpose.contains("summar")
}

pub struct HostService {
    pub core: Arc<Core>,
}

type Chunks = Pin<Box<dyn Stream<Item = Result<pb::TranscriptChunk, Status>> + Send>>;

/// How long a ReadTranscript answer may wait to be read, whatever its
/// grant: a page of at most 4 MiB flows in far less.
const READ_STREAM_LIFE: Duration = Duration::from_secs(30);

/// A ReadTranscript answer, sent as the engine reads it. It holds its
/// callback's in-flight slot until it ends, so one engine call keeps at
/// most `hostCallbacks.inFlightPerCall` reads open, read or not; and its
/// chunks go when the grant is revoked (the engine call ended) or after
/// [`READ_STREAM_LIFE`], the stream then ending with that error: an engine
/// that opens reads and never reads them pins no pages past its call.
struct TranscriptStream {
    chunks: Arc<Mutex<Pending>>,
    _call: Callback,
    /// Stops the watcher when the stream goes.
    _watch: DropGuard,
}

enum Pending {
    Chunks(VecDeque<pb::TranscriptChunk>),
    Dropped(Status),
    Ended,
}

impl TranscriptStream {
    fn new(chunks: Vec<pb::TranscriptChunk>, call: Callback) -> Self {
        let pending = Arc::new(Mutex::new(Pending::Chunks(chunks.into())));
        let (watch, revoked) = (CancellationToken::new(), call.revoked.clone());
        let (stopped, dropped) = (watch.clone(), pending.clone());
        tokio::spawn(async move {
            let why = tokio::select! {
                () = stopped.cancelled() => return,
                () = revoked.cancelled() => Status::permission_denied(
                    "grant: revoked: the engine call it came with ended before its transcript was read",
                ),
                () = tokio::time::sleep(READ_STREAM_LIFE) => Status::deadline_exceeded(format!(
                    "the transcript was not read within {} s",
                    READ_STREAM_LIFE.as_secs()
                )),
            };
            let mut p = dropped.lock().unwrap_or_else(|e| e.into_inner());
            if matches!(&*p, Pending::Chunks(c) if !c.is_empty()) {
                *p = Pending::Dropped(why);
            }
        });
        Self { chunks: pending, _call: call, _watch: watch.drop_guard() }
    }
}

impl Stream for TranscriptStream {
    type Item = Result<pb::TranscriptChunk, Status>;

    // Never pending: the page is read before the stream exists.
    fn poll_next(self: Pin<&mut Self>, _: &mut std::task::Context<'_>) -> std::task::Poll<Option<Self::Item>> {
        let mut p = self.chunks.lock().unwrap_or_else(|e| e.into_inner());
        let next = match &mut *p {
            Pending::Chunks(c) => c.pop_front().map(Ok),
            Pending::Dropped(_) => match std::mem::replace(&mut *p, Pending::Ended) {
                Pending::Dropped(why) => Some(Err(why)),
                _ => None,
            },
            Pending::Ended => None,
        };
        std::task::Poll::Ready(next)
    }
}

const CHUNK_ENTRIES: usize = 128;
const CHUNK_BYTES: usize = 256 * 1024;

#[tonic::async_trait]
impl Host for HostService {
    type ReadTranscriptStream = Chunks;

    async fn read_transcript(&self, req: Request<pb::ReadTranscriptRequest>) -> Result<Response<Chunks>, Status> {
        let r = req.into_inner();
        ctxgate_proto::validate::id(&r.session_id, "session_id")?;
        if !r.cursor.is_empty() {
            ctxgate_proto::validate::id(&r.cursor, "cursor")?;
        }
        let call = self.core.authorise(&r.grant, Some(&r.session_id), HostOperation::ReadTranscript)?;
        let limit = match r.limit {
            0 => READ_PAGE_ENTRIES,
            n => (n as usize).min(READ_PAGE_ENTRIES),
        };
        // The current-turn fence: a pre-turn read never sees the admitted
        // message (by entry or, after a rewrite copied it, by message id).
        let page = PageRequest {
            after: Some(r.cursor).filter(|c| !c.is_empty()),
            until: call.scope.fence_before.clone(),
            limit,
            max_bytes: READ_PAGE_BYTES,
        };
        let chunks = match self.core.transcript_page(&r.session_id, r.visible_only, page).await? {
            PageOutcome::Page { entries, more } => chunks(entries, more),
            PageOutcome::UnknownAfter => return Err(Status::invalid_argument("cursor: unknown entry")),
            // Not found: refused, never widened.
            PageOutcome::UnknownUntil => {
                return Err(Status::failed_precondition(
                    "the current turn's fence entry is no longer on the branch; read refused",
                ));
            }
        };
        Ok(Response::new(Box::pin(TranscriptStream::new(chunks, call))))
    }

    async fn llm_complete(
        &self,
        req: Request<pb::LlmCompleteRequest>,
    ) -> Result<Response<pb::LlmCompleteResult>, Status> {
        let r = req.into_inner();
        // The grant first: what it cannot do costs it its budget, not the host.
        let call = self.core.authorise(&r.grant, None, HostOperation::LlmComplete)?;
        let scope = &call.scope;
        if r.messages.is_empty() {
            return Err(Status::invalid_argument("messages: is required"));
        }
        if r.messages.len() > MAX_LLM_MESSAGES {
            return Err(Status::resource_exhausted(format!("messages: at most {MAX_LLM_MESSAGES} in one LlmComplete")));
        }
        let bytes = r
            .messages
            .iter()
            .fold(r.system_prompt.as_deref().map_or(0, str::len), |n, m| n.saturating_add(m.content.len()));
        if bytes > MAX_LLM_BYTES {
            return Err(Status::resource_exhausted(format!(
                "messages: at most {MAX_LLM_BYTES} bytes of prompt and content in one LlmComplete"
            )));
        }
        if r.purpose.trim().is_empty() {
            return Err(Status::invalid_argument("purpose: is required (e.g. context-engine.compaction)"));
        }
        if r.purpose.len() > MAX_PURPOSE_BYTES {
            return Err(Status::resource_exhausted(format!("purpose: is limited to {MAX_PURPOSE_BYTES} bytes")));
        }
        // The offline model would answer with chat text, which an engine
        // would store as its summary: summaries are refused with a typed
        // code instead, and engines summarise locally (the SDK's extractive
        // summariser is the one the built-in compaction uses).
        if self.core.model_is_offline() && summary_purpose(&r.purpose) {
            return Err(Status::unimplemented(
                "the host's model is offline and writes no summaries: summarise locally",
            ));
        }
        let _slot = self.core.llm_slot(&scope.engine_id)?;
        let mut messages = Vec::with_capacity(r.messages.len());
        for (i, m) in r.messages.iter().enumerate() {
            let role = match m.role.as_str() {
                "system" => pb::Role::System,
                "user" => pb::Role::User,
                "assistant" => pb::Role::Assistant,
                other => return Err(Status::invalid_argument(format!("messages[{i}].role: unknown role {other:?}"))),
            };
            if m.content.len() > ctxgate_proto::limits::MAX_MESSAGE_CONTENT_BYTES {
                return Err(Status::resource_exhausted(format!("messages[{i}].content: over the content limit")));
            }
            messages.push(pb::AgentMessage {
                id: format!("llm-{i}"),
                role: role as i32,
                content: vec![pb::ContentPart { part: Some(pb::content_part::Part::Text(m.content.clone())) }],
                ..Default::default()
            });
        }
        let chat = ChatRequest {
            system: r.system_prompt.clone(),
            messages: messages.into(),
            max_tokens: r.max_tokens.map_or(u64::MAX, u64::from),
            tools: Vec::new(),
        };
        // The engine dropping its call drops this future, and the guard
        // cancels the model request with it.
        let cancel = self.core.call_token();
        let _cancel_on_drop = cancel.clone().drop_guard();
        let reply = self.core.complete_for_engine(scope, &r.purpose, chat, &cancel).await.map_err(|e| match e {
            EngineModelError::OverBudget(over) => Status::resource_exhausted(over.to_string()),
            EngineModelError::Model(e) => Status::unavailable(e.to_string()),
        })?;
        Ok(Response::new(pb::LlmCompleteResult {
            text: reply.text,
            provider: self.core.provider_name(),
            model: self.core.model_id().into(),
            response_model: None,
            stop_reason: None,
            agent_id: String::new(),
            usage: Some(reply.usage),
            audit: Some(pb::LlmAudit {
                caller: format!("context-engine:{}", scope.engine_id),
                purpose: r.purpose,
                session_key: scope.session_key.clone(),
            }),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(n: usize) -> Vec<pb::TranscriptEntry> {
        (0..n).map(|i| pb::TranscriptEntry { id: format!("e{i}"), seq: i as u64 + 1, ..Default::default() }).collect()
    }

    #[test]
    fn the_last_chunk_resumes_only_when_more_follows() {
        let c = chunks(entries(300), true);
        assert_eq!(c.len(), 3, "chunks of {CHUNK_ENTRIES}");
        assert_eq!(c[0].next_cursor, "e127");
        assert_eq!(c.last().unwrap().next_cursor, "e299", "more follows: the cursor resumes after the page");
        let c = chunks(entries(3), false);
        assert_eq!(c.last().unwrap().next_cursor, "", "nothing follows");
        assert!(chunks(Vec::new(), false).is_empty());
    }
}
