//! The limiter's policy: windows of gateway latency against a baseline
//! learned from traffic, the ticks that see a surge, and the limit they
//! set (see the parent module for what each rule is for). Its arithmetic
//! takes the clock as an argument, so the tests drive it without one.

use std::time::Duration;

use tokio::time::Instant;

use crate::config::LimitsSection;

/// A window closes after this long once it has [`MIN_SAMPLES`]…
pub(super) const WINDOW: Duration = Duration::from_millis(100);
pub(super) const MIN_SAMPLES: usize = 10;
/// …or after this long with any samples at all.
pub(super) const MAX_WINDOW: Duration = Duration::from_secs(1);
/// Samples kept per window (more are dropped: the p90 of 1024 is enough).
pub(super) const MAX_SAMPLES: usize = 1024;
/// How far a healthy, slower window moves the baseline up (of the gap).
pub(super) const DRIFT: f64 = 0.05;
/// Windows in a row whose work grew before the gateway starts limiting.
pub(super) const GROWING_WINDOWS: u32 = 2;
/// Healthy windows with demand under half the limit before it is lifted.
pub(super) const CALM_WINDOWS: u32 = 10;
/// Admissions are also counted in ticks this long, to see a surge as it
/// starts rather than two windows later…
pub(super) const TICK: Duration = Duration::from_millis(5);
/// …when this many ticks in a row each admit more than twice what they end.
pub(super) const SURGE_TICKS: u32 = 6;
/// A turn about to start waits while this many ticks in a row look like a
/// surge's first ones ([`Gradient::suspect`]; a late tick counts for the
/// ticks it spans, see [`Gradient::tick`]), until the surge is seen or the
/// streak ends…
pub(super) const HOLD_FROM: u32 = 2;
/// …or reaches this many ticks without being seen as a surge (a flood can
/// take a few ticks more than [`SURGE_TICKS`] to double its work)…
pub(super) const HOLD_TICKS: u32 = SURGE_TICKS + 4;
/// …or after this long at most: a tick's 5 ms stretch on a busy gateway,
/// and turns released on a clock while the surge is still undecided end
/// together, breaking its streak.
pub(super) const HOLD_MAX: Duration = Duration::from_millis(100);
/// How far each full healthy window moves the pace (turns ended a second).
pub(super) const PACE_WEIGHT: f64 = 0.25;
/// A surge brings turns at more than this many times the pace.
pub(super) const SURGE_DEMAND: f64 = 2.0;
/// Limiting again this soon after the floor opened the gate may refute
/// the opening ([`Gradient::surge`])…
pub(super) const REFUTE_WITHIN: Duration = Duration::from_secs(1);
/// …and then the floor stays shut this long before it may open it again.
pub(super) const FLOOR_SHUT: Duration = Duration::from_secs(3);
/// Windows in a row at the floor over tolerance before it opens the gate:
/// slower work is slow at the floor window after window; a flood's floor,
/// its turns competing with the refusals for the CPU, only now and then.
pub(super) const FLOOR_WINDOWS: u32 = 3;

/// Whether the gateway sheds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Mode {
    Open,
    /// Turns working at once, at most; `calm` counts healthy windows whose
    /// demand stayed under half of it.
    Limiting {
        limit: f64,
        calm: u32,
    },
}

/// The limiter's arithmetic, clock passed in (unit-tested without one).
#[derive(Debug)]
pub(super) struct Gradient {
    pub(super) mode: Mode,
    pub(super) min: f64,
    pub(super) max: f64,
    pub(super) tolerance: f64,
    pub(super) adaptive: bool,
    /// p90 gateway latency when not congested (µs).
    pub(super) baseline: Option<f64>,
    pub(super) samples: Vec<u64>,
    pub(super) window_start: Option<Instant>,
    /// Most turns working during the window.
    pub(super) peak: usize,
    /// The last window's peak, and how many windows in a row ended with
    /// more work than the one before ever had (see [`Gradient::close_window`]).
    pub(super) last_peak: usize,
    pub(super) growing_for: u32,
    /// The last window's p90 (µs).
    pub(super) last_p90: Option<f64>,
    /// Turns that ended in this window (samples past MAX_SAMPLES too).
    pub(super) ended: usize,
    /// Turns the gateway ends a second, over recent full healthy windows:
    /// the demand it serves when it is not congested.
    pub(super) pace: Option<f64>,
    /// When the floor last opened the gate (taking its p90 as the new
    /// baseline), and the baseline before: for [`REFUTE_WITHIN`], unless a
    /// healthy window confirms the new one first.
    pub(super) floor_opened: Option<(Instant, f64)>,
    /// The floor may not open the gate before this (limiting again refuted
    /// its last opening).
    pub(super) floor_shut_until: Option<Instant>,
    /// Windows in a row at the floor over tolerance ([`FLOOR_WINDOWS`]).
    pub(super) slow_floor: u32,
    /// Turns refused at a cap (open or waiting turns) this window: demand
    /// past the cap, a queue growing where the window's work cannot show it.
    pub(super) refused_at_cap: usize,
    pub(super) ticks: Ticks,
}

