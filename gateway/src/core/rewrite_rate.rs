//! How often maintenance may rewrite a session. An engine's Maintain may
//! replace stored messages after every turn, and each rewrite copies the
//! branch from the first message it replaces (the old branch stays for
//! audit): an engine rewriting an early message every turn would grow
//! storage with the square of the session. So each session takes at most
//! `maintainRewritesPerSessionPerHour` applied rewrites in an hour (a
//! window from its first); more are refused and the transcript stays.

use std::collections::HashMap;
use std::time::Duration;

use tokio::time::Instant;

/// How long one session's allowance lasts.
pub const WINDOW: Duration = Duration::from_secs(3600);

/// Sessions whose windows are remembered at most: past it, ended windows
/// are forgotten, then the oldest.
const MAX_SESSIONS: usize = 4096;

pub struct RewriteRate {
    per_window: u32,
    sessions: HashMap<String, (Instant, u32)>,
}

impl RewriteRate {
    pub fn new(per_window: u32) -> Self {
        Self { per_window, sessions: HashMap::new() }
    }

    /// Whether `session` may have one more rewrite now (not counted yet).
    pub fn allows(&self, session: &str) -> bool {
        let now = Instant::now();
        match self.sessions.get(session) {
            Some(&(start, n)) if now.saturating_duration_since(start) < WINDOW => n < self.per_window,
            _ => self.per_window > 0,
        }
    }

    /// Counts a rewrite applied to `session`.
    pub fn applied(&mut self, session: &str) {
        let now = Instant::now();
        if self.sessions.len() >= MAX_SESSIONS && !self.sessions.contains_key(session) {
            self.sessions.retain(|_, (start, _)| now.saturating_duration_since(*start) < WINDOW);
            if self.sessions.len() >= MAX_SESSIONS
                && let Some(oldest) = self.sessions.iter().min_by_key(|(_, (start, _))| *start).map(|(k, _)| k.clone())
            {
                self.sessions.remove(&oldest);
            }
        }
        let w = self.sessions.entry(session.to_owned()).or_insert((now, 0));
        if now.saturating_duration_since(w.0) >= WINDOW {
            *w = (now, 0);
        }
        w.1 += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_session_takes_its_rewrites_an_hour_and_others_theirs() {
        let mut rate = RewriteRate::new(2);
        for _ in 0..2 {
            assert!(rate.allows("s"));
            rate.applied("s");
        }
        assert!(!rate.allows("s"), "the third in the hour");
        assert!(rate.allows("t"), "per session");
        tokio::time::advance(WINDOW).await;
        assert!(rate.allows("s"), "a new hour");
        assert!(!RewriteRate::new(0).allows("s"), "0: no rewrites");
    }

    #[tokio::test(start_paused = true)]
    async fn the_sessions_remembered_stay_bounded() {
        let mut rate = RewriteRate::new(1);
        for i in 0..MAX_SESSIONS + 10 {
            rate.applied(&format!("s{i}"));
            tokio::time::advance(Duration::from_millis(1)).await;
        }
        assert!(rate.sessions.len() <= MAX_SESSIONS);
        assert!(!rate.allows(&format!("s{}", MAX_SESSIONS + 9)), "the newest are kept");
    }
}
