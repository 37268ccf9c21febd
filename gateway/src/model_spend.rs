//! What engines spend on the host's model, in tokens. The host's model is
//! the operator's money: an engine may ask it for summaries
//! (Host.LlmComplete), and the calls a grant allows (`llmPerCall`) renew
//! with every engine call, so without a meter an engine could spend
//! without end. Each engine gets `llmTokensPerEnginePerHour` tokens an
//! hour (a window that starts with its first call and runs an hour). A
//! call reserves what it may cost before it reaches the model — its
//! prompt's estimated tokens and the most output it may get — and is
//! settled to what the model reports it used; a call the model fails
//! gives its reservation back. One that would pass the budget is refused
//! (RESOURCE_EXHAUSTED) with the time until the window ends.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

/// How long one budget lasts.
pub const WINDOW: Duration = Duration::from_secs(3600);

/// Engines whose windows are remembered at most; past it, those whose
/// window ended are forgotten (engine ids come from the configuration,
/// so this is a backstop).
const MAX_ENGINES: usize = 1024;

/// Each engine's model tokens in its current window.
pub struct ModelSpend {
    per_window: u64,
    engines: Mutex<HashMap<String, Window>>,
}

struct Window {
    start: Instant,
    used: u64,
}

/// A call refused: its engine's budget would be passed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "engine {engine} has used {used} of its {budget} model tokens this hour and this call may need {asked} \
     (gateway.limits.hostCallbacks.llmTokensPerEnginePerHour); retry in {retry_secs} s"
)]
pub struct OverBudget {
    pub engine: String,
    pub used: u64,
    pub budget: u64,
    pub asked: u64,
    pub retry_secs: u64,
}

/// Tokens set aside for one model call until it is settled; given back
/// when dropped unsettled (the call failed or was cancelled).
pub struct Reserved {
    spend: Arc<ModelSpend>,
    engine: String,
    tokens: u64,
}

impl ModelSpend {
    pub fn new(per_window: u64) -> Self {
        Self { per_window, engines: Mutex::default() }
    }

    fn windows(&self) -> std::sync::MutexGuard<'_, HashMap<String, Window>> {
        self.engines.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sets `tokens` aside for a call of `engine`, or refuses it.
    pub fn reserve(self: &Arc<Self>, engine: &str, tokens: u64) -> Result<Reserved, OverBudget> {
        let now = Instant::now();
        let mut windows = self.windows();
        if windows.len() >= MAX_ENGINES && !windows.contains_key(engine) {
            windows.retain(|_, w| now.saturating_duration_since(w.start) < WINDOW);
        }
        let w = windows.entry(engine.to_owned()).or_insert(Window { start: now, used: 0 });
        if now.saturating_duration_since(w.start) >= WINDOW {
            *w = Window { start: now, used: 0 };
        }
        if w.used.saturating_add(tokens) > self.per_window {
            let left = WINDOW.saturating_sub(now.saturating_duration_since(w.start));
            return Err(OverBudget {
                engine: engine.to_owned(),
                used: w.used,
                budget: self.per_window,
                asked: tokens,
                retry_secs: left.as_secs().max(1),
            });
        }
        w.used += tokens;
        Ok(Reserved { spend: self.clone(), engine: engine.to_owned(), tokens })
    }

    /// Tokens `engine` has used in its current window.
    pub fn used(&self, engine: &str) -> u64 {
        let now = Instant::now();
        self.windows().get(engine).filter(|w| now.saturating_duration_since(w.start) < WINDOW).map_or(0, |w| w.used)
    }

    fn adjust(&self, engine: &str, reserved: u64, used: u64) {
        if let Some(w) = self.windows().get_mut(engine) {
            w.used = w.used.saturating_sub(reserved).saturating_add(used);
        }
    }
}

impl Reserved {
    /// The call cost `used` tokens (what the model reported), in place of
    /// what was set aside.
    pub fn settle(mut self, used: u64) {
        self.spend.adjust(&self.engine, self.tokens, used);
        self.tokens = 0;
    }
}

impl Drop for Reserved {
    fn drop(&mut self) {
        if self.tokens > 0 {
            self.spend.adjust(&self.engine, self.tokens, 0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn an_engine_spends_its_budget_in_an_hour_and_gets_it_back_after() {
        let spend = Arc::new(ModelSpend::new(1_000));
        spend.reserve("e", 600).unwrap().settle(400);
        assert_eq!(spend.used("e"), 400, "settled to what the model used");
        let refused = spend.reserve("e", 700).err().expect("400 + 700 > 1,000");
        assert_eq!((refused.used, refused.asked, refused.retry_secs), (400, 700, 3600));
        assert!(refused.to_string().contains("llmTokensPerEnginePerHour"), "{refused}");
        assert!(spend.reserve("other", 1_000).is_ok(), "per engine");
        tokio::time::advance(Duration::from_secs(1800)).await;
        assert_eq!(spend.reserve("e", 700).err().map(|o| o.retry_secs), Some(1800));
        tokio::time::advance(WINDOW).await;
        assert!(spend.reserve("e", 1_000).is_ok(), "a new window");
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_call_gives_its_reservation_back_and_one_in_flight_counts() {
        let spend = Arc::new(ModelSpend::new(1_000));
        let in_flight = spend.reserve("e", 800).unwrap();
        assert!(spend.reserve("e", 300).is_err(), "the call in flight holds its reservation");
        drop(in_flight);
        assert_eq!(spend.used("e"), 0);
        assert!(spend.reserve("e", 1_001).is_err(), "a call bigger than the budget never runs");
    }
}
