//! Admission control for turns: a limit on turns in flight that follows
//! measured latency (a gradient limiter, after Envoy's adaptive concurrency
//! filter and Netflix's Gradient), so admitted turns stay fast under any
//! offered load and the excess is shed at once instead of queued.
//!
//! Each turn's *gateway latency* is a sample: its time from admission to
//! release, minus the time it spent waiting on things the gateway does not
//! control (the model's answer in a managed turn, the client's next step in
//! a harness turn).
//!
//! A turn counts from the moment it holds its session (waiting behind the
//! session's running turn is that turn's time, not the gateway's); a turn
//! refused before that (busy, no session, unmet host requirements) is no
//! sample at all.
//!
//! The baseline is the p90 latency at low concurrency, measured by a probe
//! (as Envoy's filter measures its minRTT): at start, and every 30 s while
//! the last window was over tolerance, the limit drops to `minLimit` until
//! 20 turns admitted under it have ended or 2 s passed (whichever comes
//! first; without samples the old baseline stays), their p90 becomes the
//! baseline and the limit is restored. A baseline taken while the gateway
//! is congested would make the congestion look normal; re-measuring only
//! when congested means a gateway whose turns hold permits for a long time
//! (slow models) is not squeezed to `minLimit` every 30 s for nothing.
//! Between probes, every window (≥ 100 ms and ≥ 10 samples, or 1 s)
//! compares its p90 with the baseline (and lowers the baseline when a full
//! window was faster):
//!
//! - p90 ≤ tolerance × baseline, and the limit was used (at least half of
//!   it in flight): the limit grows by √limit;
//! - p90 above it: the limit shrinks by tolerance × baseline / p90 (at
//!   most halving it).
//!
//! The limit stays between `minLimit` and `maxConcurrentTurns`. With
//! `adaptiveConcurrency.enabled: false` the limit is `maxConcurrentTurns`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use crate::config::LimitsSection;

/// A window closes after this long once it has [`MIN_SAMPLES`]…
const WINDOW: Duration = Duration::from_millis(100);
const MIN_SAMPLES: usize = 10;
/// …or after this long with any samples at all.
const MAX_WINDOW: Duration = Duration::from_secs(1);
/// Samples kept per window (more are dropped: the p90 of 1024 is enough).
const MAX_SAMPLES: usize = 1024;
/// How often the baseline is measured again, and with how many turns (or
/// for how long at most).
const PROBE_EVERY: Duration = Duration::from_secs(30);
const PROBE_SAMPLES: usize = 20;
const PROBE_MAX: Duration = Duration::from_secs(2);

#[derive(Debug)]
enum Phase {
    /// Measuring the baseline at `min`; `restore` is the limit after.
    Probe {
        restore: f64,
        since: Option<Instant>,
    },
    Normal {
        next_probe: Instant,
    },
}

/// The limiter's arithmetic, clock passed in (unit-tested without one).
#[derive(Debug)]
pub struct Gradient {
    limit: f64,
    min: f64,
    max: f64,
    tolerance: f64,
    adaptive: bool,
    phase: Phase,
    /// Counts probes: only turns admitted during the current probe are
    /// its samples.
    epoch: u64,
    /// p90 gateway latency at low concurrency (µs).
    baseline: Option<f64>,
    samples: Vec<u64>,
    window_start: Option<Instant>,
    /// Most turns in flight during the window.
    peak: usize,
    /// The last window's p90 (µs).
    last_p90: Option<f64>,
    /// The last window was over tolerance (the next probe is due then).
    congested: bool,
}

fn p90(samples: &mut [u64]) -> f64 {
    samples.sort_unstable();
    let i = (samples.len() * 9).div_ceil(10).clamp(1, samples.len()) - 1;
    // At least 1 µs: a ratio of zeros is no signal.
    (samples[i] as f64).max(1.0)
}

impl Gradient {
    pub fn new(l: &LimitsSection) -> Self {
        let a = &l.adaptive_concurrency;
        let max = l.max_concurrent_turns as f64;
        let min = (a.min_limit as f64).min(max);
        let initial = (a.initial_limit as f64).clamp(min, max);
        Self {
            limit: if a.enabled { min } else { max },
            min,
            max,
            tolerance: a.tolerance,
            adaptive: a.enabled,
            phase: Phase::Probe { restore: initial, since: None },
            epoch: 0,
            baseline: None,
            samples: Vec::new(),
            window_start: None,
            peak: 0,
            last_p90: None,
            congested: false,
        }
    }

