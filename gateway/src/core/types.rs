//! The turn core's own vocabulary: what drives a turn, how it ends, what it
//! reports. The API adapters (`api.rs`, `harness.rs`) map these to and from
//! the client protos; nothing in the core speaks `ctxgate.v1`.

use std::fmt;
use std::sync::Arc;

use ctxgate_proto::pb;

/// Which driver runs a turn (the `driver` label of `turns_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Driver {
    /// `RunTurn`: the gateway's own model loop.
    Managed,
    /// `Harness/DriveTurn`: an external agent runtime's loop.
    Harness,
}

impl Driver {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Managed => "managed",
            Self::Harness => "harness",
        }
    }
}

/// An operation engines declare host requirements for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    AgentRun,
    ManualCompact,
    SubagentSpawn,
}

impl Operation {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::AgentRun => "agent-run",
            Self::ManualCompact => "manual-compact",
            Self::SubagentSpawn => "subagent-spawn",
        }
    }
}

/// Why a compaction runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger {
    /// Before the model call: the history is near the window.
    Proactive,
    /// The model (or the pre-prompt check) said the prompt is too long.
    Overflow,
    /// The model timed out on a large prompt.
    Timeout,
    /// `/compact`, or a harness's `compact` mid-turn.
    Manual,
}

impl Trigger {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Proactive => "proactive",
            Self::Overflow => "overflow",
            Self::Timeout => "timeout",
            Self::Manual => "manual",
        }
    }
}

impl fmt::Display for Trigger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a turn failed (the `reason` clients see).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureReason {
    ContextOverflow,
    ModelTimeout,
    ModelError,
    Aborted,
    EngineError,
    EngineBacklog,
    /// A harness ended its turn failed (its model or tools failed).
    HarnessFailed,
    /// The model kept calling tools past `agents.defaults.maxToolRounds`.
    ToolRounds,
}

impl FailureReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ContextOverflow => "context_overflow",
            Self::ModelTimeout => "model_timeout",
            Self::ModelError => "model_error",
            Self::Aborted => "aborted",
            Self::EngineError => "engine_error",
            Self::EngineBacklog => "engine_backlog",
            Self::HarnessFailed => "harness_failed",
            Self::ToolRounds => "tool_rounds",
        }
    }
}

/// A turn's failure: the reason and a sentence saying what to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub reason: FailureReason,
    pub message: String,
}

impl Failure {
    pub fn new(reason: FailureReason, message: impl Into<String>) -> Self {
        Self { reason, message: message.into() }
    }

    pub fn aborted() -> Self {
        Self::new(FailureReason::Aborted, "The turn was aborted.")
    }
}

/// How a turn ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Part of the conversation: the engine learns it, then maintains.
    Accepted,
    /// Cancelled by the client, an Abort, or an interrupting turn.
    Aborted,
    Failed(Failure),
}

impl Outcome {
    pub fn label(&self) -> &'static str {
        match self {
            Self::Accepted => "completed",
            Self::Aborted => "aborted",
            Self::Failed(f) => f.reason.as_str(),
        }
    }
}

/// What to do when a turn arrives for a session that is running one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BusyPolicy {
    /// Wait in the session's bounded queue.
    #[default]
    Enqueue,
    /// FAILED_PRECONDITION "session busy".
    Reject,
    /// The running turn ends aborted; this one starts after it.
    Interrupt,
}

/// A host capability in OpenClaw's vocabulary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Capability {
    Bootstrap,
    AssembleBeforePrompt,
    AfterTurn,
    Maintain,
    Compact,
    ThreadBootstrapProjection,
    RuntimeLlmComplete,
}

impl Capability {
    pub const ALL: [Capability; 7] = [
        Self::Bootstrap,
        Self::AssembleBeforePrompt,
        Self::AfterTurn,
        Self::Maintain,
        Self::Compact,
        Self::ThreadBootstrapProjection,
        Self::RuntimeLlmComplete,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Bootstrap => "bootstrap",
            Self::AssembleBeforePrompt => "assemble-before-prompt",
            Self::AfterTurn => "after-turn",
            Self::Maintain => "maintain",
            Self::Compact => "compact",
            Self::ThreadBootstrapProjection => "thread-bootstrap-projection",
            Self::RuntimeLlmComplete => "runtime-llm-complete",
        }
    }

    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.as_str() == name)
    }
}