/// Admissions and ends per [`TICK`], and the surge they may show.
#[derive(Debug, Default)]
pub(super) struct Ticks {
    pub(super) start: Option<Instant>,
    /// The tick under way.
    pub(super) now: Tick,
    /// Consecutive closed ticks that each admitted more than twice what
    /// they ended while work grew, summed (`working` is the first one's).
    pub(super) streak: Tick,
    pub(super) streak_len: u32,
    pub(super) streak_start: Option<Instant>,
}

#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Tick {
    pub(super) admitted: usize,
    pub(super) ended: usize,
    /// Turns working when it began.
    pub(super) working: usize,
}

/// Whether `admitted` turns over `age` came at more than [`SURGE_DEMAND`]
/// × the pace.
fn at_surge_rate(admitted: usize, pace: f64, age: Duration) -> bool {
    admitted as f64 > SURGE_DEMAND * pace * age.as_secs_f64()
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
        Self {
            mode: Mode::Open,
            min: (a.min_limit as f64).min(max),
            max,
            tolerance: a.tolerance,
            adaptive: a.enabled,
            baseline: None,
            samples: Vec::new(),
            window_start: None,
            peak: 0,
            last_peak: 0,
            growing_for: 0,
            last_p90: None,
            ended: 0,
            pace: None,
            floor_opened: None,
            floor_shut_until: None,
            slow_floor: 0,
            refused_at_cap: 0,
            ticks: Ticks::default(),
        }
    }

    /// Turns that may work at once now (`maxConcurrentTurns` when open).
    pub fn limit(&self) -> usize {
        match self.mode {
            Mode::Limiting { limit, .. } if self.adaptive => limit as usize,
            _ => self.max as usize,
        }
    }

    /// Whether the gateway sheds below `maxConcurrentTurns` now.
    pub fn limiting(&self) -> bool {
        self.adaptive && matches!(self.mode, Mode::Limiting { .. })
    }

    /// Windows close only when turns end: after a silence longer than the
    /// calm windows would take, a limit measured then says nothing about now.
    pub(super) fn quiet(&mut self, now: Instant) {
        let silent = self.window_start.is_some_and(|w| now.saturating_duration_since(w) >= MAX_WINDOW * CALM_WINDOWS);
        if silent && self.limiting() {
            self.mode = Mode::Open;
            self.slow_floor = 0;
        }
    }

    /// Notes that `working` turns work now.
    pub(super) fn busy(&mut self, working: usize) {
        self.peak = self.peak.max(working);
    }

    /// A turn arrives while `working` turns work: the limit it meets is
    /// decided after this (a silence may have lifted it, a surge set it).
    pub(super) fn arriving(&mut self, now: Instant, working: usize) {
        self.quiet(now);
        self.tick(now, working);
    }

    /// The arriving turn was admitted.
    pub(super) fn admitted(&mut self) {
        self.ticks.now.admitted += 1;
    }

    /// An admitted turn ends while `working` turns work (itself among them
    /// unless it ends away).
    pub(super) fn ending(&mut self, now: Instant, working: usize) {
        self.tick(now, working);
        self.ticks.now.ended += 1;
    }

    /// Closes the tick under way once it is [`TICK`] old; a surge starts
    /// limiting at once (see [`Gradient::surge`]).
    pub(super) fn tick(&mut self, now: Instant, working: usize) {
        if !self.adaptive {
            return;
        }
        let t = &mut self.ticks;
        let started = *t.start.get_or_insert(now);
        let age = now.saturating_duration_since(started);
        if age < TICK {
            return;
        }
        let tick = std::mem::replace(&mut t.now, Tick { working, ..Tick::default() });
        t.start = Some(now);
        // More than twice as many admitted as ended, and more at work at
        // its end. A tick closed late counts for each tick it spans when
        // its arrivals came at a surge's rate over all of it and it extends
        // a streak (a busy gateway handles its events in batches, ticks
        // 10-30 ms long were traced under a flood, and breaking the streak
        // on them let the flood in unseen); otherwise it spans a silence
        // and is none. A streak's first tick counts once: a burst's events
        // all fall in its first 5 ms, however late the next event closes it.
        let late = (age.as_nanos() / TICK.as_nanos()).try_into().unwrap_or(u32::MAX);
        let spans = if t.streak_len == 0 { 1 } else { late };
        let busy = late == 1 || self.pace.is_some_and(|p| at_surge_rate(tick.admitted, p, age));
        let surging = busy && tick.admitted > 2 * tick.ended && working > tick.working;
        if !surging {
            t.streak_len = 0;
            return;
        }
        if t.streak_len == 0 {
            t.streak = Tick { working: tick.working, ..Tick::default() };
            t.streak_start = Some(started);
        }
        t.streak.admitted += tick.admitted;
        t.streak.ended += tick.ended;
        t.streak_len = t.streak_len.saturating_add(spans);
        if t.streak_len >= SURGE_TICKS {
            self.surge(now, working);
        }
    }

    /// [`SURGE_TICKS`] ticks or more in a row have admitted more than twice
    /// what they ended. The gateway starts limiting now, without waiting
    /// for two windows of a growing queue, when this is a surge of demand
    /// that the gateway does not keep up with, and not a burst, a closed
    /// loop, a stall or more demand on a gateway with room for it:
    /// - the streak has lasted tolerance × baseline: a gateway that keeps
    ///   up ends the streak's first turns within that, and ends as many as
    ///   arrive from then on (until then, the turns ending are the ones from
    ///   before the surge, and say nothing about what it can do);
    /// - turns arrived at more than [`SURGE_DEMAND`] × the pace: demand
    ///   rose (a stall ends fewer turns; it does not bring more);
    /// - the work at least doubled (by `minLimit` at least) over the streak:
    ///   a closed loop cannot double, a burst does in one tick and stops;
    /// - a turn admitted now would wait working / ending rate (Little's
    ///   law) past tolerance × baseline: the latency rises with the load.
    ///
    /// The limit is the work the gateway ends within tolerance — ending rate
    /// (or the pace, when more work has made it end fewer) × tolerance ×
    /// baseline, by Little's law — and the turns admitted in the streak that
    /// have not started are refused down to it. A rate over 30 ms of a
    /// gateway flooded with new turns is a poor estimate; the windows take
    /// the limit on from there, and one slow window on the floor no longer
    /// opens the gate ([`FLOOR_WINDOWS`]). (A quarter of the work then, the
    /// least this limit used to be, let held turns start behind the ones
    /// already working; without it the 4 × legacy p99 measured 7.5–17.6 ms
    /// against 12.9–60.5 in five alternated runs.)
    ///
    /// A surge (or a queue growing, see [`Gradient::close_window`]) within
    /// [`REFUTE_WITHIN`] of the floor opening the gate, with turns ending at
    /// least at the pace, refutes the opening: the floor
    /// was slow from the flood (its refusals queue ahead of the few turns
    /// working), not from slower work, which would end fewer turns than
    /// before. The baseline from before the opening comes back, and the
    /// floor stays shut for [`FLOOR_SHUT`]: taking the flood's latency as
    /// the baseline let the rest of a traced flood run at limits 10× too
    /// wide.
    pub(super) fn surge(&mut self, now: Instant, working: usize) {
        let (Mode::Open, Some(baseline), Some(pace)) = (self.mode, self.baseline, self.pace) else {
            return;
        };
        let t = &self.ticks;
        let span = now.saturating_duration_since(t.streak_start.unwrap_or(now)).as_secs_f64().max(1e-3);
        let (arriving, ending) = (t.streak.admitted as f64 / span, t.streak.ended as f64 / span);
        let refuted = self.refuted_baseline(now, ending);
        let baseline = refuted.unwrap_or(baseline);
        let target = self.tolerance * baseline / 1e6;
        if span < target {
            return;
        }
        let doubled = working >= 2 * t.streak.working && working as f64 >= t.streak.working as f64 + self.min;
        if arriving > SURGE_DEMAND * pace && doubled && working as f64 > ending * target {
            let within = ending.max(pace) * target;
            self.mode = Mode::Limiting { limit: within.max(self.min), calm: 0 };
            self.slow_floor = 0;
            if let Some(before) = refuted {
                self.refute_floor_opening(now, before);
            }
            tracing::debug!(target: "ctxgate::admission", mode = ?self.mode, working, arriving, ending, pace, refuted, "surge");
        }
    }

    /// The baseline from before the floor opened the gate, when limiting
    /// again now, with turns ending at `ending` a second, refutes that
    /// opening: within [`REFUTE_WITHIN`] of it, and at least at the pace
    /// (slower work would end fewer; see [`Gradient::surge`]).
    pub(super) fn refuted_baseline(&self, now: Instant, ending: f64) -> Option<f64> {
        let ((at, before), pace) = (self.floor_opened?, self.pace?);
        let refuted = now.saturating_duration_since(at) < REFUTE_WITHIN && ending >= pace;
        refuted.then(|| self.baseline.map_or(before, |b| b.min(before)))
    }

    /// The floor was slow from a flood: the baseline from before its
    /// opening comes back, and the floor stays shut for [`FLOOR_SHUT`].
    pub(super) fn refute_floor_opening(&mut self, now: Instant, before: f64) -> f64 {
        self.floor_opened = None;
        self.baseline = Some(before);
        self.floor_shut_until = Some(now + FLOOR_SHUT);
        before
    }

    /// Whether the ticks so far look like a surge's first ones: on an open
    /// gateway that knows its pace, [`HOLD_FROM`] ticks or more in a row
    /// (fewer than [`HOLD_TICKS`]; the last one just closed) have each
    /// admitted more than twice what they ended while work grew, turns
    /// arriving at more than [`SURGE_DEMAND`] × the pace, and a surge can be
    /// seen within
    /// [`SURGE_TICKS`] (it must last tolerance × baseline: with slow turns,
    /// a wait would only delay them). A turn about to start waits meanwhile
    /// ([`Permit::admitted`]): if it is a surge, the turns not started yet
    /// are the ones its limit can still refuse having stored nothing.
    pub(super) fn suspect(&self, now: Instant) -> bool {
        let (true, Mode::Open, Some(baseline), Some(pace)) = (self.adaptive, self.mode, self.baseline, self.pace)
        else {
            return false;
        };
        let t = &self.ticks;
        // The tick under way is fresh, or a busy gateway has not closed it
        // yet while turns came at a surge's rate (a traced flood's held
        // turns all started 6-12 ms in, the ticks late, and 766 worked
        // before the surge was seen).
        let current = t.start.is_some_and(|s| {
            let age = now.saturating_duration_since(s);
            age < 2 * TICK || at_surge_rate(t.now.admitted, pace, age)
        });
        let seen_in_time = self.tolerance * baseline <= (TICK * SURGE_TICKS).as_micros() as f64;
        if !(HOLD_FROM..HOLD_TICKS).contains(&t.streak_len) || !current || !seen_in_time {
            return false;
        }
        let span = now.saturating_duration_since(t.streak_start.unwrap_or(now)).as_secs_f64().max(1e-3);
        t.streak.admitted as f64 / span > SURGE_DEMAND * pace
    }

    /// Whether a turn admitted under the limit `admitted_under`, about to
    /// start while `working` turns work (itself among them), is refused:
    /// the limit fell since, and the work is over it ([`Permit::admitted`]).
    pub(super) fn refuses_start(&self, working: usize, admitted_under: usize) -> bool {
        let limit = self.limit();
        self.limiting() && limit < admitted_under && working > limit
    }

    /// Adds the gateway latency of one turn; may close a window.
    pub fn sample(&mut self, latency: Duration, now: Instant, working: usize) {
        if !self.adaptive {
            return;
        }
        let start = *self.window_start.get_or_insert(now);
        if self.samples.len() < MAX_SAMPLES {
            self.samples.push(latency.as_micros() as u64);
        }
        self.ended += 1;
        self.busy(working);
        let age = now.saturating_duration_since(start);
        if (age >= WINDOW && self.samples.len() >= MIN_SAMPLES) || age >= MAX_WINDOW {
            self.close_window(now, working, age);
            self.window_start = Some(now);
        }
    }

    pub(super) fn close_window(&mut self, now: Instant, working: usize, age: Duration) {
        let full = self.samples.len() >= MIN_SAMPLES;
        let p90 = p90(&mut self.samples);
        self.samples.clear();
        self.last_p90 = Some(p90);
        let peak = self.peak as f64;
        self.peak = working;
        let secs = age.as_secs_f64().max(1e-3);
        let ended = std::mem::take(&mut self.ended) as f64;
        // A queue that grows: each window ends with more turns working than
        // the one before ever had — by minLimit, and by twice the square
        // root of the turns it ended (the jitter of a busy window's count,
        // not a queue) — GROWING_WINDOWS in a row.
        // A closed loop of clients, however many, never does: their work
        // stops where the clients are. (Arrivals are not asked to have
        // risen: an engine that slows under the same traffic grows the
        // queue just as well, and must be shed.)
        let grew = working as f64 >= self.last_peak as f64 + self.min.max(2.0 * ended.sqrt())
            || std::mem::take(&mut self.refused_at_cap) > 0;
        self.growing_for = if grew { self.growing_for + 1 } else { 0 };
        self.last_peak = peak as usize;
        let growing = self.growing_for >= GROWING_WINDOWS;
        let Some(baseline) = self.baseline else {
            self.baseline = Some(p90);
            self.pace = full.then_some(ended / secs);
            return;
        };
        let over = p90 > self.tolerance * baseline;
        if full && !over && self.mode == Mode::Open {
            self.pace = Some(self.pace.map_or(ended / secs, |p| p + PACE_WEIGHT * (ended / secs - p)));
            // Healthy at the baseline the floor set: the work did get slower.
            self.floor_opened = None;
        }
        if self.floor_opened.is_some_and(|(at, _)| now.saturating_duration_since(at) >= REFUTE_WITHIN) {
            self.floor_opened = None;
        }
        let cut = (self.tolerance * baseline / p90).max(0.5);
        let before = (self.limiting(), self.limit());
        let at_floor = matches!(self.mode, Mode::Limiting { limit, .. } if limit <= self.min) && peak <= self.min;
        self.slow_floor = if at_floor && over { self.slow_floor + 1 } else { 0 };
        self.mode = match self.mode {
            // The work the gateway does within tolerance, by Little's law
            // (the whole ratio: a queue is growing, there is no time to
            // approach it by halves).
            Mode::Open if over && growing && peak > self.min => {
                let baseline = match self.refuted_baseline(now, ended / secs) {
                    Some(before) => self.refute_floor_opening(now, before),
                    None => baseline,
                };
                Mode::Limiting { limit: (peak * self.tolerance * baseline / p90).max(self.min), calm: 0 }
            }
            // Slower with as many turns working as before: the clients wait
            // their turn (a saturated closed loop), nothing to shed; the
            // baseline stays what the gateway does when it is not busy.
            Mode::Open if over && peak > self.min => Mode::Open,
            Mode::Open => {
                // Healthy (or slow with little work: not load): the baseline
                // follows — down at once, up a little.
                self.baseline = Some(if over {
                    p90
                } else if p90 < baseline {
                    if full { p90 } else { baseline }
                } else {
                    baseline + DRIFT * (p90 - baseline)
                });
                Mode::Open
            }
            Mode::Limiting { limit, .. } if over => {
                if self.slow_floor >= FLOOR_WINDOWS && self.floor_shut_until.is_none_or(|t| now >= t) {
                    // As slow at the floor as above it, window after window:
                    // the work got slower, not the gateway busier (unless
                    // limiting again soon says otherwise, see
                    // `refuted_baseline`).
                    self.slow_floor = 0;
                    self.floor_opened = Some((now, baseline));
                    self.baseline = Some(p90);
                    Mode::Open
                } else {
                    Mode::Limiting { limit: (limit.min(peak.max(self.min)) * cut).max(self.min), calm: 0 }
                }
            }
            Mode::Limiting { limit, calm } => {
                if full && p90 < baseline {
                    self.baseline = Some(p90);
                }
                let used = peak >= limit / 2.0;
                let (limit, calm) = if used { (limit + limit.sqrt().max(1.0), 0) } else { (limit, calm + 1) };
                if limit >= self.max || calm >= CALM_WINDOWS { Mode::Open } else { Mode::Limiting { limit, calm } }
            }
        };
        if (self.limiting(), self.limit()) != before {
            tracing::debug!(target: "ctxgate::admission", ?before, mode = ?self.mode, p90, baseline, peak, working, ended, "window");
        }
    }

    /// How long a shed client should wait before retrying: about one
    /// turn's gateway latency (10 ms to 1 s).
    pub fn pushback(&self) -> Duration {
        let us = self.last_p90.or(self.baseline).unwrap_or(100_000.0);
        Duration::from_micros(us as u64).clamp(Duration::from_millis(10), Duration::from_secs(1))
    }
}
