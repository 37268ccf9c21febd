//! Grants: what an engine may do when it calls the gateway back. A grant
//! covers one session, the call's operations, and the call's deadline; it is
//! revoked the moment its engine call returns, so no engine can act on a
//! session outside a call for it. Within the call it has a budget
//! (`gateway.limits.hostCallbacks`): callbacks at once, callbacks in all,
//! model calls in all, and model calls per engine at once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ctxgate_proto::pb;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::HostCallbacks;

/// A host callback an engine may be granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostOperation {
    ReadTranscript,
    LlmComplete,
}

impl HostOperation {
    /// The name in `Grant.operations`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ReadTranscript => "read_transcript",
            Self::LlmComplete => "llm_complete",
        }
    }

    /// The operation of a name in `Grant.operations`.
    pub fn from_name(name: &str) -> Option<Self> {
        [Self::ReadTranscript, Self::LlmComplete].into_iter().find(|o| o.as_str() == name)
    }
}

/// Why a callback's grant does not cover it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GrantError {
    #[error("grant: is required")]
    Missing,
    /// Unknown and revoked look the same on purpose.
    #[error("grant: unknown, revoked or expired")]
    Unknown,
    #[error("grant: expired")]
    Expired,
    #[error("grant: not valid for that session")]
    OtherSession,
    #[error("grant: does not allow {}", .0.as_str())]
    NotAllowed(HostOperation),
    #[error("{0}")]
    OverLimit(Limit),
}

/// A host-callback limit a grant reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Limit {
    #[error("at most {0} host callbacks of one engine call run at once (gateway.limits.hostCallbacks.inFlightPerCall)")]
    InFlight(usize),
    #[error("one engine call may make at most {0} host callbacks (gateway.limits.hostCallbacks.perCall)")]
    Calls(u32),
    #[error("one engine call may make at most {0} LlmComplete calls (gateway.limits.hostCallbacks.llmPerCall)")]
    LlmCalls(u32),
    #[error(
        "at most {0} LlmComplete calls of one engine run at once (gateway.limits.hostCallbacks.llmConcurrentPerEngine)"
    )]
    LlmConcurrent(usize),
}

/// What a grant allows.
#[derive(Debug, Clone)]
pub struct Scope {
    pub engine_id: String,
    pub session_id: String,
    pub session_key: String,
    pub operations: Vec<HostOperation>,
    /// Pre-turn reads (bootstrap, assemble) end before this entry: the
    /// admitted user message of the current turn.
    pub fence_before: Option<String>,
}

struct Live {
    scope: Scope,
    expires: Instant,
    budget: Arc<Budget>,
    /// Fired when the grant is revoked (its call ended).
    revoked: CancellationToken,
}

/// What is left of one grant's callbacks.
struct Budget {
    in_flight: Arc<Semaphore>,
    calls: AtomicU32,
    llm_calls: AtomicU32,
}

impl Budget {
    /// Counts one more against `cap`; false (and nothing counted) past it.
    fn spend(counter: &AtomicU32, cap: u32) -> bool {
        counter.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < cap).then_some(n + 1)).is_ok()
    }
}

/// A callback under way: it holds one of its grant's in-flight slots
/// until dropped.
pub struct Callback {
    pub scope: Scope,
    /// Fired when the grant is revoked: what the callback still holds
    /// (a transcript stream's pages) goes then.
    pub revoked: CancellationToken,
    _slot: OwnedSemaphorePermit,
}

/// One of an engine's model-call slots, held while the model answers.
pub struct LlmSlot {
    _permit: OwnedSemaphorePermit,
}

/// Engines whose model-call slots are remembered at most; past it, those
/// not in use are forgotten (an engine id comes from the engine).
const MAX_LLM_ENGINES: usize = 1024;

/// Live grants by token, and each engine's model-call slots.
pub struct Grants {
    live: Mutex<HashMap<String, Live>>,
    limits: HostCallbacks,
    llm: Mutex<HashMap<String, Arc<Semaphore>>>,
}

impl Default for Grants {
    fn default() -> Self {
        Self::new(HostCallbacks::default())
    }
}

/// A live grant; dropping it revokes the token.
pub struct GrantGuard {
    grants: Arc<Grants>,
    token: String,
    pub access: pb::HostAccess,
}