/// Who runs a turn: OpenClaw's host descriptor. Engines' host requirements
/// are checked against it, and it decides which lifecycle steps run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostProfile {
    pub id: String,
    pub label: String,
    pub capabilities: Vec<Capability>,
}

impl HostProfile {
    /// The managed driver, `ctxgate-embedded`.
    pub fn embedded() -> Self {
        use Capability::*;
        Self {
            id: "ctxgate-embedded".into(),
            label: "ctxgate embedded runner".into(),
            capabilities: vec![Bootstrap, AssembleBeforePrompt, AfterTurn, Maintain, Compact, RuntimeLlmComplete],
        }
    }

    pub fn has(&self, c: Capability) -> bool {
        self.capabilities.contains(&c)
    }

    pub fn capability_names(&self) -> Vec<&'static str> {
        self.capabilities.iter().map(|c| c.as_str()).collect()
    }

    /// Checks the engine's requirements for `operation` against this host;
    /// the error is OpenClaw's message, word for word in shape.
    pub fn unmet(&self, id: &str, info: &pb::EngineInfo, operation: Operation) -> Result<(), String> {
        let operation = operation.as_str();
        let (host_label, host_caps) = (self.label.as_str(), self.capability_names());
        let Some(req) = info.host_requirements.iter().find(|r| r.operation == operation) else { return Ok(()) };
        let missing: Vec<&str> =
            req.required_capabilities.iter().map(String::as_str).filter(|c| !host_caps.contains(c)).collect();
        if missing.is_empty() {
            return Ok(());
        }
        let caps = if host_caps.is_empty() { "(none)".to_owned() } else { host_caps.join(", ") };
        let mut msg = format!(
            "Context engine \"{}\" cannot run operation \"{operation}\" on {host_label}. Missing host capabilities: {}. Required capabilities: {}. Host capabilities: {caps}.",
            id,
            missing.join(", "),
            req.required_capabilities.join(", ")
        );
        if let Some(extra) = req.unsupported_message.as_deref().filter(|m| !m.trim().is_empty()) {
            msg.push(' ');
            msg.push_str(extra);
        }
        Err(msg)
    }
}

/// The model a turn runs against (the gateway's provider for managed turns,
/// the harness's own model otherwise).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelSpec {
    pub id: String,
    pub provider: String,
    pub context_window: u64,
    /// Tokens kept free for the reply.
    pub reserve_tokens: u64,
    pub max_output_tokens: u64,
}

/// Everything `begin` needs, validated by the adapter that built it.
#[derive(Debug, Clone)]
pub struct TurnSpec {
    pub agent_id: String,
    pub session_key: String,
    pub driver: Driver,
    pub host: HostProfile,
    pub model: ModelSpec,
    /// The turn's user message(s), in order.
    pub user_messages: Vec<pb::AgentMessage>,
    /// The rendered system prompt's tokens (off the budget).
    pub system_prompt_tokens: u64,
    pub available_tools: Vec<String>,
    pub busy: BusyPolicy,
    /// The client's W3C trace context; every engine call of the turn
    /// continues it (a new trace when the client sent none).
    pub trace: Option<ctxgate_proto::trace::TraceParent>,
}

/// Why this engine serves the turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Selection {
    /// The configured engine.
    Configured,
    /// No engine configured: legacy.
    Default,
    /// The configured engine could not take it: legacy, with a warning.
    Degraded,
}

impl Selection {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Configured => "configured",
            Self::Default => "default",
            Self::Degraded => "degraded",
        }
    }
}

/// The end of a compaction, as clients see it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CompactionDone {
    pub compacted: bool,
    pub reason: Option<String>,
    pub tokens_before: u64,
    pub tokens_after: u64,
    /// The compaction entry appended, when the gateway compacted.
    pub entry_id: Option<String>,
    pub summary_chars: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CompactionEvent {
    Started { trigger: Trigger, tokens_before: u64 },
    Progress { stage: String, done: u64, total: u64, message: String },
    Done(CompactionDone),
}

