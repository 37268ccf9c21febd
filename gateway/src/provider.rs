//! Model providers: an OpenAI-compatible chat-completions client
//! (streaming, usage, overflow classification, timeouts) for real use, and
//! a deterministic offline provider as the embedded default.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use ctxgate_proto::estimate;
use ctxgate_proto::pb::{AgentMessage, Role, Usage};
use futures_util::StreamExt;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::config::{ModelsSection, ProviderKind};

/// One chat completion.
#[derive(Debug, Clone)]
pub struct ChatRequest {
    pub system: Option<String>,
    pub messages: Vec<AgentMessage>,
    pub max_tokens: u64,
}

#[derive(Debug, Clone, Default)]
pub struct ChatResponse {
    pub text: String,
    pub usage: Usage,
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
pub use ctxgate_engine_sdk::extractive::message_text;

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
        let prompt = estimate::messages_tokens(&req.messages) + req.system.as_deref().map_or(0, estimate::text_tokens);
        if prompt + req.max_tokens > self.context_window {
            return Err(ModelError::ContextOverflow(format!(
                "{prompt} prompt tokens + {} for the reply exceed the {}-token window",
                req.max_tokens, self.context_window
            )));
        }
        let last_user =
            req.messages.iter().rev().find(|m| m.role == Role::User as i32).map(message_text).unwrap_or_default();
        let quoted: String = last_user.chars().take(200).collect();
        let text = format!(
            "(offline model) I can see {} messages (about {prompt} tokens). You said: {quoted}",
            req.messages.len()
        );
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
                total_tokens: Some(prompt + output),
                ..Default::default()
            },
        })
    }
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
        for m in &req.messages {
            let role = match Role::try_from(m.role) {
                Ok(Role::System) => "system",
                Ok(Role::Assistant) => "assistant",
                _ => "user",
            };
            messages.push(json!({"role": role, "content": message_text(m)}));
        }
        json!({
            "model": self.model,
            "messages": messages,
            "max_tokens": req.max_tokens,
            "stream": true,
            "stream_options": {"include_usage": true},
        })
    }

    async fn call(&self, req: ChatRequest, deltas: Option<mpsc::Sender<String>>) -> Result<ChatResponse, ModelError> {
        let mut http = self.http.post(&self.url).json(&self.body(&req));
        if let Some(key) = &self.api_key {
            http = http.bearer_auth(key);
        }
        let resp = http.send().await.map_err(|e| ModelError::Unavailable(e.to_string()))?;
        let status = resp.status();
        if !status.is_success() {
            let body = resp.text().await.unwrap_or_default();
            return Err(classify(status.as_u16(), &body));
        }
        let mut out = ChatResponse::default();
        let mut buf = Vec::new();
        let mut stream = resp.bytes_stream();
        while let Some(chunk) = stream.next().await {
            buf.extend_from_slice(&chunk.map_err(|e| ModelError::Unavailable(e.to_string()))?);
            while let Some(nl) = buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = buf.drain(..=nl).collect();
                let line = String::from_utf8_lossy(&line);
                let Some(data) = line.trim().strip_prefix("data:").map(str::trim) else { continue };
                if data == "[DONE]" {
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

/// Classifies an error answer. Providers report overflow with the
/// `context_length_exceeded` code; compatible servers that lack codes say so
/// in the message, so the message is the fallback.
fn classify(status: u16, body: &str) -> ModelError {
    let v: Value = serde_json::from_str(body).unwrap_or(Value::Null);
    let err = v.get("error").unwrap_or(&v);
    let code = err.get("code").and_then(Value::as_str).unwrap_or_default();
    let message = err.get("message").and_then(Value::as_str).unwrap_or(body).to_owned();
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
}
