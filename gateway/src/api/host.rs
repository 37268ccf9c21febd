//! The `Host` service engines call back (`contextengine.v1.Host`). Every
//! callback needs a live grant ([`crate::grants`]) for its session and
//! operation.

use std::pin::Pin;
use std::sync::Arc;

use ctxgate_proto::pb::{self, host_server::Host, transcript_entry::Entry};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use crate::core::Core;
use crate::grants::{GrantError, HostOperation};
use crate::provider::ChatRequest;

/// The longest `LlmCompleteRequest.purpose` accepted (it is logged and audited).
const MAX_PURPOSE_BYTES: usize = 128;

impl From<GrantError> for Status {
    fn from(e: GrantError) -> Self {
        match e {
            GrantError::Missing | GrantError::Unknown => Status::unauthenticated(e.to_string()),
            GrantError::Expired | GrantError::OtherSession | GrantError::NotAllowed(_) => {
                Status::permission_denied(e.to_string())
            }
        }
    }
}

/// What one ReadTranscript returns: the entries before the current-turn
/// fence, after `cursor`, at most `limit` (0: all), in chunks. A chunk's
/// cursor resumes after it; the last one's is blank unless `limit` cut
/// entries off.
fn page(
    mut entries: Vec<pb::TranscriptEntry>,
    fence_before: Option<&str>,
    cursor: &str,
    limit: u32,
) -> Result<Vec<pb::TranscriptChunk>, Status> {
    // The current-turn fence: a pre-turn read never sees the admitted
    // message. A rewrite copies it under a new entry id but keeps its
    // message id, so either names it. Not found: refused, never widened.
    if let Some(fence) = fence_before {
        let names =
            |e: &pb::TranscriptEntry| e.id == fence || matches!(&e.entry, Some(Entry::Message(m)) if m.id == fence);
        let at = entries.iter().position(names).ok_or_else(|| {
            Status::failed_precondition("the current turn's fence entry is no longer on the branch; read refused")
        })?;
        entries.truncate(at);
    }
    if !cursor.is_empty() {
        let after = entries
            .iter()
            .position(|e| e.id == cursor)
            .ok_or_else(|| Status::invalid_argument("cursor: unknown entry"))?;
        entries.drain(..=after);
    }
    let more = limit > 0 && entries.len() > limit as usize;
    if more {
        entries.truncate(limit as usize);
    }
    let mut chunks: Vec<pb::TranscriptChunk> = entries
        .chunks(CHUNK_ENTRIES)
        .map(|c| pb::TranscriptChunk {
            entries: c.to_vec(),
            next_cursor: c.last().map(|e| e.id.clone()).unwrap_or_default(),
        })
        .collect();
    if let Some(last) = chunks.last_mut().filter(|_| !more) {
        last.next_cursor.clear();
    }
    Ok(chunks)
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

const CHUNK_ENTRIES: usize = 128;

#[tonic::async_trait]
impl Host for HostService {
    type ReadTranscriptStream = Chunks;

    async fn read_transcript(&self, req: Request<pb::ReadTranscriptRequest>) -> Result<Response<Chunks>, Status> {
        let r = req.into_inner();
        ctxgate_proto::validate::id(&r.session_id, "session_id")?;
        let scope = self.core.authorise(&r.grant, Some(&r.session_id), HostOperation::ReadTranscript)?;
        let entries = self.core.transcript(&r.session_id, r.visible_only).await?;
        let chunks = page(entries, scope.fence_before.as_deref(), &r.cursor, r.limit)?;
        let chunks = chunks.into_iter().map(Ok);
        Ok(Response::new(Box::pin(tokio_stream::iter(chunks))))
    }

    async fn llm_complete(
        &self,
        req: Request<pb::LlmCompleteRequest>,
    ) -> Result<Response<pb::LlmCompleteResult>, Status> {
        let r = req.into_inner();
        let scope = self.core.authorise(&r.grant, None, HostOperation::LlmComplete)?;
        if r.messages.is_empty() {
            return Err(Status::invalid_argument("messages: is required"));
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
            messages,
            max_tokens: r.max_tokens.map_or(u64::MAX, u64::from),
            tools: Vec::new(),
        };
        // The engine dropping its call drops this future, and the guard
        // cancels the model request with it.
        let cancel = self.core.call_token();
        let _cancel_on_drop = cancel.clone().drop_guard();
        let reply = self
            .core
            .complete_for_engine(&scope, &r.purpose, chat, &cancel)
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
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
                session_key: scope.session_key,
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

    fn ids(chunks: &[pb::TranscriptChunk]) -> Vec<String> {
        chunks.iter().flat_map(|c| c.entries.iter().map(|e| e.id.clone())).collect()
    }

    #[test]
    fn the_fence_hides_the_admitted_entry_and_what_follows() {
        let c = page(entries(5), Some("e3"), "", 0).unwrap();
        assert_eq!(ids(&c), ["e0", "e1", "e2"]);
        assert_eq!(c.last().unwrap().next_cursor, "", "nothing follows");
    }

    #[test]
    fn the_fence_follows_a_copied_message_and_fails_closed_without_it() {
        // A rewrite copied e3 under a new entry id; its message id stays "e3".
        let mut copied = entries(5);
        copied[3].id = "copy-of-e3".into();
        copied[3].entry = Some(Entry::Message(pb::AgentMessage { id: "e3".into(), ..Default::default() }));
        assert_eq!(ids(&page(copied, Some("e3"), "", 0).unwrap()), ["e0", "e1", "e2"]);
        let gone = page(entries(5), Some("elsewhere"), "", 0).unwrap_err();
        assert_eq!(gone.code(), tonic::Code::FailedPrecondition, "never the whole branch");
    }

    #[test]
    fn a_cursor_and_a_limit_page_through_everything() {
        let first = page(entries(300), None, "", 200).unwrap();
        assert_eq!(first.len(), 2, "chunks of {CHUNK_ENTRIES}");
        assert_eq!(ids(&first).len(), 200);
        let cursor = first.last().unwrap().next_cursor.clone();
        assert_eq!(cursor, "e199", "more follows: the cursor resumes after the page");
        let rest = page(entries(300), None, &cursor, 200).unwrap();
        assert_eq!(ids(&rest).first().map(String::as_str), Some("e200"));
        assert_eq!(ids(&rest).len(), 100);
        assert_eq!(rest.last().unwrap().next_cursor, "");
        assert_eq!(page(entries(3), None, "nope", 0).unwrap_err().code(), tonic::Code::InvalidArgument);
    }
}
