//! Admission control: the gateway sheds a new turn at once (with a retry
//! pushback) only when its own work has slowed down with load — never
//! because turns are merely open.
//!
//! What counts is *work*: a turn is working while the gateway (its store,
//! its engines, its compaction, the engines' host callbacks) acts for it
//! or it waits to start — behind its session's running turn too: a queue
//! is a queue wherever it forms — and away while it waits on things the
//! gateway does not control: the model's answer in a managed turn, the
//! client's next step in a harness turn ([`Permit::away`],
//! [`Permit::back`]). A thousand turns waiting on their models cost memory
//! (bounded by `maxConcurrentTurns`), not work. Turns admitted and not
//! started are bounded too (`maxWaitingTurns`).
//!
//! Each turn's *gateway latency* — arrival to release, minus its time away,
//! its wait to start included — is a sample; samples close a window (≥ 100 ms and ≥ 10 samples,
//! or 1 s). The baseline is what the gateway's work takes when it is not
//! congested, learned from traffic as it comes: the first window sets it,
//! a faster full window lowers it at once, a slower healthy one raises it
//! a little (so histories that grow longer are not mistaken for load).
//!
//! - **Open** (the start, and normal service): nothing is shed below
//!   `maxConcurrentTurns`. A window whose p90 exceeds tolerance × baseline
//!   while more than `minLimit` turns were working *and* two windows in a
//!   row ended with more work than the one before ever had (by `minLimit`)
//!   — latency rising because arrivals outrun the gateway, a queue that
//!   would grow without bound — starts limiting at that work times
//!   tolerance × baseline / p90 (the work it does within tolerance, by
//!   Little's law), at least `minLimit`. Slowness with a steady
//!   amount of work (a closed loop of clients, however many: each waits for
//!   its answer before it asks again) is not shed once the loop has
//!   arrived (clients that keep joining over several slow windows look like
//!   growth); with little work it is not load at all, and the baseline
//!   moves. A queue growing by less than `minLimit`, or less than twice
//!   the square root of the turns the window ended (a busy window's
//!   jitter), is not seen: `maxConcurrentTurns` bounds it. A window that
//!   refused turns at `maxConcurrentTurns` or `maxWaitingTurns` grew too:
//!   a queue that filled to a cap and stays there grows past it.
//! - **A surge** is seen sooner, at admission: six 5 ms ticks or more in a
//!   row that each admit more than twice what they end while work grows
//!   (a tick closed late, on a busy gateway, counts within a streak for
//!   each tick it spans if its arrivals came at a surge's rate),
//!   lasting tolerance × baseline at least (long enough for a gateway that
//!   keeps up to end as many as arrive), with turns arriving at more than
//!   twice the *pace* (the turns a second the gateway ended in its recent
//!   healthy windows), work that at least doubled, and a new turn's wait
//!   by Little's law (working / ending rate) past tolerance × baseline. It
//!   starts limiting at once, at the work the gateway ends within
//!   tolerance (Little's law again), `minLimit` at least. A burst
//!   shorter than the ticks, a closed loop (it cannot double), a stall (it
//!   brings no more turns) and more demand on a gateway with room for it
//!   (its turns end within tolerance) are not surges.
//! - **Limiting** (real overload): a new turn is shed while the working
//!   turns reach the limit, and so is a turn admitted before the limit fell
//!   that has not started yet, while more turns work than the limit allows
//!   ([`Permit::admitted`]; while the ticks look like a surge's first ones,
//!   a turn about to start waits for it, [`HOLD_MAX`] at most). An
//!   over-tolerance window cuts the limit again;
//!   a healthy one whose limit was used grows it by √limit; when the limit
//!   passes `maxConcurrentTurns`, or ten healthy windows find demand under
//!   half of it, or no turn ends for ten seconds, the gateway is Open
//!   again. The baseline does not rise while limiting, except when the
//!   floor itself is as slow, [`FLOOR_WINDOWS`](gradient::FLOOR_WINDOWS) windows in a row (the work
//!   got slower, not the gateway busier); limiting again (a surge, or a
//!   queue growing) within [`REFUTE_WITHIN`](gradient::REFUTE_WITHIN) with turns ending at least at
//!   the pace refutes that: the old baseline comes back and the floor
//!   stays shut for [`FLOOR_SHUT`](gradient::FLOOR_SHUT).
//!
//! With `adaptiveConcurrency.enabled: false` only `maxConcurrentTurns`
//! bounds turns.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use crate::config::LimitsSection;

