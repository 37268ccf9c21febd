//! Grants: what an engine may do when it calls the gateway back. A grant
//! covers one session, the call's operations, and the call's deadline; it is
//! revoked the moment its engine call returns, so no engine can act on a
//! session outside a call for it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ctxgate_proto::pb;
use tokio::time::Instant;

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
            operations: scope.operations.iter().map(|o| o.as_str().to_owned()).collect(),
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
    pub fn authorise(
        &self,
        token: &str,
        session_id: Option<&str>,
        operation: HostOperation,
    ) -> Result<Scope, GrantError> {
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
        Ok(g.scope.clone())
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
}
