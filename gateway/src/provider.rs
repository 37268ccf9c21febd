//! Model providers: an OpenAI-compatible chat-completions client
//! (streaming, usage, overflow classification, timeouts) for real use, and
//! a deterministic offline provider as the embedded default.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use ctxgate_proto::estimate;
use ctxgate_proto::pb::{self, AgentMessage, Role, Usage, content_part::Part};
use futures_util::StreamExt;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::config::{ModelsSection, ProviderKind};
use crate::transcript::Messages;

/// One chat completion.
#[derive(Debug, Clone, Default)]
pub struct ChatRequest {
    pub system: Option<String>,
    /// Shared with the store's tail when the engine passed it through.
    pub messages: Messages,
    pub max_tokens: u64,
    /// Tools the model may call (the context engine's); none: a plain reply.
    pub tools: Vec<pb::ToolDefinition>,
}

#[derive(Debug, Clone, Default)]
pub struct ChatResponse {
    pub text: String,
    pub usage: Usage,
    /// The tools the model called instead of (or besides) answering.
    pub tool_calls: Vec<pb::ToolCall>,
}

/// How a model call failed. Overflow and timeout drive recovery; the rest
/// surface to the user.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("the prompt does not fit the model's context window ({0})")]
    ContextOverflow(String),
    #[error("the model did not answer within {0:?}")]
    Timeout(Duration),
    #[error("the model provider is unavailable ({0})")]
    Unavailable(String),
    #[error("the model provider refused the request (HTTP {status}: {message})")]
    Rejected { status: u16, message: String },
    #[error("the model call was cancelled")]
    Cancelled,
}

impl ModelError {
    /// What went wrong, in words that carry nothing of the provider's.
    pub fn class(&self) -> String {
        match self {
            Self::ContextOverflow(_) => "the prompt does not fit the model's context window".into(),
            Self::Timeout(after) => format!("the model did not answer within {after:?}"),
            Self::Unavailable(_) => "the model provider is unavailable".into(),
            Self::Rejected { status, .. } => format!("the model provider refused the request with HTTP {status}"),
            Self::Cancelled => "the model call was cancelled".into(),
        }
    }
}

#[async_trait]
pub trait ModelProvider: Send + Sync + 'static {
    /// "offline" or "openai".
    fn kind(&self) -> ProviderKind;
    fn model(&self) -> &str;
    /// Completes `req`, sending text deltas to `deltas` as they arrive.
    /// Returns promptly with `Cancelled` when `cancel` fires.
    async fn complete(
        &self,
        req: ChatRequest,
        deltas: Option<mpsc::Sender<String>>,
        cancel: &CancellationToken,
    ) -> Result<ChatResponse, ModelError>;
}

/// The provider the config asks for.
pub fn from_config(m: &ModelsSection) -> Result<Arc<dyn ModelProvider>, String> {
    Ok(match m.provider {
        ProviderKind::Offline => Arc::new(Offline { context_window: m.context_window }),
        ProviderKind::Openai => Arc::new(OpenAi::new(m)?),
    })
}

/// The plain text of a message, tool traffic rendered inline (the managed
/// driver defines no tools, so tool turns travel as text).
pub use ctxgate_proto::extractive::message_text;

// ---------------------------------------------------------------------------

/// Answers deterministically without a network: the default, so `ctxgate
/// chat` works on a fresh machine. It enforces the configured context
/// window like a real model, so overflow recovery is real here too.
pub struct Offline {
    pub context_window: u64,
}

#[async_trait]
impl ModelProvider for Offline {
    fn kind(&self) -> ProviderKind {
        ProviderKind::Offline
    }

    fn model(&self) -> &str {
        "offline"
    }

