//! The adapters between the outside and the domain: the client API
//! ([`gateway`], `ctxgate.v1.Gateway`), the harness API ([`harness`],
//! `ctxgate.v1.Harness`), the host callbacks engines make ([`host`],
//! `contextengine.v1.Host`), every event stream to a client
//! ([`outbound`]), and the listeners that serve them ([`server`]). Here
//! live the one mapping from core errors to gRPC statuses and the domain →
//! proto mappings the two client services share; the core never sees a
//! client proto.

pub mod errors;
pub mod gateway;
pub mod harness;
pub mod host;
pub mod outbound;
pub mod server;

use std::pin::Pin;

use ctxgate_proto::gateway as api;
use tokio_stream::{Stream, StreamExt};
use tonic::Status;

use crate::core::types::{BusyPolicy, CompactionDone, CompactionEvent, Failure, TurnEvent};
use crate::core::{BusyError, CoreError};
use crate::store::StoreError;
use outbound::{Backlog, Event};

pub use gateway::Api;

impl From<CoreError> for Status {
    fn from(e: CoreError) -> Self {
        match e {
            CoreError::Invalid { .. } => Status::invalid_argument(e.to_string()),
            CoreError::TooLarge { .. } => Status::resource_exhausted(e.to_string()),
            CoreError::NoSession(_) => Status::not_found(format!("{e}; start one with `ctxgate chat --session KEY`")),
            CoreError::CompactionTimeout(_) => Status::deadline_exceeded(e.to_string()),
            CoreError::CompactionFailed(_) => Status::unavailable(e.to_string()),
            CoreError::Aborted | CoreError::Busy(BusyError::Cancelled) => Status::cancelled("aborted"),
            CoreError::NoEngine(_) => Status::not_found(e.to_string()),
            CoreError::Precondition(_) | CoreError::Busy(BusyError::Busy) => Status::failed_precondition(e.to_string()),
            CoreError::Busy(BusyError::QueueFull(_)) => Status::resource_exhausted(e.to_string()),
            CoreError::Overloaded(shed) => {
                let mut s = Status::resource_exhausted(e.to_string());
                // gRPC's retry pushback: clients with a retry policy wait this long.
                let ms = tonic::metadata::MetadataValue::from(shed.retry_after.as_millis() as u64);
                s.metadata_mut().insert("grpc-retry-pushback-ms", ms);
                s
            }
            CoreError::EngineFailed(_) => Status::unavailable(e.to_string()),
            CoreError::Store(StoreError::NoSession(_)) => Status::not_found("the session no longer exists"),
            // Rolled back whole: nothing half-written; the operator must free space.
            CoreError::Store(StoreError::Full(detail)) => errors::hidden(
                Status::resource_exhausted("the gateway's state storage is full; nothing of this call was stored"),
                "the state storage is full",
                &detail,
            ),
            // The turn's lease was taken over: nothing of the refused write
            // was stored; the session goes on at the gateway that holds it.
            CoreError::Store(e @ StoreError::Fenced(_)) => Status::aborted(e.to_string()),
            // Internal detail goes to the log, under the error id the client gets.
            CoreError::Store(StoreError::Unavailable(detail)) => errors::hidden(
                Status::unavailable("the gateway's store is unavailable right now; retry shortly"),
                "store unavailable",
                &detail,
            ),
            CoreError::Store(StoreError::Backend(detail)) => errors::hidden(
                Status::internal("the gateway's store failed; the gateway log has the detail under this error id"),
                "store failure",
                &detail,
            ),
        }
    }
}

/// The W3C trace context a client sent (`traceparent`), if valid.
pub(crate) fn trace_of(m: &tonic::metadata::MetadataMap) -> Option<ctxgate_proto::trace::TraceParent> {
    m.get(ctxgate_proto::trace::HEADER).and_then(|v| v.to_str().ok()).and_then(ctxgate_proto::trace::TraceParent::parse)
}

/// The busy policy a client asked for (unset: enqueue).
pub(crate) fn busy_policy(p: i32, field: &str) -> Result<BusyPolicy, CoreError> {
    match api::BusyPolicy::try_from(p) {
        Ok(api::BusyPolicy::Unspecified | api::BusyPolicy::Enqueue) => Ok(BusyPolicy::Enqueue),
        Ok(api::BusyPolicy::Reject) => Ok(BusyPolicy::Reject),
        Ok(api::BusyPolicy::Interrupt) => Ok(BusyPolicy::Interrupt),
        Err(_) => Err(CoreError::invalid(field, format!("unknown busy policy {p}"))),
    }
}

pub(crate) fn session_fields(r: Option<&api::SessionRef>) -> Result<(&str, &str), CoreError> {
    let r = r.ok_or_else(|| CoreError::invalid("session", "is required"))?;
    Ok((&r.agent_id, &r.session_key))
}

