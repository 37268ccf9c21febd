//! A harness client for tests: one `DriveTurn` stream, requests sent one at
//! a time, events read until the one that answers.

use ctxgate_proto::gateway::{
    self as api, harness_client::HarnessClient, harness_event::Event as H, harness_request::Request as R,
};
use ctxgate_proto::pb::{self, ContentPart, Role, content_part::Part};
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

pub fn client(endpoint: &str) -> HarnessClient<Channel> {
    HarnessClient::new(tonic::transport::Endpoint::from_shared(endpoint.to_owned()).expect("uri").connect_lazy())
}

pub fn text(role: Role, t: &str) -> pb::AgentMessage {
    pb::AgentMessage {
        role: role as i32,
        content: vec![ContentPart { part: Some(Part::Text(t.into())) }],
        ..Default::default()
    }
}

pub fn tool_call(id: &str, name: &str, args: &str) -> pb::AgentMessage {
    pb::AgentMessage {
        role: Role::Assistant as i32,
        content: vec![ContentPart {
            part: Some(Part::ToolCall(pb::ToolCall { id: id.into(), name: name.into(), arguments_json: args.into() })),
        }],
        ..Default::default()
    }
}

pub fn tool_result(id: &str, name: &str, out: &str) -> pb::AgentMessage {
    pb::AgentMessage {
        role: Role::Tool as i32,
        content: vec![ContentPart {
            part: Some(Part::ToolResult(pb::ToolResult {
                tool_call_id: id.into(),
                tool_name: name.into(),
                text: out.into(),
                is_error: false,
            })),
        }],
        ..Default::default()
    }
}

/// A `begin` for session `key` with every capability and a 32k model.
pub fn begin(key: &str, user: &str) -> api::Begin {
    api::Begin {
        session: Some(api::SessionRef { agent_id: String::new(), session_key: key.into() }),
        host: Some(api::HostProfile {
            id: "agent-harness:test".into(),
            label: String::new(),
            capabilities: [
                "bootstrap",
                "assemble-before-prompt",
                "after-turn",
                "maintain",
                "compact",
                "runtime-llm-complete",
            ]
            .map(String::from)
            .to_vec(),
        }),
        model: Some(api::ModelInfo {
            id: "test-model".into(),
            provider: "test".into(),
            context_window: 32_000,
            max_output_tokens: 1_000,
        }),
        user_messages: vec![text(Role::User, user)],
        ..Default::default()
    }
}

/// A harness turn on session `key` at the gateway `endpoint`, past one
/// calculator call and its stored result and left open (never ended):
/// what the crash tests cut.
pub async fn open_tool_turn(endpoint: &str, key: &str, user: &str) -> Drive {
    let mut d = Drive::admitted(&client(endpoint), begin(key, user)).await;
    d.append(vec![tool_call("c1", "calculator", "{}")]).await.expect("the tool call is stored");
    d.append(vec![tool_result("c1", "calculator", "42")]).await.expect("the tool result is stored");
    d
}

/// One DriveTurn stream.
pub struct Drive {
    tx: Option<mpsc::Sender<api::HarnessRequest>>,
    events: tonic::Streaming<api::HarnessEvent>,
    /// Every event read so far.
    pub seen: Vec<H>,
}

impl Drive {
    /// Opens the stream and sends `begin`.
    pub async fn open(client: &HarnessClient<Channel>, b: api::Begin) -> Result<Self, tonic::Status> {
        Self::open_with(client, R::Begin(b)).await
    }

    /// [`Drive::open`], then the first context read: the turn is admitted
    /// and the harness may append. Panics if the gateway refuses either.
    pub async fn admitted(client: &HarnessClient<Channel>, b: api::Begin) -> Self {
        let mut d = Self::open(client, b).await.expect("the gateway opens the turn");
        d.context().await.expect("the turn's first context");
        d
    }