impl Drop for GrantGuard {
    fn drop(&mut self) {
        let live = self.grants.live.lock().unwrap_or_else(|e| e.into_inner()).remove(&self.token);
        if let Some(live) = live {
            live.revoked.cancel();
        }
    }
}

impl Grants {
    pub fn new(limits: HostCallbacks) -> Self {
        Self { live: Mutex::default(), limits, llm: Mutex::default() }
    }

    /// Issues a grant for `scope` that expires after `ttl`.
    pub fn issue(self: &Arc<Self>, endpoint: &str, scope: Scope, ttl: Duration) -> GrantGuard {
        let token = format!("{}{}", uuid::Uuid::new_v4().simple(), uuid::Uuid::new_v4().simple());
        let expires_at = SystemTime::now() + ttl;
        let grant = pb::Grant {
            token: token.clone(),
            session_id: scope.session_id.clone(),
            operations: scope.operations.iter().map(|o| o.as_str().to_owned()).collect(),
            expires_at_unix_ms: expires_at.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64),
        };
        self.live.lock().unwrap_or_else(|e| e.into_inner()).insert(
            token.clone(),
            Live {
                scope,
                expires: Instant::now() + ttl,
                budget: Arc::new(self.budget()),
                revoked: CancellationToken::new(),
            },
        );
        GrantGuard {
            grants: self.clone(),
            token,
            access: pb::HostAccess { endpoint: endpoint.to_owned(), grant: Some(grant) },
        }
    }

    fn budget(&self) -> Budget {
        Budget {
            in_flight: Arc::new(Semaphore::new(self.limits.in_flight_per_call)),
            calls: AtomicU32::new(0),
            llm_calls: AtomicU32::new(0),
        }
    }

    /// A callback of a live token allowing `operation` on `session_id`,
    /// within the grant's budget.
    pub fn authorise(
        &self,
        token: &str,
        session_id: Option<&str>,
        operation: HostOperation,
    ) -> Result<Callback, GrantError> {
        if token.is_empty() {
            return Err(GrantError::Missing);
        }
        let live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        let g = live.get(token).ok_or(GrantError::Unknown)?;
        if Instant::now() >= g.expires {
            return Err(GrantError::Expired);
        }
        if session_id.is_some_and(|s| s != g.scope.session_id) {
            return Err(GrantError::OtherSession);
        }
        if !g.scope.operations.contains(&operation) {
            return Err(GrantError::NotAllowed(operation));
        }
        let (b, l) = (&g.budget, &self.limits);
        let slot = b.in_flight.clone().try_acquire_owned().map_err(|_| Limit::InFlight(l.in_flight_per_call))?;
        if operation == HostOperation::LlmComplete && !Budget::spend(&b.llm_calls, l.llm_per_call) {
            return Err(Limit::LlmCalls(l.llm_per_call).into());
        }
        if !Budget::spend(&b.calls, l.per_call) {
            return Err(Limit::Calls(l.per_call).into());
        }
        Ok(Callback { scope: g.scope.clone(), revoked: g.revoked.clone(), _slot: slot })
    }

    /// One of `engine_id`'s model-call slots, if one is free.
    pub fn llm_slot(&self, engine_id: &str) -> Result<LlmSlot, GrantError> {
        let cap = self.limits.llm_concurrent_per_engine;
        let slots = {
            let mut map = self.llm.lock().unwrap_or_else(|e| e.into_inner());
            if map.len() >= MAX_LLM_ENGINES && !map.contains_key(engine_id) {
                map.retain(|_, s| s.available_permits() < cap);
            }
            map.entry(engine_id.to_owned()).or_insert_with(|| Arc::new(Semaphore::new(cap))).clone()
        };
        slots.try_acquire_owned().map(|p| LlmSlot { _permit: p }).map_err(|_| Limit::LlmConcurrent(cap).into())
    }
}