mod gradient;

use gradient::{Gradient, HOLD_MAX, TICK};

/// Turns open and working, and the limiter.
pub struct Admission {
    state: Mutex<State>,
}

struct State {
    gradient: Gradient,
    /// Turns holding a permit (at most `maxConcurrentTurns`).
    open: usize,
    /// Of those, the ones not away (see [`Permit::away`]).
    working: usize,
    /// Of those, the ones not started yet (at most `maxWaitingTurns`).
    waiting: usize,
    max_waiting: usize,
}

/// Why a turn was not admitted, and when to retry.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shed {
    pub why: ShedReason,
    /// The turn limit then.
    pub limit: usize,
    pub retry_after: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShedReason {
    /// `maxConcurrentTurns` turns are open.
    Open,
    /// `maxWaitingTurns` turns wait to start.
    Waiting,
    /// The gateway limits turns: its work slowed down with load.
    Limiting,
}

impl std::fmt::Display for Shed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (limit, retry) = (self.limit, self.retry_after.as_millis());
        match self.why {
            ShedReason::Open => write!(
                f,
                "the gateway is at its limit of {limit} open turns (gateway.limits.maxConcurrentTurns); retry in {retry} ms"
            ),
            ShedReason::Waiting => write!(
                f,
                "the gateway has {limit} turns waiting to start (gateway.limits.maxWaitingTurns); retry in {retry} ms"
            ),
            ShedReason::Limiting => write!(
                f,
                "the gateway is overloaded: at its limit of {limit} concurrent turns for now; retry in {retry} ms"
            ),
        }
    }
}