    /// Turns that may be in flight now.
    pub fn limit(&self) -> usize {
        self.limit as usize
    }

    /// Whether the baseline is being measured (the limit is `minLimit`).
    pub fn probing(&self) -> bool {
        self.adaptive && matches!(self.phase, Phase::Probe { .. })
    }

    /// The probe a turn admitted now belongs to.
    fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Notes that `in_flight` turns run now.
    fn busy(&mut self, in_flight: usize) {
        self.peak = self.peak.max(in_flight);
    }

    /// Ends a probe that has run its time (called on every admission and
    /// sample, so a probe ends even when no turn does).
    fn tick(&mut self, now: Instant, in_flight: usize) {
        if let Phase::Probe { restore, since } = self.phase {
            let since = since.unwrap_or(now);
            self.phase = Phase::Probe { restore, since: Some(since) };
            if self.samples.len() >= PROBE_SAMPLES || now.saturating_duration_since(since) >= PROBE_MAX {
                if !self.samples.is_empty() {
                    self.baseline = Some(p90(&mut self.samples));
                }
                self.samples.clear();
                self.limit = restore;
                self.congested = false;
                self.phase = Phase::Normal { next_probe: now + PROBE_EVERY };
                self.window_start = Some(now);
                self.peak = in_flight;
            }
        }
    }

    /// Adds the gateway latency of one turn admitted in probe `epoch`; may
    /// end a probe or a window.
    pub fn sample(&mut self, latency: Duration, now: Instant, in_flight: usize, epoch: u64) {
        if !self.adaptive {
            return;
        }
        match self.phase {
            Phase::Probe { .. } => {
                // Turns admitted before the probe ran at the old limit.
                if epoch == self.epoch {
                    self.samples.push(latency.as_micros() as u64);
                }
                self.tick(now, in_flight);
            }
            Phase::Normal { next_probe } => {
                let start = *self.window_start.get_or_insert(now);
                if self.samples.len() < MAX_SAMPLES {
                    self.samples.push(latency.as_micros() as u64);
                }
                self.busy(in_flight);
                let age = now.saturating_duration_since(start);
                if (age >= WINDOW && self.samples.len() >= MIN_SAMPLES) || age >= MAX_WINDOW {
                    self.close_window(in_flight);
                    self.window_start = Some(now);
                }
                if now >= next_probe && self.congested {
                    self.epoch += 1;
                    self.samples.clear();
                    self.phase = Phase::Probe { restore: self.limit, since: Some(now) };
                    self.limit = self.min;
                }
            }
        }
    }

    fn close_window(&mut self, in_flight: usize) {
        let full = self.samples.len() >= MIN_SAMPLES;
        let p90 = p90(&mut self.samples);
        // A full window faster than the probe saw: the baseline follows it
        // down (a window of one or two samples says too little).
        let baseline = match self.baseline {
            Some(b) if full => b.min(p90),
            Some(b) => b,
            None => p90,
        };
        self.baseline = Some(baseline);
        self.last_p90 = Some(p90);
        self.congested = p90 > self.tolerance * baseline;
        if !self.congested {
            // Grow only a limit that was used: an idle gateway's limit
            // says nothing about what it can take.
            if self.peak as f64 >= self.limit / 2.0 {
                self.limit += self.limit.sqrt().max(1.0);
            }
        } else {
            self.limit *= (self.tolerance * baseline / p90).max(0.5);
        }
        self.limit = self.limit.clamp(self.min, self.max);
        self.samples.clear();
        self.peak = in_flight;
    }

    /// How long a shed client should wait before retrying: about one
    /// turn's gateway latency (10 ms to 1 s).
    pub fn pushback(&self) -> Duration {
        let us = self.last_p90.or(self.baseline).unwrap_or(100_000.0);
        Duration::from_micros(us as u64).clamp(Duration::from_millis(10), Duration::from_secs(1))
    }
}

/// Turns in flight and their limit.
pub struct Admission {
    state: Mutex<State>,
}

struct State {
    gradient: Gradient,
    in_flight: usize,
}