/// A thread-bootstrap projection for hosts that keep a persistent thread.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Projection {
    pub epoch: String,
    pub fingerprint: String,
    /// The epoch or fingerprint changed since the last one this host got.
    pub reinject: bool,
}

/// An assembled context, before a model call.
#[derive(Debug, Clone, Default)]
pub struct Context {
    /// The engine's messages (the history the model sees), shared with the
    /// store's tail when the engine passed the history through.
    pub messages: crate::transcript::Messages,
    pub system_prompt_addition: Option<String>,
    /// The gateway's estimate of `messages` (the one token estimate).
    pub estimated_tokens: u64,
    /// The estimate of the history before assembly (the precheck uses it
    /// for engines whose pre-assembly history may overflow).
    pub pre_assembly_tokens: u64,
    pub may_overflow: bool,
    pub budget: u64,
    pub projection: Option<Projection>,
    /// 1 for the turn's first context, then 2, 3, ...
    pub sequence: u32,
    /// The context engine's tools offered in this turn (none while it is
    /// quarantined, and by audience: main or subagent session).
    pub engine_tools: Vec<pb::ToolDefinition>,
}

/// What a turn reports while it runs.
#[derive(Debug, Clone)]
pub enum TurnEvent {
    Admitted {
        session_id: String,
        turn_id: String,
        entry_ids: Vec<String>,
    },
    EngineSelected {
        engine_id: String,
        selection: Selection,
        warning: Option<String>,
    },
    /// A managed attempt's prompt (the harness gets the context itself).
    Assembled {
        messages: u32,
        estimated_tokens: u64,
        token_budget: u64,
        attempt: u32,
    },
    ModelDelta(String),
    Compaction(CompactionEvent),
    Warning(String),
    /// A managed turn's model called one of the engine's tools.
    ToolCalled {
        id: String,
        name: String,
        arguments: String,
    },
    /// ... and what it answered (stored as the call's result).
    ToolAnswered(Box<ToolAnswer>),
}

/// An engine tool's answer to a tool call, now in the transcript.
#[derive(Debug, Clone)]
pub struct ToolAnswer {
    pub tool_call_id: String,
    pub name: String,
    pub is_error: bool,
    /// What the model reads (at most `MAX_TOOL_RESULT_BYTES`).
    pub text: String,
    /// The tool message, as stored.
    pub message: pb::AgentMessage,
    pub entry_id: String,
}

/// Where a turn's events go. Called in order from the turn's own task; an
/// adapter maps each event to its proto and queues it for the client.
pub type EventSink = Arc<dyn Fn(TurnEvent) + Send + Sync>;

#[cfg(test)]
mod tests {
    use ctxgate_proto::pb;

    use super::{HostProfile, Operation};

    #[test]
    fn host_requirements_fail_closed_with_openclaws_message() {
        let info = pb::EngineInfo {
            id: "lossless".into(),
            host_requirements: vec![pb::HostRequirement {
                operation: "agent-run".into(),
                required_capabilities: vec!["compact".into(), "thread-bootstrap-projection".into()],
                unsupported_message: Some("Use the Codex harness.".into()),
            }],
            ..Default::default()
        };
        let embedded = HostProfile::embedded();
        let err = embedded.unmet(&info.id, &info, Operation::AgentRun).unwrap_err();
        assert_eq!(
            err,
            "Context engine \"lossless\" cannot run operation \"agent-run\" on ctxgate embedded runner. Missing host capabilities: thread-bootstrap-projection. Required capabilities: compact, thread-bootstrap-projection. Host capabilities: bootstrap, assemble-before-prompt, after-turn, maintain, compact, runtime-llm-complete. Use the Codex harness."
        );
        assert!(embedded.unmet(&info.id, &info, Operation::ManualCompact).is_ok());
        let bare = HostProfile { id: "agent-harness:bare".into(), label: "a bare host".into(), capabilities: vec![] };
        assert!(bare.unmet(&info.id, &info, Operation::AgentRun).unwrap_err().contains("Host capabilities: (none)."));
    }
}