    async fn complete(
        &self,
        req: ChatRequest,
        deltas: Option<mpsc::Sender<String>>,
        cancel: &CancellationToken,
    ) -> Result<ChatResponse, ModelError> {
        // A shared history's estimate is kept with the store's tail.
        let prompt = req.messages.tokens().saturating_add(req.system.as_deref().map_or(0, estimate::text_tokens));
        if prompt.saturating_add(req.max_tokens) > self.context_window {
            return Err(ModelError::ContextOverflow(format!(
                "{prompt} prompt tokens + {} for the reply exceed the {}-token window",
                req.max_tokens, self.context_window
            )));
        }
        if let Some(call) = offline_tool_call(&req) {
            return Ok(ChatResponse { tool_calls: vec![call], ..Default::default() });
        }
        let text = match req.messages.last().filter(|m| m.role == Role::Tool as i32) {
            // After a tool's result, what it found.
            Some(result) => {
                let found: String = message_text(result).chars().take(2_000).collect();
                format!("(offline model) The tool answered: {found}")
            }
            None => {
                let last_user = req
                    .messages
                    .iter()
                    .rev()
                    .find(|m| m.role == Role::User as i32)
                    .map(message_text)
                    .unwrap_or_default();
                let quoted: String = last_user.chars().take(200).collect();
                format!(
                    "(offline model) I can see {} messages (about {prompt} tokens). You said: {quoted}",
                    req.messages.len()
                )
            }
        };
        if let Some(tx) = deltas {
            for piece in text.split_inclusive(' ') {
                if cancel.is_cancelled() {
                    return Err(ModelError::Cancelled);
                }
                let _ = tx.send(piece.to_owned()).await;
            }
        }
        let output = estimate::text_tokens(&text);
        Ok(ChatResponse {
            text,
            usage: Usage {
                input_tokens: Some(prompt),
                output_tokens: Some(output),
                total_tokens: Some(prompt.saturating_add(output)),
                ..Default::default()
            },
            tool_calls: Vec::new(),
        })
    }
}

/// The offline model calls a search tool when the last message is the
/// user's asking it to "search history for X" (or "search for X"): so the
/// tool loop works on a fresh machine, deterministically.
fn offline_tool_call(req: &ChatRequest) -> Option<pb::ToolCall> {
    let last = req.messages.last().filter(|m| m.role == Role::User as i32)?;
    let tool = req.tools.iter().find(|t| t.name.contains("search"))?;
    let text = message_text(last);
    // ASCII lowercasing keeps every byte where it was (full lowercasing
    // does not: "İ" grows), so an offset found in `lower` is one in `text`.
    let lower = text.to_ascii_lowercase();
    let at = ["search the history for ", "search history for ", "search for "]
        .iter()
        .find_map(|p| lower.find(p).map(|i| i + p.len()))?;
    let query = text.get(at..)?.trim().trim_end_matches(['.', '?', '!']).trim_matches(['"', '\'', '`']).trim();
    if query.is_empty() {
        return None;
    }
    let calls = req.messages.iter().filter(|m| m.role == Role::Tool as i32).count();
    Some(pb::ToolCall {
        id: format!("offline-call-{}", calls + 1),
        name: tool.name.clone(),
        arguments_json: json!({ "query": query }).to_string(),
    })
}

// ---------------------------------------------------------------------------

/// An OpenAI-compatible `/chat/completions` client, streaming.
pub struct OpenAi {
    http: reqwest::Client,
    url: String,
    api_key: Option<String>,
    model: String,
    timeout: Duration,
}

impl OpenAi {
    pub fn new(m: &ModelsSection) -> Result<Self, String> {
        // rustls with ring and the webpki roots, configured here rather than
        // through a process-wide default provider.
        let tls = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(rustls::RootCertStore { roots: webpki_roots::TLS_SERVER_ROOTS.to_vec() })
            .with_no_client_auth();
        let http = reqwest::Client::builder()
            .use_preconfigured_tls(tls)
            .connect_timeout(Duration::from_secs(10))
            .build()
            .map_err(|e| e.to_string())?;
        Ok(Self {
            http,
            url: format!("{}/chat/completions", m.base_url.trim_end_matches('/')),
            api_key: m.api_key.clone(),
            model: m.model.clone(),
            timeout: Duration::from_secs(m.request_timeout_seconds),
        })
    }