/// Why a turn was not admitted.
#[derive(Debug, Clone, Copy)]
pub struct Shed {
    pub limit: usize,
    pub retry_after: Duration,
}

impl Admission {
    pub fn new(l: &LimitsSection) -> Self {
        Self { state: Mutex::new(State { gradient: Gradient::new(l), in_flight: 0 }) }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A permit, or `Shed` at once when the limit is reached.
    pub fn try_admit(self: &Arc<Self>) -> Result<Permit, Shed> {
        let mut s = self.state();
        let n = s.in_flight;
        if s.gradient.adaptive {
            s.gradient.tick(Instant::now(), n);
        }
        let limit = s.gradient.limit();
        if s.in_flight >= limit {
            return Err(Shed { limit, retry_after: s.gradient.pushback() });
        }
        s.in_flight += 1;
        let n = s.in_flight;
        s.gradient.busy(n);
        let epoch = s.gradient.epoch();
        Ok(Permit {
            admission: self.clone(),
            started: Instant::now(),
            outside: Duration::ZERO,
            limit,
            epoch,
            counts: false,
        })
    }

    /// (turns in flight, current limit).
    pub fn load(&self) -> (usize, usize) {
        let s = self.state();
        (s.in_flight, s.gradient.limit())
    }
}

/// One admitted turn; its release is the limiter's sample.
pub struct Permit {
    admission: Arc<Admission>,
    started: Instant,
    outside: Duration,
    limit: usize,
    epoch: u64,
    /// Whether its release is a sample (see [`Permit::admitted`]).
    counts: bool,
}

impl Permit {
    /// The limit this turn was admitted under.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// The turn holds its session and runs: its latency counts from now.
    /// A permit dropped before this (the turn was refused) is no sample.
    pub fn admitted(&mut self) {
        self.started = Instant::now();
        self.outside = Duration::ZERO;
        self.counts = true;
    }