impl Admission {
    pub fn new(l: &LimitsSection) -> Self {
        Self {
            state: Mutex::new(State {
                gradient: Gradient::new(l),
                open: 0,
                working: 0,
                waiting: 0,
                max_waiting: l.max_waiting_turns,
            }),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A permit, or `Shed` at once: at `maxConcurrentTurns` open turns, at
    /// `maxWaitingTurns` turns waiting to start, or while limiting with the
    /// limit's worth of turns working.
    pub fn try_admit(self: &Arc<Self>) -> Result<Permit, Shed> {
        let now = Instant::now();
        let mut s = self.state();
        let n = s.working;
        s.gradient.arriving(now, n);
        let max = s.gradient.max as usize;
        let limit = s.gradient.limit();
        let refused = if s.open >= max {
            Some((ShedReason::Open, max))
        } else if s.waiting >= s.max_waiting {
            Some((ShedReason::Waiting, s.max_waiting))
        } else if s.gradient.limiting() && s.working >= limit {
            Some((ShedReason::Limiting, limit))
        } else {
            None
        };
        if let Some((why, limit)) = refused {
            if why != ShedReason::Limiting {
                s.gradient.refused_at_cap += 1;
            }
            return Err(Shed { why, limit, retry_after: s.gradient.pushback() });
        }
        s.open += 1;
        s.working += 1;
        s.waiting += 1;
        let n = s.working;
        s.gradient.busy(n);
        s.gradient.admitted();
        Ok(Permit {
            admission: self.clone(),
            arrived: now,
            started: now,
            outside: Duration::ZERO,
            away_since: None,
            limit,
            counts: false,
        })
    }

    /// (turns working, current limit).
    pub fn load(&self) -> (usize, usize) {
        let s = self.state();
        (s.working, s.gradient.limit())
    }
}

/// One admitted turn; its release is the limiter's sample.
pub struct Permit {
    admission: Arc<Admission>,
    arrived: Instant,
    started: Instant,
    /// Time away so far (not the gateway's latency).
    outside: Duration,
    away_since: Option<Instant>,
    limit: usize,
    /// Whether its release is a sample (see [`Permit::admitted`]).
    counts: bool,
}

impl Permit {
    /// The limit this turn was admitted under.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// The turn holds its session and is about to do its first durable
    /// work: its latency counts from now. A permit dropped before this (the
    /// turn was refused) is no sample.
    ///
    /// Refused here instead, like a turn shed on arrival, while the gateway
    /// limits and more turns work than the limit allows: the limit fell
    /// after this turn was admitted — a surge is seen only some ticks into
    /// it, a window cuts the limit — and the turn has done nothing yet that
    /// a refusal loses. Turns admitted in a flood's first ticks would
    /// otherwise all run at once behind it, the slowest of the phase. So
    /// while the ticks look like a surge's first ones, the turn waits a tick
    /// at a time ([`HOLD_MAX`] at most) for the surge to be seen or the
    /// streak to end: a burst's turns start a few milliseconds later, a
    /// flood's are refused.
    pub async fn admitted(&mut self) -> Result<Duration, Shed> {
        let (since, mut waited) = (Instant::now(), false);
        loop {
            {
                let s = self.admission.state();
                // Only a limit that fell since the turn was admitted: a turn
                // admitted under this one, back from waiting for its session
                // into a slot a newer turn took, is not refused.
                if s.gradient.refuses_start(s.working, self.limit) {
                    let limit = s.gradient.limit();
                    return Err(Shed { why: ShedReason::Limiting, limit, retry_after: s.gradient.pushback() });
                }
                let now = Instant::now();
                if now.saturating_duration_since(since) >= HOLD_MAX || !s.gradient.suspect(now) {
                    break;
                }
            }
            tokio::time::sleep(TICK.min(HOLD_MAX.saturating_sub(since.elapsed()))).await;
            waited = true;
        }
        if waited {
            let waited = since.elapsed();
            tracing::debug!(target: "ctxgate::admission", ?waited, "a turn waited to start: the ticks looked like a surge");
        }
        // Its sample runs from its arrival: the wait to start (behind its
        // session, or held) is the gateway's latency too.
        if !self.counts {
            self.counts = true;
            let mut s = self.admission.state();
            s.waiting = s.waiting.saturating_sub(1);
        }
        Ok(self.arrived.elapsed())
    }

    /// The turn waits on something outside the gateway (the model, the
    /// client) until [`Permit::back`]: it is not working meanwhile, and
    /// the wait is not part of its sample.
    pub fn away(&mut self) {
        if self.away_since.is_none() {
            self.away_since = Some(Instant::now());
            let mut s = self.admission.state();
            s.working = s.working.saturating_sub(1);
        }
    }

    /// The wait ended: the turn works again (never shed: it was admitted).
    pub fn back(&mut self) {
        if let Some(since) = self.away_since.take() {
            self.outside += since.elapsed();
            let mut s = self.admission.state();
            s.working += 1;
            let n = s.working;
            s.gradient.busy(n);
        }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let now = Instant::now();
        let away = self.away_since.take();
        let outside = self.outside + away.map_or(Duration::ZERO, |a| now.saturating_duration_since(a));
        let latency = now.saturating_duration_since(self.started).saturating_sub(outside);
        let mut s = self.admission.state();
        let n = s.working;
        s.gradient.ending(now, n);
        s.open = s.open.saturating_sub(1);
        if !self.counts {
            s.waiting = s.waiting.saturating_sub(1);
        }
        if away.is_none() {
            s.working = s.working.saturating_sub(1);
        }
        let n = s.working;
        if self.counts {
            s.gradient.sample(latency, now, n);
        }
    }
}

#[cfg(test)]
mod tests;