pub(crate) fn compaction_done(d: CompactionDone) -> api::CompactionDone {
    api::CompactionDone {
        compacted: d.compacted,
        reason: d.reason,
        tokens_before: d.tokens_before,
        tokens_after: d.tokens_after,
        entry_id: d.entry_id,
        summary_chars: d.summary_chars,
    }
}

/// The three compaction events, whichever stream they go to.
pub(crate) enum Compaction {
    Started(api::CompactionStarted),
    Progress(api::CompactionProgress),
    Done(api::CompactionDone),
}

pub(crate) fn compaction(e: CompactionEvent) -> Compaction {
    match e {
        CompactionEvent::Started { trigger, tokens_before } => {
            Compaction::Started(api::CompactionStarted { trigger: trigger.as_str().into(), tokens_before })
        }
        CompactionEvent::Progress { stage, done, total, message } => {
            Compaction::Progress(api::CompactionProgress { stage, done, total, message })
        }
        CompactionEvent::Done(d) => Compaction::Done(compaction_done(d)),
    }
}

pub(crate) fn failed(f: Failure) -> api::Failed {
    api::Failed { reason: f.reason.as_str().into(), message: f.message }
}

/// A turn event as `RunTurn` reports it (a degrade warning comes first, as
/// its own event).
pub(crate) fn turn_events(e: TurnEvent, mut emit: impl FnMut(api::turn_event::Event)) {
    use api::turn_event::Event as E;
    let event = match e {
        TurnEvent::Admitted { session_id, turn_id, entry_ids } => {
            let entry_id = entry_ids.last().cloned().unwrap_or_default();
            E::Admitted(api::Admitted { session_id, turn_id, entry_id, entry_ids })
        }
        TurnEvent::EngineSelected { engine_id, selection, warning } => {
            if let Some(message) = warning.clone() {
                emit(E::Warning(api::Warning { message }));
            }
            E::EngineSelected(api::EngineSelected { engine_id, reason: selection.as_str().into(), warning })
        }
        TurnEvent::Assembled { messages, estimated_tokens, token_budget, attempt } => {
            E::Assembled(api::Assembled { messages, estimated_tokens, token_budget, attempt })
        }
        TurnEvent::ModelDelta(text) => E::ModelDelta(api::ModelDelta { text }),
        TurnEvent::Compaction(c) => match compaction(c) {
            Compaction::Started(s) => E::CompactionStarted(s),
            Compaction::Progress(p) => E::CompactionProgress(p),
            Compaction::Done(d) => E::CompactionDone(d),
        },
        TurnEvent::Warning(message) => E::Warning(api::Warning { message }),
        TurnEvent::ToolCalled { id, name, arguments } => {
            E::ToolCalled(api::ToolCalled { tool_call_id: id, name, arguments_json: arguments })
        }
        TurnEvent::ToolAnswered(a) => E::ToolAnswered(api::ToolAnswered {
            tool_call_id: a.tool_call_id,
            name: a.name,
            is_error: a.is_error,
            text: a.text,
            entry_id: a.entry_id,
        }),
    };
    emit(event);
}

/// Events in flight to one client, and kept events waiting behind them.
pub(crate) const STREAM_CAPACITY: usize = 32;
pub(crate) const STREAM_BACKLOG: usize = 256;

/// While a RunTurn client is behind, model text merges and progress drops.
impl Event for api::TurnEvent {
    fn backlog(&self) -> Backlog {
        match self.event {
            Some(api::turn_event::Event::ModelDelta(_)) => Backlog::Merge,
            Some(api::turn_event::Event::CompactionProgress(_)) => Backlog::Drop,
            _ => Backlog::Keep,
        }
    }

    fn merge(&mut self, next: Self) -> Option<Self> {
        use api::turn_event::Event::ModelDelta;
        match (&mut self.event, next.event) {
            (Some(ModelDelta(a)), Some(ModelDelta(b))) => {
                a.text.push_str(&b.text);
                None
            }
            (_, event) => Some(Self { event }),
        }
    }
}

impl Event for api::CompactionEvent {
    fn backlog(&self) -> Backlog {
        match self.event {
            Some(api::compaction_event::Event::Progress(_)) => Backlog::Drop,
            _ => Backlog::Keep,
        }
    }
}

pub(crate) type EventStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// `stream`, firing `cancel` when the client drops it (client cancel,
/// disconnect): the work behind it stops.
pub(crate) fn guarded<T: Send + 'static>(
    stream: impl Stream<Item = Result<T, Status>> + Send + 'static,
    cancel: tokio_util::sync::CancellationToken,
) -> EventStream<T> {
    let guard = cancel.drop_guard();
    Box::pin(stream.map(move |item| {
        let _keep = &guard;
        item
    }))
}