    /// Opens the stream with any first request.
    pub async fn open_with(client: &HarnessClient<Channel>, first: R) -> Result<Self, tonic::Status> {
        let (tx, rx) = mpsc::channel(8);
        tx.send(api::HarnessRequest { request: Some(first) }).await.expect("channel open");
        let mut client = client.clone();
        let opened = client.drive_turn(ReceiverStream::new(rx));
        let events = crate::within(crate::PATIENCE, "the gateway answering a DriveTurn", opened).await?.into_inner();
        Ok(Self { tx: Some(tx), events, seen: Vec::new() })
    }

    pub async fn send(&mut self, r: R) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(api::HarnessRequest { request: Some(r) }).await;
        }
    }

    /// Closes the client's side of the stream.
    pub fn close(&mut self) {
        self.tx = None;
    }

    /// The next event; `Ok(None)` when the stream ended cleanly. Bounded:
    /// a step the gateway never answers fails the test, naming the events
    /// seen so far.
    pub async fn next(&mut self) -> Result<Option<H>, tonic::Status> {
        let next = match tokio::time::timeout(crate::PATIENCE, self.events.next()).await {
            Ok(next) => next,
            Err(_) => panic!("no harness event within {:?}; seen: {:?}", crate::PATIENCE, self.seen),
        };
        match next {
            None => Ok(None),
            Some(Err(s)) => Err(s),
            Some(Ok(e)) => {
                let e = e.event.expect("events carry an event");
                self.seen.push(e.clone());
                Ok(Some(e))
            }
        }
    }

    /// Reads until an event `want` accepts.
    pub async fn until<T>(&mut self, want: impl Fn(&H) -> Option<T>) -> Result<T, tonic::Status> {
        loop {
            match self.next().await? {
                Some(e) => {
                    if let Some(t) = want(&e) {
                        return Ok(t);
                    }
                }
                None => return Err(tonic::Status::unknown("the stream ended before the awaited event")),
            }
        }
    }

    /// Reads on until the stream ends with an error status; panics if it
    /// ends cleanly.
    pub async fn status(&mut self) -> tonic::Status {
        loop {
            match self.next().await {
                Ok(Some(_)) => continue,
                Ok(None) => panic!("the stream ended without an error: {:?}", self.seen),
                Err(s) => return s,
            }
        }
    }

    pub async fn context(&mut self) -> Result<api::Context, tonic::Status> {
        self.until(|e| if let H::Context(c) = e { Some(c.clone()) } else { None }).await
    }

    pub async fn assemble(&mut self, pending: Vec<pb::AgentMessage>) -> Result<api::Context, tonic::Status> {
        self.send(R::Assemble(api::AssembleContext { pending })).await;
        self.context().await
    }

    pub async fn append(&mut self, messages: Vec<pb::AgentMessage>) -> Result<Vec<String>, tonic::Status> {
        self.send(R::Append(api::Append { messages })).await;
        self.until(|e| if let H::Appended(a) = e { Some(a.entry_ids.clone()) } else { None }).await
    }

    /// Runs engine tool call `tool_call_id` (appended already): the tool
    /// message the gateway stored as its result.
    pub async fn call_tool(&mut self, tool_call_id: &str) -> Result<api::ToolResult, tonic::Status> {
        self.send(R::CallTool(api::CallTool { tool_call_id: tool_call_id.into() })).await;
        self.until(|e| if let H::ToolResult(r) = e { Some(r.clone()) } else { None }).await
    }

    /// Sends `end`, reads `ended`, closes its side and waits for the close.
    pub async fn end(&mut self, outcome: api::TurnOutcome) -> Result<api::Ended, tonic::Status> {
        self.end_with(outcome, Vec::new()).await
    }

    /// [`Drive::end`] carrying the turn's last `messages`.
    pub async fn end_with(
        &mut self,
        outcome: api::TurnOutcome,
        messages: Vec<pb::AgentMessage>,
    ) -> Result<api::Ended, tonic::Status> {
        self.send(R::End(api::End { outcome: outcome as i32, reason: String::new(), messages })).await;
        let ended = self.until(|e| if let H::Ended(x) = e { Some(*x) } else { None }).await?;
        self.close();
        while self.next().await?.is_some() {}
        Ok(ended)
    }
}