    fn body(&self, req: &ChatRequest) -> Value {
        let mut messages = Vec::with_capacity(req.messages.len() + 1);
        if let Some(s) = &req.system {
            messages.push(json!({"role": "system", "content": s}));
        }
        for m in req.messages.iter() {
            openai_messages(m, &mut messages);
        }
        let mut body = json!({
            "model": self.model,
            "messages": messages,
            "max_tokens": req.max_tokens,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        if !req.tools.is_empty() {
            body["tools"] = req.tools.iter().map(openai_tool).collect();
        }
        body
    }

    async fn call(&self, req: ChatRequest, deltas: Option<mpsc::Sender<String>>) -> Result<ChatResponse, ModelError> {
        let mut http = self.http.post(&self.url).json(&self.body(&req));
        if let Some(key) = &self.api_key {
            http = http.bearer_auth(key);
        }
        // Without the URL: reqwest's text would carry models.baseUrl whole.
        let unavailable = |e: reqwest::Error| ModelError::Unavailable(e.without_url().to_string());
        let resp = http.send().await.map_err(unavailable)?;
        let status = resp.status();
        if !status.is_success() {
            let body = resp.text().await.unwrap_or_default();
            return Err(classify(status.as_u16(), &body));
        }
        let mut out = ChatResponse::default();
        let mut calls = StreamedCalls::default();
        let mut buf = Vec::new();
        let mut stream = resp.bytes_stream();
        while let Some(chunk) = stream.next().await {
            buf.extend_from_slice(&chunk.map_err(unavailable)?);
            while let Some(nl) = buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = buf.drain(..=nl).collect();
                let line = String::from_utf8_lossy(&line);
                let Some(data) = line.trim().strip_prefix("data:").map(str::trim) else { continue };
                if data == "[DONE]" {
                    out.tool_calls = calls.finish();
                    return Ok(out);
                }
                let v: Value = serde_json::from_str(data)
                    .map_err(|e| ModelError::Unavailable(format!("malformed stream event: {e}")))?;
                if v.get("error").is_some() {
                    return Err(classify(400, data));
                }
                if let Some(piece) = v.pointer("/choices/0/delta/content").and_then(Value::as_str)
                    && !piece.is_empty()
                {
                    out.text.push_str(piece);
                    if let Some(tx) = &deltas {
                        let _ = tx.send(piece.to_owned()).await;
                    }
                }
                for call in v.pointer("/choices/0/delta/tool_calls").and_then(Value::as_array).into_iter().flatten() {
                    calls.add(call);
                }
                if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
                    let n = |k: &str| u.get(k).and_then(Value::as_u64);
                    out.usage = Usage {
                        input_tokens: n("prompt_tokens"),
                        output_tokens: n("completion_tokens"),
                        total_tokens: n("total_tokens"),
                        ..Default::default()
                    };
                }
            }
        }
        // A stream cut before [DONE] is a broken answer, not a complete one.
        Err(ModelError::Unavailable("the stream ended before [DONE]".into()))
    }
}

