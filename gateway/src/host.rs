//! The `Host` service engines call back (`contextengine.v1.Host`), and the
//! grants that scope every callback: one session, the call's operations,
//! and the call's deadline. A grant is revoked the moment its engine call
//! returns, so no engine can act on a session outside a call for it.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ctxgate_proto::pb::{self, host_server::Host};
use tokio::time::Instant;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use crate::core::Core;
use crate::provider::ChatRequest;

pub const READ_TRANSCRIPT: &str = "read_transcript";
pub const LLM_COMPLETE: &str = "llm_complete";

/// What a grant allows.
#[derive(Debug, Clone)]
pub struct Scope {
    pub engine_id: String,
    pub session_id: String,
    pub session_key: String,
    pub operations: Vec<&'static str>,
    /// Pre-turn reads (bootstrap, assemble) end before this entry: the
    /// admitted user message of the current turn.
    pub fence_before: Option<String>,
}

struct Live {
    scope: Scope,
    expires: Instant,
}

/// Live grants by token.
#[derive(Default)]
pub struct Grants {
    live: Mutex<HashMap<String, Live>>,
}

/// A live grant; dropping it revokes the token.
pub struct GrantGuard {
    grants: Arc<Grants>,
    token: String,
    pub access: pb::HostAccess,
}

impl Drop for GrantGuard {
    fn drop(&mut self) {
        self.grants.live.lock().unwrap_or_else(|e| e.into_inner()).remove(&self.token);
    }
}

impl Grants {
    /// Issues a grant for `scope` that expires after `ttl`.
    pub fn issue(self: &Arc<Self>, endpoint: &str, scope: Scope, ttl: Duration) -> GrantGuard {
        let token = format!("{}{}", uuid::Uuid::new_v4().simple(), uuid::Uuid::new_v4().simple());
        let expires_at = SystemTime::now() + ttl;
        let grant = pb::Grant {
            token: token.clone(),
            session_id: scope.session_id.clone(),
            operations: scope.operations.iter().map(|o| (*o).to_owned()).collect(),
            expires_at_unix_ms: expires_at.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64),
        };
        self.live
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(token.clone(), Live { scope, expires: Instant::now() + ttl });
        GrantGuard {
            grants: self.clone(),
            token,
            access: pb::HostAccess { endpoint: endpoint.to_owned(), grant: Some(grant) },
        }
    }

    /// The scope of a live token allowing `operation` on `session_id`.
    pub fn authorise(&self, token: &str, session_id: Option<&str>, operation: &str) -> Result<Scope, Status> {
        if token.is_empty() {
            return Err(Status::unauthenticated("grant: is required"));
        }
        let live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        // Unknown and revoked look the same on purpose.
        let g = live.get(token).ok_or_else(|| Status::unauthenticated("grant: unknown, revoked or expired"))?;
        if Instant::now() >= g.expires {
            return Err(Status::permission_denied("grant: expired"));
        }
        if session_id.is_some_and(|s| s != g.scope.session_id) {
            return Err(Status::permission_denied("grant: not valid for that session"));
        }
        if !g.scope.operations.contains(&operation) {
            return Err(Status::permission_denied(format!("grant: does not allow {operation}")));
        }
        Ok(g.scope.clone())
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
    // The current-turn fence: a pre-turn read never sees the admitted message.
    if let Some(at) = fence_before.and_then(|f| entries.iter().position(|e| e.id == f)) {
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
        let scope = self.core.grants.authorise(&r.grant, Some(&r.session_id), READ_TRANSCRIPT)?;
        let branch = self.core.store.branch(&r.session_id).await.map_err(crate::core::CoreError::from)?;
        let entries = if r.visible_only { crate::api::visible_entries(&branch) } else { branch };
        let chunks = page(entries, scope.fence_before.as_deref(), &r.cursor, r.limit)?;
        let chunks = chunks.into_iter().map(Ok);
        Ok(Response::new(Box::pin(tokio_stream::iter(chunks))))
    }

    async fn llm_complete(
        &self,
        req: Request<pb::LlmCompleteRequest>,
    ) -> Result<Response<pb::LlmCompleteResult>, Status> {
        let r = req.into_inner();
        let scope = self.core.grants.authorise(&r.grant, None, LLM_COMPLETE)?;
        if r.messages.is_empty() {
            return Err(Status::invalid_argument("messages: is required"));
        }
        if r.purpose.trim().is_empty() {
            return Err(Status::invalid_argument("purpose: is required (e.g. context-engine.compaction)"));
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
        tracing::info!(engine = %scope.engine_id, session = %scope.session_id, purpose = %r.purpose, "host model call for a context engine");
        self.core.metrics.host_llm_call(&scope.engine_id, &r.purpose);
        let max = self.core.config.models.max_output_tokens;
        let chat = ChatRequest {
            system: r.system_prompt.clone(),
            messages,
            max_tokens: r.max_tokens.map_or(max, |m| u64::from(m).min(max)),
        };
        // The engine dropping its call drops this future, and the guard
        // cancels the model request with it.
        let cancel = self.core.call_token();
        let _cancel_on_drop = cancel.clone().drop_guard();
        let reply =
            self.core.provider.complete(chat, None, &cancel).await.map_err(|e| Status::unavailable(e.to_string()))?;
        Ok(Response::new(pb::LlmCompleteResult {
            text: reply.text,
            provider: format!("{:?}", self.core.config.models.provider).to_lowercase(),
            model: self.core.provider.model().into(),
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
