//! Sessions as clients see them: look up, list, replace, delete (with the
//! engines that saw a deleted session told to forget it), and Abort.

use ctxgate_proto::pb::{self, transcript_entry::Entry};

use crate::core::{Core, CoreError, session_ref};
use crate::store::{Session, SessionStats};
use crate::transcript;

impl Core {
    /// Fires the running turn's or compaction's token (on a shared store,
    /// also another gateway's, at its next lease renewal). True if one ran.
    pub async fn abort(&self, agent: &str, key: &str) -> Result<bool, CoreError> {
        let Some(s) = self.store.session(agent, key, false).await? else { return Ok(false) };
        Ok(self.locks.abort(&s.session_id) || self.store.interrupt_holder(&s.session_id).await?)
    }

    pub async fn session(&self, agent: &str, key: &str) -> Result<Session, CoreError> {
        let (agent, key) = session_ref(agent, key)?;
        self.store.session(&agent, &key, false).await?.ok_or(CoreError::NoSession(key))
    }

    /// A session's branch, or only the entries behind its visible history.
    pub async fn transcript(
        &self,
        session_id: &str,
        visible_only: bool,
    ) -> Result<Vec<pb::TranscriptEntry>, CoreError> {
        let branch = self.store.branch(session_id).await?;
        Ok(if visible_only { transcript::visible_entries(&branch) } else { branch })
    }

    /// Entries on the branch, compactions among them, and visible tokens.
    pub async fn session_counts(&self, s: &Session) -> Result<(u32, u32, u64), CoreError> {
        let branch = self.store.branch(&s.session_id).await?;
        let compactions = branch.iter().filter(|e| matches!(e.entry, Some(Entry::Compaction(_)))).count() as u32;
        Ok((branch.len() as u32, compactions, transcript::visible(&branch).tokens()))
    }

    pub async fn list_sessions(
        &self,
        agent: Option<&str>,
        include_archived: bool,
        offset: u64,
        limit: u32,
    ) -> Result<Vec<SessionStats>, CoreError> {
        Ok(self.store.list_sessions(agent, include_archived, offset, limit).await?)
    }

    /// `/new` (archive = false) or `/reset` (archive = true).
    pub async fn replace_session(&self, agent: &str, key: &str, archive: bool) -> Result<Session, CoreError> {
        let (agent, key) = session_ref(agent, key)?;
        Ok(self.store.replace_session(&agent, &key, archive).await?)
    }

    /// Aborts what runs and deletes every session of the key with its
    /// queued commits; then tells the engines that saw it to forget it.
    pub async fn delete_sessions(&self, agent: &str, key: &str) -> Result<u32, CoreError> {
        let (agent, key) = session_ref(agent, key)?;
        self.abort(&agent, &key).await?;
        let cancel = self.call_token();
        // Under every session's lock: no turn or delivery of the key runs
        // while its rows go, so nothing reaches an engine after its forget.
        let ids = self.store.session_ids(&agent, &key).await?;
        let mut guards = Vec::new();
        for session_id in &ids {
            guards.push(self.enter(session_id, &cancel, false).await?);
        }
        let deleted = self.store.delete_sessions(&agent, &key).await?;
        drop(guards);
        if deleted == 0 {
            return Err(CoreError::NoSession(key));
        }
        // This delete's forgets, best effort now (others' wait for the
        // background pass, which also retries these).
        if let Err(e) = self.deliver_forgets(Some(&ids)).await {
            tracing::warn!(error = %e, "ForgetSession delivery failed; retried in the background");
        }
        Ok(deleted)
    }

    pub async fn count_sessions(&self) -> Result<u32, CoreError> {
        Ok(self.store.count_sessions().await?)
    }
}
