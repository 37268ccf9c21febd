//! A local HTTP server that speaks the OpenAI chat-completions API
//! (streaming), scripted per test: the stand-in for a hosted model, the one
//! thing these tests cannot run for real.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use tokio::sync::{Notify, mpsc};
use tokio_stream::wrappers::ReceiverStream;

/// How the server answers one request.
#[derive(Debug, Clone)]
pub enum Reply {
    /// Streams `text` in words, then usage and `[DONE]`.
    Text(String),
    /// HTTP 400 with `context_length_exceeded`.
    Overflow,
    /// Streams `first`, then nothing more, ever (until the client leaves).
    Hang(String),
    /// An agent's model with two tools: after a user message it calls
    /// `calculator` (`N * 7 + 1`, N the first number in the user's message)
    /// and `read_file` (`notes.txt`); after tool results it answers with
    /// them. Decided by the request itself, so any number of turns work.
    ToolLoop,
}

/// The two kinds of request the gateway makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Turn,
    Summary,
}

#[derive(Default)]
struct State {
    turn: VecDeque<Reply>,
    summary: VecDeque<Reply>,
    turn_default: Option<Reply>,
    summary_default: Option<Reply>,
    seen: Vec<Kind>,
    /// The newest request bodies, newest last (a few: enough to look back).
    recent: VecDeque<serde_json::Value>,
    disconnects: u32,
}

/// How many request bodies [`FakeOpenAi::recent`] keeps.
const RECENT: usize = 64;

/// The server's handle: script replies, read what happened.
#[derive(Clone)]
pub struct FakeOpenAi {
    pub base_url: String,
    state: Arc<Mutex<State>>,
    disconnected: Arc<Notify>,
}

/// A summary with every safeguard heading, as a well-behaved model writes.
pub fn good_summary(extra: &str) -> String {
    format!(
        "## Decisions\n- keep going\n## Open TODOs\n- none\n## Constraints/Rules\n- none\n## Pending user asks\n- {extra}\n## Exact identifiers\n- {extra}\n"
    )
}

impl FakeOpenAi {
    pub async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind fake model");
        let base_url = format!("http://{}/v1", listener.local_addr().expect("addr"));
        let this = Self { base_url, state: Arc::default(), disconnected: Arc::new(Notify::new()) };
        let handler = this.clone();
        let app = axum::Router::new().route(
            "/v1/chat/completions",
            axum::routing::post(move |body: String| {
                let h = handler.clone();
                async move { h.answer(&body) }
            }),
        );
        tokio::spawn(async move { axum::serve(listener, app).await });
        this
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues replies for turns (used in order, then the default).
    pub fn turns(&self, replies: impl IntoIterator<Item = Reply>) -> &Self {
        self.lock().turn.extend(replies);
        self
    }

    pub fn turn_default(&self, r: Reply) -> &Self {
        self.lock().turn_default = Some(r);
        self
    }

    pub fn summary_default(&self, r: Reply) -> &Self {
        self.lock().summary_default = Some(r);
        self
    }

    /// Requests received so far, by kind.
    pub fn seen(&self) -> Vec<Kind> {
        self.lock().seen.clone()
    }

    /// The newest request bodies received (at most 64), newest last.
    pub fn recent(&self) -> Vec<serde_json::Value> {
        self.lock().recent.iter().cloned().collect()
    }

    pub fn count(&self, kind: Kind) -> usize {
        self.seen().into_iter().filter(|k| *k == kind).count()
    }

    /// Waits (bounded) until a hanging stream's client has gone away.
    pub async fn wait_disconnect(&self, within: Duration) -> bool {
        let notified = self.disconnected.notified();
        if self.lock().disconnects > 0 {
            return true;
        }
        tokio::time::timeout(within, notified).await.is_ok()
    }