    /// Time the turn waited on something outside the gateway (the model,
    /// the client): not part of its sample.
    pub fn outside(&mut self, waited: Duration) {
        self.outside += waited;
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let now = Instant::now();
        let latency = now.saturating_duration_since(self.started).saturating_sub(self.outside);
        let mut s = self.admission.state();
        s.in_flight = s.in_flight.saturating_sub(1);
        let n = s.in_flight;
        if self.counts {
            s.gradient.sample(latency, now, n, self.epoch);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use tokio::time::Instant;

    use super::{Admission, Gradient, LimitsSection, MIN_SAMPLES, PROBE_SAMPLES, WINDOW};
    use crate::config::AdaptiveConcurrency;

    fn limits(enabled: bool) -> LimitsSection {
        LimitsSection {
            max_concurrent_turns: 1024,
            adaptive_concurrency: AdaptiveConcurrency { enabled, ..AdaptiveConcurrency::default() },
            ..LimitsSection::default()
        }
    }

    /// A gateway that serves `knee` turns at once in `service` each and
    /// queues the rest: latency grows with concurrency past the knee.
    fn latency(in_flight: f64, knee: f64, service: Duration) -> Duration {
        service.mul_f64((in_flight / knee).max(1.0))
    }

    /// Offered far more than it can take, for `windows` windows: every
    /// window runs at the limit.
    fn overload(g: &mut Gradient, now: &mut Instant, windows: usize, knee: f64) -> Vec<usize> {
        let mut limits = Vec::new();
        for _ in 0..windows {
            let inflight = g.limit();
            let l = latency(inflight as f64, knee, Duration::from_millis(2));
            for _ in 0..PROBE_SAMPLES {
                g.sample(l, *now, inflight, g.epoch());
            }
            *now += WINDOW;
            g.sample(l, *now, inflight, g.epoch());
            // The steady limit (a probe's is minLimit by design).
            if !g.probing() {
                limits.push(g.limit());
            }
        }
        limits
    }

    #[test]
    fn under_overload_the_limit_settles_near_the_knee_and_latency_within_tolerance() {
        for tolerance in [2.0, 4.0] {
            let mut l = limits(true);
            l.adaptive_concurrency.tolerance = tolerance;
            let mut g = Gradient::new(&l);
            let seen = overload(&mut g, &mut Instant::now(), 1000, 16.0);
            let tail = &seen[200..];
            let (lo, hi) = (*tail.iter().min().unwrap(), *tail.iter().max().unwrap());
            let ceiling = (1.5 * tolerance * 16.0) as usize;
            assert!(lo >= 8 && hi <= ceiling, "limit in {lo}..={hi} for a knee of 16, tolerance {tolerance}");
            let worst = latency(hi as f64, 16.0, Duration::from_millis(2));
            let bound = Duration::from_millis(2).mul_f64(1.5 * tolerance);
            assert!(worst <= bound, "admitted latency {worst:?} vs 2 ms unloaded, tolerance {tolerance}");
        }
    }

    #[test]
    fn a_limit_that_is_not_used_does_not_grow() {
        let mut g = Gradient::new(&limits(true));
        let mut now = Instant::now();
        for _ in 0..PROBE_SAMPLES {
            g.sample(Duration::from_millis(1), now, 2, 0);
        }
        let start = g.limit();
        assert!(!g.probing());
        for _ in 0..100 {
            for _ in 0..=MIN_SAMPLES {
                g.sample(Duration::from_millis(1), now, 2, g.epoch());
            }
            now += WINDOW;
        }
        assert_eq!(g.limit(), start, "two turns in flight say nothing about a limit of {start}");
    }

    #[test]
    fn a_slow_start_is_followed_down_and_a_fast_one_up() {
        let (mut g, mut now) = (Gradient::new(&limits(true)), Instant::now());
        // Knee far above the initial limit: it grows towards it.
        let up = overload(&mut g, &mut now, 60, 400.0);
        assert!(*up.last().unwrap() > 300, "{up:?}");
        // The same gateway takes 40× fewer turns at once (knee 10): it comes down.
        let down = overload(&mut g, &mut now, 200, 10.0);
        assert!(*down.last().unwrap() <= 60, "{down:?}");
    }

    #[test]
    fn static_mode_admits_up_to_max_and_sheds_the_next_with_a_pushback() {
        let mut l = limits(false);
        l.max_concurrent_turns = 3;
        let a = Arc::new(Admission::new(&l));
        let permits: Vec<_> = (0..3).map(|_| a.try_admit().unwrap()).collect();
        let shed = a.try_admit().err().unwrap();
        assert_eq!(shed.limit, 3);
        assert!(shed.retry_after >= Duration::from_millis(10) && shed.retry_after <= Duration::from_secs(1));
        assert_eq!(a.load(), (3, 3));
        drop(permits);
        assert_eq!(a.load(), (0, 3));
        assert!(a.try_admit().is_ok(), "a released permit admits again");
    }

    /// Rounds of turns at the limit whose model time grows 25 % a round
    /// (5 ms to 4 s) while the gateway's own part stays 1 ms; the final limit.
    async fn slowing_model(exclude: bool) -> usize {
        let mut l = limits(true);
        l.adaptive_concurrency.initial_limit = 4;
        l.adaptive_concurrency.min_limit = 4;
        let a = Arc::new(Admission::new(&l));
        for round in 0..30 {
            let model = Duration::from_millis(5).mul_f64(1.25f64.powi(round));
            let mut permits: Vec<_> = (0..a.load().1)
                .map(|_| {
                    let mut p = a.try_admit().unwrap();
                    p.admitted();
                    p
                })
                .collect();
            tokio::time::advance(model + Duration::from_millis(1)).await;
            if exclude {
                permits.iter_mut().for_each(|p| p.outside(model));
            }
            drop(permits);
        }
        a.load().1
    }

    #[tokio::test(start_paused = true)]
    async fn time_spent_outside_the_gateway_is_not_sampled() {
        let (excluded, sampled) = (slowing_model(true).await, slowing_model(false).await);
        assert!(excluded > 100, "with the model's time excluded the limit grows: {excluded}");
        assert!(sampled < excluded / 4, "sampled, the slowing model would hold it down: {sampled} vs {excluded}");
    }

    #[test]
    fn a_turn_refused_before_it_holds_its_session_is_no_sample() {
        let mut l = limits(true);
        l.adaptive_concurrency.initial_limit = 8;
        let a = Arc::new(Admission::new(&l));
        for _ in 0..(PROBE_SAMPLES * 5) {
            drop(a.try_admit().unwrap());
        }
        let s = a.state();
        assert!(s.gradient.probing() && s.gradient.samples.is_empty(), "{:?}", s.gradient);
    }
}
