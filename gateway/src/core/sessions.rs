//! Sessions as clients see them: look up, list, replace, delete (with the
//! engines that saw a deleted session told to forget it), and Abort.

use ctxgate_proto::pb::{self, transcript_entry::Entry};

use crate::core::{Core, CoreError, session_ref};
use crate::store::{PageOutcome, PageRequest, Session, SessionStats, plan_page};
use crate::transcript;

impl Core {
    /// Fires the running turn's or compaction's token (on a shared store,
    /// also another gateway's, at its next lease renewal). True if one ran.
    pub async fn abort(&self, agent: &str, key: &str) -> Result<bool, CoreError> {
        let Some(s) = self.store.session(agent, key, false).await? else { return Ok(false) };
        Ok(self.gate.abort(&s.session_id) || self.store.interrupt_holder(&s.session_id).await?)
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

    /// One page of a session's branch (or of the entries behind its visible
    /// history), read a page at a time from the store. `page.until` may
    /// name an entry or a message (a rewrite copies a message under a new
    /// entry id and keeps its message id): a message id is resolved on the
    /// whole branch, the one read that is not paged, and only then.
    pub async fn transcript_page(
        &self,
        session_id: &str,
        visible_only: bool,
        page: PageRequest,
    ) -> Result<PageOutcome, CoreError> {
        if !visible_only {
            match self.store.branch_page(session_id, page.clone()).await? {
                PageOutcome::UnknownUntil => {}
                found => return Ok(found),
            }
        }
        // The visible entries are bounded by the context window.
        let entries = if visible_only {
            transcript::visible_entries(&self.store.visible_tail(session_id).await?)
        } else {
            self.store.branch(session_id).await?
        };
        Ok(page_of(entries, page))
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

    /// `/new` (archive = false) or `/reset` (archive = true), under the
    /// active session's lock and, on a shared store, its lease: a turn
    /// running on any gateway ends first (the reset waits in the session's
    /// queue, as a turn would), so the session put away is final, and the
    /// write is fenced like every other write of the session.
    pub async fn replace_session(&self, agent: &str, key: &str, archive: bool) -> Result<Session, CoreError> {
        let (agent, key) = session_ref(agent, key)?;
        let cancel = self.call_token();
        let _guard = match self.store.session(&agent, &key, false).await? {
            Some(active) => Some(self.gate.enter(&active.session_id, &cancel, true).await?),
            None => None,
        };
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
        let children = self.store.children_of(&agent, &key).await?;
        let mut guards = Vec::new();
        for session_id in &ids {
            guards.push(self.gate.enter(session_id, &cancel, false).await?);
        }
        let deleted = self.store.delete_sessions(&agent, &key).await?;
        drop(guards);
        if deleted == 0 {
            return Err(CoreError::NoSession(key));
        }
        // Its subagents end with it ("released": the engine hears of each),
        // and stay sessions of their own: deleting one key never deletes
        // another's transcript; each child can be deleted by its key.
        for child in children.iter().filter(|c| c.child_key != key) {
            if let Err(e) = self.end_subagent(&agent, &child.child_key, "released", cancel.clone()).await {
                tracing::warn!(child = %child.child_key, error = %e, "ending a deleted parent's subagent failed; its ttl ends it");
            }
        }
        // This delete's forgets, best effort now (others' wait for the
        // background pass, which also retries these).
        if let Err(e) = self.delivery.deliver_forgets(Some(&ids)).await {
            tracing::warn!(error = %e, "ForgetSession delivery failed; retried in the background");
        }
        Ok(deleted)
    }

    pub async fn count_sessions(&self) -> Result<u32, CoreError> {
        Ok(self.store.count_sessions().await?)
    }
}

/// [`Core::transcript_page`] over entries in memory; `until` may name a
/// message.
fn page_of(mut entries: Vec<pb::TranscriptEntry>, mut page: PageRequest) -> PageOutcome {
    if let Some(until) = &page.until {
        let names =
            |e: &pb::TranscriptEntry| &e.id == until || matches!(&e.entry, Some(Entry::Message(m)) if &m.id == until);
        match entries.iter().find(|e| names(e)) {
            Some(e) => page.until = Some(e.id.clone()),
            None => return PageOutcome::UnknownUntil,
        }
    }
    let sizes: Vec<(String, usize)> = entries.iter().map(|e| (e.id.clone(), prost::Message::encoded_len(e))).collect();
    let (ids, more) = match plan_page(&sizes, &page) {
        Ok(planned) => planned,
        Err(miss) => return miss,
    };
    let start = ids.first().and_then(|first| entries.iter().position(|e| &e.id == first)).unwrap_or(0);
    entries.drain(..start);
    entries.truncate(ids.len());
    PageOutcome::Page { entries, more }
}

#[cfg(test)]
mod tests {
    use ctxgate_proto::pb::{self, transcript_entry::Entry};

    use super::page_of;
    use crate::store::{PageOutcome, PageRequest};

    fn entries(n: usize) -> Vec<pb::TranscriptEntry> {
        (0..n).map(|i| pb::TranscriptEntry { id: format!("e{i}"), seq: i as u64 + 1, ..Default::default() }).collect()
    }

    fn ids(outcome: &PageOutcome) -> (Vec<String>, bool) {
        match outcome {
            PageOutcome::Page { entries, more } => (entries.iter().map(|e| e.id.clone()).collect(), *more),
            other => panic!("not a page: {other:?}"),
        }
    }

    fn request(after: Option<&str>, until: Option<&str>, limit: usize) -> PageRequest {
        PageRequest { after: after.map(Into::into), until: until.map(Into::into), limit, max_bytes: usize::MAX }
    }

    #[test]
    fn the_fence_hides_the_admitted_entry_and_what_follows() {
        let (got, more) = ids(&page_of(entries(5), request(None, Some("e3"), 100)));
        assert_eq!(got, ["e0", "e1", "e2"]);
        assert!(!more, "nothing follows before the fence");
    }

    #[test]
    fn the_fence_follows_a_copied_message_and_fails_closed_without_it() {
        // A rewrite copied e3 under a new entry id; its message id stays "e3".
        let mut copied = entries(5);
        copied[3].id = "copy-of-e3".into();
        copied[3].entry = Some(Entry::Message(pb::AgentMessage { id: "e3".into(), ..Default::default() }));
        assert_eq!(ids(&page_of(copied, request(None, Some("e3"), 100))).0, ["e0", "e1", "e2"]);
        assert_eq!(page_of(entries(5), request(None, Some("elsewhere"), 100)), PageOutcome::UnknownUntil);
    }

    #[test]
    fn a_cursor_and_a_limit_page_through_everything() {
        let (first, more) = ids(&page_of(entries(300), request(None, None, 200)));
        assert_eq!((first.len(), more), (200, true));
        let (rest, more) = ids(&page_of(entries(300), request(Some("e199"), None, 200)));
        assert_eq!(rest.first().map(String::as_str), Some("e200"));
        assert_eq!((rest.len(), more), (100, false));
        assert_eq!(page_of(entries(3), request(Some("nope"), None, 10)), PageOutcome::UnknownAfter);
    }

    #[test]
    fn a_page_stops_at_its_byte_cap_but_always_makes_progress() {
        let mut big = entries(10);
        for e in &mut big {
            let text = pb::ContentPart { part: Some(pb::content_part::Part::Text("x".repeat(1000))) };
            e.entry =
                Some(Entry::Message(pb::AgentMessage { id: e.id.clone(), content: vec![text], ..Default::default() }));
        }
        let capped = PageRequest { max_bytes: 2_500, ..request(None, None, 100) };
        let (got, more) = ids(&page_of(big.clone(), capped));
        assert_eq!((got.len(), more), (2, true), "two ~1 KB entries fit 2.5 KB");
        let tiny = PageRequest { max_bytes: 1, ..request(None, None, 100) };
        assert_eq!(ids(&page_of(big, tiny)).0.len(), 1, "one entry over the cap is still read alone");
    }
}