    fn answer(&self, body: &str) -> Response {
        let v: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
        let streaming = v.get("stream").and_then(|s| s.as_bool()).unwrap_or(false);
        let system = v.pointer("/messages/0/content").and_then(|c| c.as_str()).unwrap_or_default();
        let kind = if system.contains("You compact the history") { Kind::Summary } else { Kind::Turn };
        let prompt = v.pointer("/messages/1/content").and_then(|c| c.as_str()).unwrap_or_default().to_owned();
        let reply = {
            let mut guard = self.lock();
            let s = &mut *guard;
            s.seen.push(kind);
            if s.recent.len() == RECENT {
                s.recent.pop_front();
            }
            s.recent.push_back(v.clone());
            let (queue, default) = match kind {
                Kind::Turn => (&mut s.turn, s.turn_default.clone()),
                Kind::Summary => (&mut s.summary, s.summary_default.clone()),
            };
            queue.pop_front().or(default).unwrap_or_else(|| {
                Reply::Text(match kind {
                    Kind::Turn => "ok".into(),
                    // A diligent model: every identifier of the prompt survives.
                    Kind::Summary => good_summary(&prompt.replace('\n', " ")),
                })
            })
        };
        match reply {
            Reply::ToolLoop => tool_loop(&v),
            Reply::Text(text) if !streaming => {
                let body = serde_json::json!({
                    "choices": [{"message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 100, "completion_tokens": 5, "total_tokens": 105},
                });
                ([("content-type", "application/json")], body.to_string()).into_response()
            }
            Reply::Overflow => (
                StatusCode::BAD_REQUEST,
                r#"{"error":{"message":"This model's maximum context length is 4096 tokens","type":"invalid_request_error","code":"context_length_exceeded"}}"#,
            )
                .into_response(),
            Reply::Text(text) => {
                let mut events: Vec<String> = text
                    .split_inclusive(' ')
                    .map(|w| format!("data: {}\n\n", serde_json::json!({"choices": [{"delta": {"content": w}}]})))
                    .collect();
                events.push(format!("data: {}\n\n", serde_json::json!({"choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": 5, "total_tokens": 105}})));
                events.push("data: [DONE]\n\n".into());
                let body = Body::from_stream(tokio_stream::iter(events.into_iter().map(|e| Ok::<_, Infallible>(Bytes::from(e)))));
                ([("content-type", "text/event-stream")], body).into_response()
            }
            Reply::Hang(first) => {
                let (tx, rx) = mpsc::channel::<Result<Bytes, Infallible>>(1);
                let (state, notify) = (self.state.clone(), self.disconnected.clone());
                tokio::spawn(async move {
                    let chunk = format!("data: {}\n\n", serde_json::json!({"choices": [{"delta": {"content": first}}]}));
                    let _ = tx.send(Ok(Bytes::from(chunk))).await;
                    // The client leaving drops the body, which closes the channel.
                    tx.closed().await;
                    state.lock().unwrap_or_else(|e| e.into_inner()).disconnects += 1;
                    notify.notify_waiters();
                });
                ([("content-type", "text/event-stream")], Body::from_stream(ReceiverStream::new(rx))).into_response()
            }
        }
    }
}

/// The scripted tool-calling model (non-streaming chat completions).
fn tool_loop(request: &serde_json::Value) -> Response {
    let messages = request.get("messages").and_then(|m| m.as_array()).cloned().unwrap_or_default();
    let last = messages.last().cloned().unwrap_or_default();
    // The first number of the newest user message (the turn's own question).
    let asked = messages.iter().rev().find(|m| m["role"] == "user").and_then(|m| m["content"].as_str()).unwrap_or("");
    let n: u64 =
        asked.split(|c: char| !c.is_ascii_digit()).find(|w| !w.is_empty()).and_then(|w| w.parse().ok()).unwrap_or(0);
    let message = if last["role"] == "tool" {
        // Answer with every tool result since the last user message.
        let results: Vec<String> = messages
            .iter()
            .rev()
            .take_while(|m| m["role"] != "user")
            .filter(|m| m["role"] == "tool")
            .map(|m| m["content"].as_str().unwrap_or_default().to_owned())
            .collect();
        serde_json::json!({"role": "assistant", "content": format!("Done: {}", results.join("; "))})
    } else {
        serde_json::json!({
            "role": "assistant",
            "content": null,
            "tool_calls": [
                {"id": format!("call_{n}_a"), "type": "function",
                 "function": {"name": "calculator", "arguments": serde_json::json!({"expression": format!("{n} * 7 + 1")}).to_string()}},
                {"id": format!("call_{n}_b"), "type": "function",
                 "function": {"name": "read_file", "arguments": serde_json::json!({"path": "notes.txt"}).to_string()}},
            ],
        })
    };
    let body = serde_json::json!({
        "choices": [{"message": message, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 100, "completion_tokens": 12, "total_tokens": 112},
    });
    ([("content-type", "application/json")], body.to_string()).into_response()
}