/// A message as OpenAI's chat format writes it: tool calls and tool
/// results as such (a tool message per result), the rest as text.
fn openai_messages(m: &AgentMessage, out: &mut Vec<Value>) {
    let role = Role::try_from(m.role).unwrap_or(Role::User);
    let calls: Vec<Value> = m
        .content
        .iter()
        .filter_map(|p| match &p.part {
            Some(Part::ToolCall(c)) => Some(json!({
                "id": c.id, "type": "function",
                "function": {"name": c.name, "arguments": c.arguments_json},
            })),
            _ => None,
        })
        .collect();
    let text = |parts: &[pb::ContentPart]| -> String {
        parts
            .iter()
            .filter_map(|p| match &p.part {
                Some(Part::Text(t)) => Some(t.as_str()),
                _ => None,
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    match role {
        Role::Assistant if !calls.is_empty() => {
            let content = text(&m.content);
            let content = if content.is_empty() { Value::Null } else { Value::String(content) };
            out.push(json!({"role": "assistant", "content": content, "tool_calls": calls}));
        }
        Role::Tool => {
            for p in &m.content {
                if let Some(Part::ToolResult(r)) = &p.part {
                    out.push(json!({"role": "tool", "tool_call_id": r.tool_call_id, "content": r.text}));
                }
            }
        }
        Role::System => out.push(json!({"role": "system", "content": message_text(m)})),
        Role::Assistant => out.push(json!({"role": "assistant", "content": message_text(m)})),
        _ => out.push(json!({"role": "user", "content": message_text(m)})),
    }
}

/// A tool as OpenAI's `tools` list declares it.
fn openai_tool(t: &pb::ToolDefinition) -> Value {
    let parameters = serde_json::from_str::<Value>(&t.parameters_json_schema)
        .ok()
        .filter(Value::is_object)
        .unwrap_or_else(|| json!({"type": "object", "properties": {}}));
    json!({"type": "function", "function": {"name": t.name, "description": t.description, "parameters": parameters}})
}

/// Tool calls as they stream: each `delta.tool_calls[]` item names its
/// `index`; the id and name come once, the arguments in pieces.
#[derive(Default)]
struct StreamedCalls {
    calls: std::collections::BTreeMap<u64, pb::ToolCall>,
}

/// The most tool calls one reply may make, and the longest arguments kept:
/// a model (or a server posing as one) cannot grow them without bound.
const MAX_STREAMED_CALLS: usize = 64;
const MAX_STREAMED_ARGUMENTS: usize = ctxgate_proto::limits::MAX_TOOL_ARGUMENTS_BYTES;

impl StreamedCalls {
    fn add(&mut self, delta: &Value) {
        let index = delta.get("index").and_then(Value::as_u64).unwrap_or(0);
        if !self.calls.contains_key(&index) && self.calls.len() >= MAX_STREAMED_CALLS {
            return;
        }
        let call = self.calls.entry(index).or_default();
        if let Some(id) = delta.get("id").and_then(Value::as_str) {
            call.id = id.chars().take(ctxgate_proto::limits::MAX_ID_BYTES).collect();
        }
        if let Some(name) = delta.pointer("/function/name").and_then(Value::as_str) {
            call.name.push_str(name);
        }
        if let Some(args) = delta.pointer("/function/arguments").and_then(Value::as_str)
            && call.arguments_json.len() + args.len() <= MAX_STREAMED_ARGUMENTS
        {
            call.arguments_json.push_str(args);
        }
    }

    fn finish(self) -> Vec<pb::ToolCall> {
        self.calls.into_values().collect()
    }
}

/// Classifies an error answer. Providers report overflow with the
/// `context_length_exceeded` code; compatible servers that lack codes say so
/// in the message, so the message is the fallback.
fn classify(status: u16, body: &str) -> ModelError {
    let v: Value = serde_json::from_str(body).unwrap_or(Value::Null);
    let err = v.get("error").unwrap_or(&v);
    let code = err.get("code").and_then(Value::as_str).unwrap_or_default();
    // The provider's words, capped and escaped: they reach logs and clients.
    let message = crate::peer_text::capped(err.get("message").and_then(Value::as_str).unwrap_or(body), 300);
    let lower = message.to_lowercase();
    let overflow = code == "context_length_exceeded"
        || ["context length", "context window", "maximum context", "too many tokens", "prompt is too long"]
            .iter()
            .any(|p| lower.contains(p));
    match status {
        _ if overflow => ModelError::ContextOverflow(message),
        408 | 504 => ModelError::Timeout(Duration::ZERO),
        429 | 500.. => ModelError::Unavailable(format!("HTTP {status}: {message}")),
        _ => ModelError::Rejected { status, message },
    }
}

#[async_trait]
impl ModelProvider for OpenAi {
    fn kind(&self) -> ProviderKind {
        ProviderKind::Openai
    }

    fn model(&self) -> &str {
        &self.model
    }

    async fn complete(
        &self,
        req: ChatRequest,
        deltas: Option<mpsc::Sender<String>>,
        cancel: &CancellationToken,
    ) -> Result<ChatResponse, ModelError> {
        // Dropping the request future closes the connection: the provider
        // sees the cancel.
        tokio::select! {
            r = tokio::time::timeout(self.timeout, self.call(req, deltas)) => r.unwrap_or(Err(ModelError::Timeout(self.timeout))),
            () = cancel.cancelled() => Err(ModelError::Cancelled),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overflow_is_recognised_by_code_or_wording() {
        let by_code = r#"{"error":{"message":"too long","code":"context_length_exceeded"}}"#;
        assert!(matches!(classify(400, by_code), ModelError::ContextOverflow(_)));
        let by_words = r#"{"error":{"message":"This model's maximum context length is 8192 tokens"}}"#;
        assert!(matches!(classify(400, by_words), ModelError::ContextOverflow(_)));
        assert!(matches!(classify(429, "{}"), ModelError::Unavailable(_)));
        assert!(matches!(
            classify(401, r#"{"error":{"message":"bad key"}}"#),
            ModelError::Rejected { status: 401, .. }
        ));
    }

    /// A user's text whose lowercase is longer than itself ("İ" is 2 bytes,
    /// its lowercase 3) once panicked the offline model (a byte offset
    /// found in the lowercase sliced the original inside a character).
    #[test]
    fn the_offline_model_finds_its_search_in_any_text_without_panicking() {
        let search = pb::ToolDefinition { name: "history_search".into(), ..Default::default() };
        let ask = |text: &str| ChatRequest {
            messages: Messages::Owned(vec![AgentMessage {
                role: Role::User as i32,
                content: vec![pb::ContentPart { part: Some(pb::content_part::Part::Text(text.into())) }],
                ..Default::default()
            }]),
            tools: vec![search.clone()],
            ..Default::default()
        };
        for text in ["İİİİ search for é", "İstanbul: Search History For ÇAĞ-7?", "ß search for", "İ"] {
            let _ = offline_tool_call(&ask(text));
        }
        let call = offline_tool_call(&ask("İİ please Search history for ORCHID-7731?")).unwrap();
        assert_eq!(call.arguments_json, r#"{"query":"ORCHID-7731"}"#);
    }
}