impl From<Limit> for GrantError {
    fn from(l: Limit) -> Self {
        Self::OverLimit(l)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_grant_covers_its_session_and_operations_until_dropped() {
        let grants = Arc::new(Grants::default());
        let scope = Scope {
            engine_id: "e".into(),
            session_id: "s1".into(),
            session_key: "k".into(),
            operations: vec![HostOperation::ReadTranscript],
            fence_before: None,
        };
        let g = grants.issue("http://h", scope, Duration::from_secs(60));
        let token = g.access.grant.as_ref().unwrap().token.clone();
        assert!(grants.authorise(&token, Some("s1"), HostOperation::ReadTranscript).is_ok());
        assert_eq!(
            grants.authorise(&token, Some("s2"), HostOperation::ReadTranscript).err(),
            Some(GrantError::OtherSession)
        );
        assert_eq!(
            grants.authorise(&token, None, HostOperation::LlmComplete).err(),
            Some(GrantError::NotAllowed(HostOperation::LlmComplete))
        );
        assert_eq!(grants.authorise("", None, HostOperation::LlmComplete).err(), Some(GrantError::Missing));
        drop(g);
        assert_eq!(
            grants.authorise(&token, Some("s1"), HostOperation::ReadTranscript).err(),
            Some(GrantError::Unknown)
        );
    }

    fn both_operations() -> Scope {
        Scope {
            engine_id: "e".into(),
            session_id: "s1".into(),
            session_key: "k".into(),
            operations: vec![HostOperation::ReadTranscript, HostOperation::LlmComplete],
            fence_before: None,
        }
    }

    #[tokio::test]
    async fn a_grant_spends_its_budget_and_then_is_refused_naming_the_limit() {
        let limits = HostCallbacks {
            in_flight_per_call: 2,
            per_call: 5,
            llm_per_call: 2,
            llm_concurrent_per_engine: 1,
            ..HostCallbacks::default()
        };
        let grants = Arc::new(Grants::new(limits));
        let g = grants.issue("http://h", both_operations(), Duration::from_secs(60));
        let token = g.access.grant.as_ref().unwrap().token.clone();
        let read = || grants.authorise(&token, Some("s1"), HostOperation::ReadTranscript);

        let (a, b) = (read().unwrap(), read().unwrap());
        assert_eq!(read().err(), Some(GrantError::OverLimit(Limit::InFlight(2))), "two at once");
        drop((a, b));
        let llm = || grants.authorise(&token, Some("s1"), HostOperation::LlmComplete).map(drop);
        assert!(llm().is_ok() && llm().is_ok());
        assert_eq!(llm().err(), Some(GrantError::OverLimit(Limit::LlmCalls(2))));
        assert!(read().is_ok(), "reads still count under perCall");
        assert_eq!(read().err(), Some(GrantError::OverLimit(Limit::Calls(5))));
        let message = GrantError::OverLimit(Limit::Calls(5)).to_string();
        assert!(message.contains("gateway.limits.hostCallbacks.perCall"), "{message}");

        // A new engine call has a new budget.
        let g2 = grants.issue("http://h", both_operations(), Duration::from_secs(60));
        let token2 = g2.access.grant.as_ref().unwrap().token.clone();
        assert!(grants.authorise(&token2, Some("s1"), HostOperation::ReadTranscript).is_ok());
    }

    #[test]
    fn an_engine_has_its_model_slots_across_its_calls() {
        let limits = HostCallbacks { llm_concurrent_per_engine: 2, ..HostCallbacks::default() };
        let grants = Grants::new(limits);
        let (a, _b) = (grants.llm_slot("e").unwrap(), grants.llm_slot("e").unwrap());
        assert!(matches!(grants.llm_slot("e"), Err(GrantError::OverLimit(Limit::LlmConcurrent(2)))));
        assert!(grants.llm_slot("other").is_ok(), "per engine");
        drop(a);
        assert!(grants.llm_slot("e").is_ok(), "a finished call frees its slot");
    }

    #[test]
    fn the_engines_slot_map_stays_bounded_and_keeps_the_slots_in_use() {
        let grants = Grants::new(HostCallbacks { llm_concurrent_per_engine: 1, ..HostCallbacks::default() });
        let busy = grants.llm_slot("busy").unwrap();
        // Engine ids come from the config, but a bound must not rest on that.
        for i in 0..2 * MAX_LLM_ENGINES {
            drop(grants.llm_slot(&format!("engine-{i}")).unwrap());
        }
        let kept = grants.llm.lock().unwrap().len();
        assert!(kept <= MAX_LLM_ENGINES, "{kept} engines' slots kept");
        assert!(
            matches!(grants.llm_slot("busy"), Err(GrantError::OverLimit(Limit::LlmConcurrent(1)))),
            "a slot in use was forgotten, and its engine got a fresh one"
        );
        drop(busy);
        assert!(grants.llm_slot("busy").is_ok());
    }
}
