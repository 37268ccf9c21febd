//! What engines spend on the host's model, in tokens. The host's model is
//! the operator's money: an engine may ask it for summaries
//! (Host.LlmComplete), and the calls a grant allows (`llmPerCall`) renew
//! with every engine call, so without a meter an engine could spend
//! without end. Each engine gets `llmTokensPerEnginePerHour` tokens an
//! hour (a window that starts with its first call and runs an hour). A
//! call reserves what it may cost before it reaches the model — its
//! prompt's estimated tokens and the most output it may get — and is
//! settled to what the model reports it used; a call that fails or is
//! cancelled once sent is charged its prompt (the model may have read it:
//! an engine cannot spend by hanging up). One that would pass the budget
//! is refused (RESOURCE_EXHAUSTED) with the time until the window ends;
//! one larger than the whole budget, saying so.

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
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OverBudget {
    pub engine: String,
    pub used: u64,
    pub budget: u64,
    pub asked: u64,
    pub retry_secs: u64,
}

impl std::fmt::Display for OverBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        const KEY: &str = "gateway.limits.hostCallbacks.llmTokensPerEnginePerHour";
        let (engine, asked, budget) = (&self.engine, self.asked, self.budget);
        if asked > budget {
            write!(f, "this call may need {asked} model tokens, more than engine {engine}'s {budget} an hour ({KEY})")
        } else {
            let (used, retry) = (self.used, self.retry_secs);
            write!(
                f,
                "engine {engine} has used {used} of its {budget} model tokens this hour and this call may need {asked} ({KEY}); retry in {retry} s"
            )
        }
    }
}

impl std::error::Error for OverBudget {}

/// Tokens set aside for one model call until it is settled. Dropped
/// unsettled (the call failed or was cancelled), it charges its floor: 0
/// until [`Reserved::sent`], the prompt after.
pub struct Reserved {
    spend: Arc<ModelSpend>,
    engine: String,
    /// The window it was reserved in: settling in a later one leaves that
    /// one alone (its reservation went with its window).
    window: Instant,
    tokens: u64,
    floor: u64,
    settled: bool,
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
        Ok(Reserved {
            spend: self.clone(),
            engine: engine.to_owned(),
            window: w.start,
            tokens,
            floor: 0,
            settled: false,
        })
    }

    /// Tokens `engine` has used in its current window.
    pub fn used(&self, engine: &str) -> u64 {
        let now = Instant::now();
        self.windows().get(engine).filter(|w| now.saturating_duration_since(w.start) < WINDOW).map_or(0, |w| w.used)
    }

    /// What was set aside in `window` becomes `used`.
    fn adjust(&self, engine: &str, window: Instant, reserved: u64, used: u64) {
        if let Some(w) = self.windows().get_mut(engine).filter(|w| w.start == window) {
            w.used = w.used.saturating_sub(reserved).saturating_add(used);
        }
    }
}

impl Reserved {
    /// The request is on its way with a prompt of `prompt` tokens: from
    /// now on, the least it is charged.
    pub fn sent(&mut self, prompt: u64) {
        self.floor = prompt.min(self.tokens);
    }

    /// The call cost `used` tokens (what the model reported), in place of
    /// what was set aside.
    pub fn settle(mut self, used: u64) {
        self.spend.adjust(&self.engine, self.window, self.tokens, used);
        self.settled = true;
    }
}

impl Drop for Reserved {
    fn drop(&mut self) {
        if !self.settled {
            self.spend.adjust(&self.engine, self.window, self.tokens, self.floor);
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
    async fn a_call_that_fails_costs_nothing_before_it_is_sent_and_its_prompt_after() {
        let spend = Arc::new(ModelSpend::new(1_000));
        let in_flight = spend.reserve("e", 800).unwrap();
        assert!(spend.reserve("e", 300).is_err(), "the call in flight holds its reservation");
        drop(in_flight);
        assert_eq!(spend.used("e"), 0, "never sent: given back");
        let mut sent = spend.reserve("e", 800).unwrap();
        sent.sent(300);
        drop(sent);
        assert_eq!(spend.used("e"), 300, "sent, then dropped (the engine hung up): its prompt is charged");
        let too_big = spend.reserve("e", 1_001).err().expect("a call bigger than the budget never runs");
        assert!(too_big.to_string().contains("more than engine e's 1000 an hour"), "{too_big}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_settled_in_the_next_window_leaves_that_window_alone() {
        let spend = Arc::new(ModelSpend::new(1_000));
        let old = spend.reserve("e", 500).unwrap();
        tokio::time::advance(WINDOW).await;
        let new = spend.reserve("e", 600).unwrap();
        old.settle(100);
        assert_eq!(spend.used("e"), 600, "the new window keeps its own reservation");
        new.settle(50);
        assert_eq!(spend.used("e"), 50);
    }
}
