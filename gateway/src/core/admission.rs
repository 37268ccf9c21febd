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
//!   floor itself is as slow, [`FLOOR_WINDOWS`] windows in a row (the work
//!   got slower, not the gateway busier); limiting again (a surge, or a
//!   queue growing) within [`REFUTE_WITHIN`] with turns ending at least at
//!   the pace refutes that: the old baseline comes back and the floor
//!   stays shut for [`FLOOR_SHUT`].
//!
//! With `adaptiveConcurrency.enabled: false` only `maxConcurrentTurns`
//! bounds turns.

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
/// How far a healthy, slower window moves the baseline up (of the gap).
const DRIFT: f64 = 0.05;
/// Windows in a row whose work grew before the gateway starts limiting.
const GROWING_WINDOWS: u32 = 2;
/// Healthy windows with demand under half the limit before it is lifted.
const CALM_WINDOWS: u32 = 10;
/// Admissions are also counted in ticks this long, to see a surge as it
/// starts rather than two windows later…
const TICK: Duration = Duration::from_millis(5);
/// …when this many ticks in a row each admit more than twice what they end.
const SURGE_TICKS: u32 = 6;
/// A turn about to start waits while this many ticks in a row look like a
/// surge's first ones ([`Gradient::suspect`]; a late tick counts for the
/// ticks it spans, see [`Gradient::tick`]), until the surge is seen or the
/// streak ends…
const HOLD_FROM: u32 = 2;
/// …or reaches this many ticks without being seen as a surge (a flood can
/// take a few ticks more than [`SURGE_TICKS`] to double its work)…
const HOLD_TICKS: u32 = SURGE_TICKS + 4;
/// …or after this long at most: a tick's 5 ms stretch on a busy gateway,
/// and turns released on a clock while the surge is still undecided end
/// together, breaking its streak.
const HOLD_MAX: Duration = Duration::from_millis(100);
/// How far each full healthy window moves the pace (turns ended a second).
const PACE_WEIGHT: f64 = 0.25;
/// A surge brings turns at more than this many times the pace.
const SURGE_DEMAND: f64 = 2.0;
/// Limiting again this soon after the floor opened the gate may refute
/// the opening ([`Gradient::surge`])…
const REFUTE_WITHIN: Duration = Duration::from_secs(1);
/// …and then the floor stays shut this long before it may open it again.
const FLOOR_SHUT: Duration = Duration::from_secs(3);
/// Windows in a row at the floor over tolerance before it opens the gate:
/// slower work is slow at the floor window after window; a flood's floor,
/// its turns competing with the refusals for the CPU, only now and then.
const FLOOR_WINDOWS: u32 = 3;

/// Whether the gateway sheds.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
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
pub struct Gradient {
    mode: Mode,
    min: f64,
    max: f64,
    tolerance: f64,
    adaptive: bool,
    /// p90 gateway latency when not congested (µs).
    baseline: Option<f64>,
    samples: Vec<u64>,
    window_start: Option<Instant>,
    /// Most turns working during the window.
    peak: usize,
    /// The last window's peak, and how many windows in a row ended with
    /// more work than the one before ever had (see [`Gradient::close_window`]).
    last_peak: usize,
    growing_for: u32,
    /// The last window's p90 (µs).
    last_p90: Option<f64>,
    /// Turns that ended in this window (samples past MAX_SAMPLES too).
    ended: usize,
    /// Turns the gateway ends a second, over recent full healthy windows:
    /// the demand it serves when it is not congested.
    pace: Option<f64>,
    /// When the floor last opened the gate (taking its p90 as the new
    /// baseline), and the baseline before: for [`REFUTE_WITHIN`], unless a
    /// healthy window confirms the new one first.
    floor_opened: Option<(Instant, f64)>,
    /// The floor may not open the gate before this (limiting again refuted
    /// its last opening).
    floor_shut_until: Option<Instant>,
    /// Windows in a row at the floor over tolerance ([`FLOOR_WINDOWS`]).
    slow_floor: u32,
    /// Turns refused at a cap (open or waiting turns) this window: demand
    /// past the cap, a queue growing where the window's work cannot show it.
    refused_at_cap: usize,
    ticks: Ticks,
}

/// Admissions and ends per [`TICK`], and the surge they may show.
#[derive(Debug, Default)]
struct Ticks {
    start: Option<Instant>,
    /// The tick under way.
    now: Tick,
    /// Consecutive closed ticks that each admitted more than twice what
    /// they ended while work grew, summed (`working` is the first one's).
    streak: Tick,
    streak_len: u32,
    streak_start: Option<Instant>,
}

#[derive(Debug, Default, Clone, Copy)]
struct Tick {
    admitted: usize,
    ended: usize,
    /// Turns working when it began.
    working: usize,
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
    fn quiet(&mut self, now: Instant) {
        let silent = self.window_start.is_some_and(|w| now.saturating_duration_since(w) >= MAX_WINDOW * CALM_WINDOWS);
        if silent && self.limiting() {
            self.mode = Mode::Open;
            self.slow_floor = 0;
        }
    }

    /// Notes that `working` turns work now.
    fn busy(&mut self, working: usize) {
        self.peak = self.peak.max(working);
    }

    /// A turn arrives while `working` turns work: the limit it meets is
    /// decided after this (a silence may have lifted it, a surge set it).
    fn arriving(&mut self, now: Instant, working: usize) {
        self.quiet(now);
        self.tick(now, working);
    }

    /// The arriving turn was admitted.
    fn admitted(&mut self) {
        self.ticks.now.admitted += 1;
    }

    /// An admitted turn ends while `working` turns work (itself among them
    /// unless it ends away).
    fn ending(&mut self, now: Instant, working: usize) {
        self.tick(now, working);
        self.ticks.now.ended += 1;
    }

    /// Closes the tick under way once it is [`TICK`] old; a surge starts
    /// limiting at once (see [`Gradient::surge`]).
    fn tick(&mut self, now: Instant, working: usize) {
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
    fn surge(&mut self, now: Instant, working: usize) {
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
    fn refuted_baseline(&self, now: Instant, ending: f64) -> Option<f64> {
        let ((at, before), pace) = (self.floor_opened?, self.pace?);
        let refuted = now.saturating_duration_since(at) < REFUTE_WITHIN && ending >= pace;
        refuted.then(|| self.baseline.map_or(before, |b| b.min(before)))
    }

    /// The floor was slow from a flood: the baseline from before its
    /// opening comes back, and the floor stays shut for [`FLOOR_SHUT`].
    fn refute_floor_opening(&mut self, now: Instant, before: f64) -> f64 {
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
    fn suspect(&self, now: Instant) -> bool {
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
    fn refuses_start(&self, working: usize, admitted_under: usize) -> bool {
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

    fn close_window(&mut self, now: Instant, working: usize, age: Duration) {
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
mod tests {
    use std::collections::VecDeque;
    use std::sync::Arc;
    use std::time::Duration;

    use tokio::time::Instant;

    use super::{Admission, Gradient, LimitsSection, MIN_SAMPLES, Mode, Permit, Shed, ShedReason, WINDOW};
    use crate::config::AdaptiveConcurrency;

    fn limits(enabled: bool) -> LimitsSection {
        LimitsSection {
            max_concurrent_turns: 1024,
            adaptive_concurrency: AdaptiveConcurrency { enabled, ..AdaptiveConcurrency::default() },
            ..LimitsSection::default()
        }
    }

    /// A gateway that works `knee` turns at once in `service` each and
    /// queues the rest: latency grows with the work past the knee.
    fn latency(working: f64, knee: f64, service: Duration) -> Duration {
        service.mul_f64((working / knee).max(1.0))
    }

    /// One window of samples at `working` turns.
    fn window(g: &mut Gradient, now: &mut Instant, working: usize, l: Duration) {
        for _ in 0..MIN_SAMPLES {
            g.sample(l, *now, working);
        }
        *now += WINDOW;
        g.sample(l, *now, working);
    }

    /// A closed loop: `offered` turns want to work at once for `windows`
    /// windows (each client asks again when answered); as many work as the
    /// gateway lets in. The limit after each window.
    fn load(g: &mut Gradient, now: &mut Instant, windows: usize, offered: usize, knee: f64) -> Vec<usize> {
        (0..windows)
            .map(|_| {
                let working = offered.min(g.limit());
                window(g, now, working, latency(working as f64, knee, Duration::from_millis(2)));
                g.limit()
            })
            .collect()
    }

    /// An open loop: `arrivals` new turns each window, whatever happened to
    /// the last ones; the gateway admits what its limit lets in and ends
    /// `capacity` turns a window, the rest wait (latency grows with the
    /// queue). `working` carries over between calls. The limit after each
    /// window.
    fn open_load(
        g: &mut Gradient,
        now: &mut Instant,
        working: &mut usize,
        windows: usize,
        arrivals: usize,
        capacity: usize,
    ) -> Vec<usize> {
        (0..windows)
            .map(|_| {
                *working -= (*working).min(capacity);
                *working += arrivals.min(g.limit().saturating_sub(*working));
                let l = latency(*working as f64, capacity as f64, Duration::from_millis(2));
                window(g, now, *working, l);
                g.limit()
            })
            .collect()
    }

    /// The gateway millisecond by millisecond, for the tick-level rules:
    /// turns arrive at a rate; the gateway ends them first in, first out —
    /// at its capacity (none in a stall), each having waited what a FIFO at
    /// that pace makes it wait (at least 2 ms), or each a fixed time after
    /// it began.
    struct Sim {
        g: Gradient,
        now: Instant,
        /// When each working turn was admitted, oldest first.
        working: VecDeque<Instant>,
        /// Admitted turns waiting to start ([`Permit::admitted`]): since when.
        held: VecDeque<Instant>,
        due: f64,
        done: f64,
        shed: usize,
        /// Milliseconds in which a turn about to start would have waited.
        suspected: u32,
    }

    impl Sim {
        fn cold() -> Self {
            let g = Gradient::new(&limits(true));
            Self {
                g,
                now: Instant::now(),
                working: VecDeque::new(),
                held: VecDeque::new(),
                due: 0.0,
                done: 0.0,
                shed: 0,
                suspected: 0,
            }
        }

        /// A gateway that has served half its capacity (1000 of 2000 turns/s) for a second.
        fn warm() -> Self {
            let mut s = Self::cold();
            s.run(1000, 1000.0, 2000.0);
            assert!(!s.g.limiting() && s.shed == 0, "half load is not shed: {:?}", s.g);
            assert_eq!(s.suspected, 0, "nor held: {:?}", s.g);
            s
        }

        fn working(&self) -> usize {
            self.working.len() + self.held.len()
        }

        /// Held turns look again, as [`Permit::admitted`] does: refused
        /// while the limit is exceeded, started once the ticks no longer
        /// look like a surge or after [`super::HOLD_MAX`].
        fn recheck(&mut self) {
            // Held turns arrived while the gateway was open: under its maximum.
            while let Some(&since) = self.held.front() {
                if self.g.refuses_start(self.working(), self.g.max as usize) {
                    self.held.pop_front();
                    self.g.ending(self.now, self.working());
                    self.shed += 1;
                } else if !self.g.suspect(self.now) || self.now.duration_since(since) >= super::HOLD_MAX {
                    self.held.pop_front();
                    self.working.push_back(self.now);
                } else {
                    break;
                }
            }
        }

        fn arrive(&mut self, n: usize) {
            self.suspected += u32::from(self.g.suspect(self.now));
            self.recheck();
            for _ in 0..n {
                self.g.arriving(self.now, self.working());
                if self.g.limiting() && self.working() >= self.g.limit() {
                    self.shed += 1;
                    continue;
                }
                self.g.busy(self.working() + 1);
                self.g.admitted();
                if self.g.suspect(self.now) {
                    self.held.push_back(self.now);
                } else {
                    self.working.push_back(self.now);
                }
            }
        }

        /// The arrivals `rate` brings this millisecond.
        fn arrivals(&mut self, rate: f64) -> usize {
            self.due += rate / 1000.0;
            let n = self.due as usize;
            self.due -= n as f64;
            n
        }

        /// Ends the oldest turn, which took `l`.
        fn end(&mut self, l: Duration) {
            self.g.ending(self.now, self.working());
            self.working.pop_front();
            self.g.sample(l, self.now, self.working());
        }

        fn serve(&mut self, capacity: f64) {
            self.now += Duration::from_millis(1);
            if capacity == 0.0 {
                return;
            }
            self.done += capacity / 1000.0;
            let n = (self.done as usize).min(self.working.len());
            self.done = (self.done - n as f64).min(1.0);
            for _ in 0..n {
                self.end(Duration::from_secs_f64(self.working() as f64 / capacity).max(Duration::from_millis(2)));
            }
        }

        /// An open loop: `rate` arrivals a second, whatever happens to them.
        fn run(&mut self, ms: u32, rate: f64, capacity: f64) {
            for _ in 0..ms {
                let n = self.arrivals(rate);
                self.arrive(n);
                self.serve(capacity);
            }
        }

        /// An open loop on a gateway whose every turn takes `latency`,
        /// whatever the load.
        fn run_fixed(&mut self, ms: u32, rate: f64, latency: Duration) {
            for _ in 0..ms {
                let n = self.arrivals(rate);
                self.arrive(n);
                while self.working.front().is_some_and(|t| self.now.duration_since(*t) >= latency) {
                    let began = self.working[0];
                    self.end(self.now.duration_since(began));
                }
                self.now += Duration::from_millis(1);
            }
        }

        /// A closed loop: every client not working asks again (a shed one
        /// the next millisecond).
        fn closed(&mut self, ms: u32, clients: usize, capacity: f64) {
            for _ in 0..ms {
                self.arrive(clients.saturating_sub(self.working()));
                self.serve(capacity);
            }
        }
    }

    #[test]
    fn a_surge_is_limited_within_a_few_ticks_not_windows() {
        let mut s = Sim::warm();
        // Four times what the gateway ends, from now on.
        let mut waited = 0;
        while !s.g.limiting() && waited < 500 {
            s.run(1, 8000.0, 2000.0);
            waited += 1;
        }
        assert!(waited <= 50, "limiting after {waited} ms, {} working", s.working());
        // From its third tick on, the flood looked like one: a turn about to
        // start waited to see (and is refused now, not run behind it).
        assert!(s.suspected >= 10, "suspected for {} ms", s.suspected);
        // At the work it ends within tolerance (2000/s × 2 × 2 ms = 8, or
        // fewer if the flood slowed its ends), not at the work then.
        assert!(s.g.limit() <= 8, "{} working: {:?}", s.working(), s.g);
        s.run(2000, 8000.0, 2000.0);
        assert!(s.g.limiting() && s.working() <= 64, "the queue stays bounded: {} working, {:?}", s.working(), s.g);
    }

    /// A gateway too busy to handle its events as they come handles them
    /// in batches (its ticks are 12 ms long): a flood is still seen as one
    /// within a few of them, not once `maxConcurrentTurns` turns work.
    #[test]
    fn a_surge_on_a_gateway_handling_its_events_in_batches_is_seen() {
        let mut s = Sim::warm();
        let mut waited = 0;
        while !s.g.limiting() && waited < 500 {
            // Arrivals and ends queue up for 12 ms, then are handled at once.
            s.now += Duration::from_millis(12);
            let n = s.arrivals(8000.0 * 12.0);
            s.arrive(n);
            for _ in 0..24.min(s.working.len()) {
                s.end(Duration::from_secs_f64(s.working() as f64 / 2000.0).max(Duration::from_millis(2)));
            }
            waited += 12;
        }
        assert!(waited <= 60 && s.working() <= 400, "limiting after {waited} ms, {} working: {:?}", s.working(), s.g);
    }

    /// A flood on a gateway too busy to close its ticks: turns about to
    /// start keep waiting while the tick under way has admitted at a
    /// surge's rate, and stop waiting on a silence.
    #[test]
    fn a_hold_lasts_through_a_tick_the_busy_gateway_has_not_closed() {
        for (batch, held) in [(60, true), (1, false)] {
            let mut s = Sim::warm();
            while !s.g.suspect(s.now) {
                s.run(1, 8000.0, 2000.0);
            }
            s.arrive(batch);
            s.now += Duration::from_millis(12);
            assert_eq!(s.g.suspect(s.now), held, "{batch} admitted in 12 ms: {:?}", s.g);
        }
    }

    /// A burst on a quiet gateway whose turns end only after several ticks,
    /// with nothing else happening meanwhile: the tick that holds it is
    /// closed late, but it is one tick of a burst, not a streak.
    #[test]
    fn a_burst_whose_tick_is_closed_late_by_a_quiet_gateway_is_not_a_surge() {
        let mut s = Sim::cold();
        s.run_fixed(3000, 20.0, Duration::from_millis(10));
        assert!(s.g.pace.is_some() && !s.g.limiting(), "{:?}", s.g);
        s.arrive(8);
        s.run_fixed(500, 0.0, Duration::from_millis(35));
        assert!(s.shed == 0 && !s.g.limiting() && s.suspected == 0, "{} shed: {:?}", s.shed, s.g);
    }

    /// A flood whose refusals starve the few turns working at the floor
    /// (the gateway ends a fifth of its capacity while it sheds, all of it
    /// once open) makes the floor slow; the floor opens the gate, the flood
    /// surges again with turns ending at the pace, and the baseline from
    /// before the opening comes back: limits are not set around the flood's
    /// own latency for the rest of it.
    #[test]
    fn a_floor_slowed_by_a_floods_refusals_does_not_become_the_baseline() {
        let mut s = Sim::warm();
        let before = s.g.baseline.expect("a warm gateway has a baseline");
        let mut opened = 0;
        for _ in 0..3000 {
            let limiting = s.g.limiting();
            s.run(1, 8000.0, if limiting { 400.0 } else { 2000.0 });
            opened += usize::from(limiting && !s.g.limiting());
        }
        assert!(opened >= 1, "the floor opened the gate: {:?}", s.g);
        assert!(s.g.limiting(), "{:?}", s.g);
        let now = s.g.baseline.unwrap();
        assert!(now <= 1.5 * before, "baseline {now} µs against {before} before the flood: {:?}", s.g);
        assert_eq!(opened, 1, "the floor stays shut for FLOOR_SHUT after a refuted opening");
    }

    /// Work that got slower at any load (a fifth of the capacity, open or
    /// not) under the same flood: the surge after the floor opened ends
    /// fewer turns than the pace, so the floor's baseline stands.
    #[test]
    fn a_gateway_whose_work_got_slower_keeps_the_floors_baseline_under_a_flood() {
        let mut s = Sim::warm();
        let before = s.g.baseline.expect("a warm gateway has a baseline");
        s.run(3000, 8000.0, 400.0);
        assert!(s.g.limiting(), "{:?}", s.g);
        let now = s.g.baseline.unwrap();
        assert!(now >= 3.0 * before, "baseline {now} µs against {before}: the slower work is the baseline now");
    }

    /// Held turns end later than they would have, so the ticks they wait
    /// through look more like a surge: a catch-up burst that starts a hold,
    /// then more demand than the pace but within capacity, is still none.
    #[test]
    fn turns_held_to_start_make_no_surge_of_more_demand_on_a_gateway_with_room() {
        for (capacity, demand) in [(3000.0, 2200.0), (3000.0, 2800.0), (4000.0, 3500.0)] {
            let mut s = Sim::cold();
            s.run(2000, 1000.0, capacity);
            s.run(20, 10000.0, capacity);
            assert!(s.suspected > 0, "the burst started a hold: {:?}", s.g);
            s.run(3000, demand, capacity);
            assert!(s.shed == 0 && !s.g.limiting(), "{demand}/s on {capacity}: {} shed, {:?}", s.shed, s.g);
        }
    }

    #[test]
    fn a_stall_and_the_queue_it_leaves_are_not_shed() {
        let mut s = Sim::warm();
        // Nothing ends for 200 ms (a slow fsync, a pause) while turns keep coming.
        s.run(200, 1000.0, 0.0);
        s.run(2000, 1000.0, 2000.0);
        assert!(s.shed == 0 && !s.g.limiting() && s.suspected == 0, "{} shed: {:?}", s.shed, s.g);
    }

    #[test]
    fn a_burst_or_a_closed_loop_on_a_warm_gateway_is_not_shed() {
        let mut s = Sim::warm();
        s.arrive(64);
        s.run(2000, 1000.0, 2000.0);
        assert_eq!(s.shed, 0, "a burst of 64: {:?}", s.g);
        // 64 clients that each ask again when answered, at a quarter of the capacity seen so far.
        s.closed(3000, 64, 500.0);
        assert_eq!(s.shed, 0, "a closed loop of 64: {:?}", s.g);
        assert_eq!(s.suspected, 0, "neither waits to start: {:?}", s.g);
    }

    #[test]
    fn a_burst_spread_over_a_few_ticks_is_not_a_surge() {
        let mut s = Sim::warm();
        // 160 turns in 20 ms (clients catching up after a pause), then the usual traffic.
        s.run(20, 8000.0, 2000.0);
        s.run(2000, 1000.0, 2000.0);
        assert!(s.shed == 0 && !s.g.limiting(), "{} shed: {:?}", s.shed, s.g);
        // It looked like a surge's start for a while: its last turns started
        // a few milliseconds late, none refused.
        assert!(s.suspected <= 20, "suspected for {} ms", s.suspected);
    }

    /// Each turn takes 100 ms whatever the load (an engine with room for
    /// many calls): five times the demand is no surge, though for the first
    /// 100 ms the turns ending are only the old demand's.
    #[test]
    fn more_demand_on_a_gateway_with_room_is_not_a_surge() {
        let mut s = Sim::cold();
        s.run_fixed(2000, 200.0, Duration::from_millis(100));
        s.run_fixed(3000, 1000.0, Duration::from_millis(100));
        assert!(s.shed == 0 && !s.g.limiting(), "{} shed: {:?}", s.shed, s.g);
        // A surge would take 200 ms to see here: waiting for one only delays.
        assert_eq!(s.suspected, 0);
    }

    /// One window of `n` samples at `working` turns.
    fn window_of(g: &mut Gradient, now: &mut Instant, n: usize, working: usize, l: Duration) {
        for _ in 1..n {
            g.sample(l, *now, working);
        }
        *now += WINDOW;
        g.sample(l, *now, working);
    }

    #[test]
    fn work_that_grows_by_less_than_a_busy_windows_jitter_is_no_queue() {
        let (mut g, mut now) = (Gradient::new(&limits(true)), Instant::now());
        for _ in 0..10 {
            window_of(&mut g, &mut now, 100, 4, Duration::from_millis(2));
        }
        // A hiccup: three slow windows whose work ends 6 turns higher each
        // time, while the gateway ends 100 turns a window.
        for working in [10, 16, 22] {
            window_of(&mut g, &mut now, 100, working, Duration::from_millis(10));
        }
        assert!(!g.limiting(), "{g:?}");
    }

    #[test]
    fn under_overload_the_limit_settles_near_the_knee_and_latency_within_tolerance() {
        for tolerance in [2.0, 4.0] {
            let mut l = limits(true);
            l.adaptive_concurrency.tolerance = tolerance;
            let (mut g, mut now, mut working) = (Gradient::new(&l), Instant::now(), 0);
            // Unloaded first (the baseline), then 4× what the gateway ends.
            open_load(&mut g, &mut now, &mut working, 20, 8, 16);
            assert!(!g.limiting(), "below the knee nothing is limited");
            let seen = open_load(&mut g, &mut now, &mut working, 1000, 64, 16);
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
    fn a_fresh_gateway_takes_a_burst_without_shedding() {
        let a = Arc::new(Admission::new(&limits(true)));
        let permits: Vec<_> = (0..64).map(|_| a.try_admit()).collect();
        assert!(permits.iter().all(Result::is_ok), "a burst of 64 at a fresh gateway was shed");
    }

    #[test]
    fn healthy_traffic_at_any_concurrency_is_never_limited() {
        let (mut g, mut now) = (Gradient::new(&limits(true)), Instant::now());
        // 200 turns working at once, all as fast as one: no congestion.
        let seen = load(&mut g, &mut now, 200, 200, 1_000.0);
        assert!(!g.limiting() && seen.iter().all(|l| *l == 1024), "{seen:?}");
    }

    #[test]
    fn a_saturated_closed_loop_is_never_shed() {
        let (mut g, mut now) = (Gradient::new(&limits(true)), Instant::now());
        load(&mut g, &mut now, 10, 2, 2.0);
        // 64 clients, then 256, on a gateway that works 2 turns at once:
        // each waits 32 (then 128) turns' time, and none is ever refused.
        let seen = [load(&mut g, &mut now, 100, 64, 2.0), load(&mut g, &mut now, 100, 256, 2.0)].concat();
        assert!(!g.limiting() && seen.iter().all(|l| *l == 1024), "{g:?}");
    }

    #[test]
    fn slower_work_without_load_moves_the_baseline_instead_of_shedding() {
        let (mut g, mut now) = (Gradient::new(&limits(true)), Instant::now());
        window(&mut g, &mut now, 2, Duration::from_millis(2));
        // Three turns working, each 5× slower (longer histories, a slower engine): not load.
        for _ in 0..20 {
            window(&mut g, &mut now, 3, Duration::from_millis(10));
        }
        assert!(!g.limiting());
        // Growing histories: 1 % slower each window (7× in 20 s), healthy each time.
        let mut l = Duration::from_millis(10);
        for _ in 0..200 {
            l = l.mul_f64(1.01);
            window(&mut g, &mut now, 50, l);
        }
        assert!(!g.limiting(), "a baseline that drifts with the work: {g:?}");
    }

    #[test]
    fn an_engine_slowed_tenfold_under_load_drives_shedding() {
        let (mut g, mut now, mut working) = (Gradient::new(&limits(true)), Instant::now(), 0);
        // 64 turns arrive a window; the gateway ends 128.
        open_load(&mut g, &mut now, &mut working, 20, 64, 128);
        assert!(!g.limiting());
        // The same arrivals; the engine now lets 10× fewer end.
        let seen = open_load(&mut g, &mut now, &mut working, 50, 64, 12);
        assert!(g.limiting() && g.limit() < 64, "{g:?}");
        assert!(seen.iter().all(|l| *l <= 1024) && working < 128, "the queue is bounded: {working} working");
    }

    /// A gateway limiting after an overload: 8 turns a window on a capacity
    /// of 16, then 64.
    fn overloaded() -> (Gradient, Instant) {
        let (mut g, mut now, mut working) = (Gradient::new(&limits(true)), Instant::now(), 0);
        open_load(&mut g, &mut now, &mut working, 20, 8, 16);
        open_load(&mut g, &mut now, &mut working, 50, 64, 16);
        assert!(g.limiting());
        (g, now)
    }

    /// After an overload, a closed loop whose work is now slower (each
    /// turn 5× the unloaded time at any concurrency) must get the gate
    /// open again: it is not load. (Keeping the floor whenever it was slow
    /// — tried for the overload's mid-run spikes — left such a loop shed
    /// for good, its limit cycling between 32 and 37.)
    #[test]
    fn a_slower_closed_loop_after_an_overload_is_let_in_again() {
        let (mut g, mut now) = overloaded();
        let mut seen = Vec::new();
        for _ in 0..400 {
            let w = 64.min(g.limit());
            window(&mut g, &mut now, w, latency(w as f64, 16.0, Duration::from_millis(2)).mul_f64(5.0));
            seen.push(g.limit());
        }
        assert!(!g.limiting(), "a closed loop of 64 still limited after 400 windows: {:?}", &seen[380..]);
    }

    /// Under a flood the floor's turns compete with the refusals for the
    /// CPU, and a window at the floor is over tolerance now and then: that
    /// is not slower work, and opening the gate on it let the flood in
    /// (traced: 700–870 turns working before its surge was seen). Slower
    /// work is slow at the floor window after window, and opens it.
    #[test]
    fn a_floor_slow_now_and_then_keeps_limiting_and_slow_window_after_window_opens_the_gate() {
        let (mut g, mut now) = overloaded();
        let at_floor = |g: &Gradient| matches!(g.mode, Mode::Limiting { limit, .. } if limit <= g.min);
        let (slow, fine) = (Duration::from_millis(5), Duration::from_millis(3));
        while !at_floor(&g) {
            let w = g.limit();
            window(&mut g, &mut now, w, slow);
        }
        // Slow at the floor, then fine (the limit grows), then slow above it
        // and back down: over and over.
        for i in 0..60 {
            let (w, l) = (g.limit(), if i % 2 == 0 || !at_floor(&g) { slow } else { fine });
            window(&mut g, &mut now, w, l);
            assert!(g.limiting(), "window {i}: {g:?}");
        }
        let mut slow_at_floor = 0;
        while g.limiting() && slow_at_floor < 10 {
            slow_at_floor += usize::from(at_floor(&g));
            let w = g.limit();
            window(&mut g, &mut now, w, slow);
        }
        assert!(!g.limiting(), "{g:?}");
        assert_eq!(slow_at_floor, super::FLOOR_WINDOWS as usize, "{g:?}");
    }

    #[test]
    fn limiting_ends_when_demand_falls() {
        let (mut g, mut now, mut working) = (Gradient::new(&limits(true)), Instant::now(), 0);
        open_load(&mut g, &mut now, &mut working, 10, 8, 16);
        open_load(&mut g, &mut now, &mut working, 50, 64, 16);
        assert!(g.limiting());
        open_load(&mut g, &mut now, &mut working, 20, 2, 16);
        assert!(!g.limiting(), "two turns a window for two seconds: {g:?}");
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

    #[tokio::test(start_paused = true)]
    async fn turns_waiting_on_their_model_are_not_work_and_their_wait_is_not_sampled() {
        let a = Arc::new(Admission::new(&limits(true)));
        // 1000 turns each waiting on its model.
        let mut waiting = Vec::new();
        for _ in 0..1000 {
            let mut p = a.try_admit().unwrap();
            p.admitted().await.unwrap();
            p.away();
            waiting.push(p);
        }
        assert_eq!(a.load().0, 0, "a turn waiting on its model is not working");
        // Quick turns meanwhile: 1 ms of work each, never shed.
        for _ in 0..200 {
            let mut p = a.try_admit().expect("a quick turn beside 1000 waiting ones");
            p.admitted().await.expect("nor refused once it holds its session");
            tokio::time::advance(Duration::from_millis(1)).await;
        }
        // The waits end after 10 s; each turn then works 1 ms more.
        tokio::time::advance(Duration::from_secs(10)).await;
        for p in &mut waiting {
            p.back();
        }
        tokio::time::advance(Duration::from_millis(1)).await;
        drop(waiting);
        // One more turn, later, closes the window those 1000 samples are in.
        tokio::time::advance(Duration::from_millis(200)).await;
        let mut p = a.try_admit().unwrap();
        p.admitted().await.unwrap();
        drop(p);
        assert_eq!(a.load().0, 0, "every permit left the working count once");
        let s = a.state();
        let p90 = s.gradient.last_p90.unwrap();
        assert!(p90 < 50_000.0, "the 10 s wait was sampled: p90 {p90} µs");
        assert!(!s.gradient.limiting());
    }

    /// A flood is seen some ticks in: the turns admitted before the limit
    /// fell, and not yet started, are refused before their first durable
    /// work, until only the limit's worth works. Turns already started, and
    /// turns back from their model, go on; an open gateway refuses none.
    #[tokio::test(start_paused = true)]
    async fn turns_admitted_before_the_limit_fell_are_refused_before_they_start() {
        let a = Arc::new(Admission::new(&limits(true)));
        let mut started: Vec<_> = (0..3).map(|_| a.try_admit().unwrap()).collect();
        for p in &mut started {
            p.admitted().await.expect("an open gateway refuses no turn it admitted");
        }
        let mut away = a.try_admit().unwrap();
        away.admitted().await.unwrap();
        away.away();
        let waiting: Vec<_> = (0..9).map(|_| a.try_admit().unwrap()).collect();
        assert_eq!(a.load().0, 12);
        a.state().gradient.mode = Mode::Limiting { limit: 5.0, calm: 0 };
        let (mut refused, mut going) = (Vec::new(), Vec::new());
        for mut p in waiting {
            match p.admitted().await {
                Ok(_) => going.push(p),
                Err(shed) => refused.push(shed),
            }
        }
        assert_eq!((refused.len(), going.len()), (7, 2), "12 working, 5 allowed: the first 7 to start are refused");
        assert!(refused.iter().all(|s| s.limit == 5 && s.retry_after >= Duration::from_millis(10)), "{refused:?}");
        away.back();
        assert_eq!(a.load().0, 6, "a turn back from its model is never refused");
        drop((started, going, away));
        let s = a.state();
        assert_eq!((s.open, s.working), (0, 0), "every permit, refused or not, left once");
        assert_eq!(s.gradient.samples.len(), 6, "a refused turn is no sample: {:?}", s.gradient.samples);
    }

    /// Under a limit that has not fallen since, a turn back from waiting for
    /// its session finds its slot taken by a newer turn: it starts anyway.
    #[tokio::test(start_paused = true)]
    async fn a_turn_admitted_under_the_limit_now_is_not_refused_to_start() {
        let a = Arc::new(Admission::new(&limits(true)));
        a.state().gradient.mode = Mode::Limiting { limit: 2.0, calm: 0 };
        let mut queued = a.try_admit().unwrap();
        queued.away();
        let _others = (a.try_admit().unwrap(), a.try_admit().unwrap());
        queued.back();
        assert_eq!(a.load(), (3, 2));
        queued.admitted().await.expect("admitted under this limit: never refused");
    }

    /// An open gateway whose last ticks look like a surge's first ones.
    fn suspecting(a: &Admission) {
        let now = Instant::now();
        let g = &mut a.state().gradient;
        (g.baseline, g.pace) = (Some(2_000.0), Some(1_000.0));
        g.ticks.start = Some(now);
        g.ticks.streak_start = Some(now - 2 * super::TICK);
        g.ticks.streak_len = super::HOLD_FROM;
        g.ticks.streak.admitted = 100;
        assert!(g.suspect(now));
    }

    #[tokio::test(start_paused = true)]
    async fn a_turn_waits_to_start_while_a_surge_may_be_starting_then_starts() {
        let a = Arc::new(Admission::new(&limits(true)));
        suspecting(&a);
        let mut p = a.try_admit().unwrap();
        let t = Instant::now();
        p.admitted().await.expect("no surge was seen: the turn starts");
        // No tick closed since: the streak is over two ticks later.
        let waited = t.elapsed();
        assert!(waited >= super::TICK && waited <= super::HOLD_MAX, "{waited:?}");
    }

    /// A suspecting gateway with one turn started and one more admitted,
    /// waiting to start (a task of its own).
    async fn one_started_one_waiting() -> (Arc<Admission>, Permit, tokio::task::JoinHandle<Result<(), Shed>>) {
        let a = Arc::new(Admission::new(&limits(true)));
        suspecting(&a);
        let started = a.try_admit().unwrap();
        let waiting = tokio::spawn({
            let a = a.clone();
            async move { a.try_admit().unwrap().admitted().await.map(drop) }
        });
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert!(!waiting.is_finished(), "it waits");
        (a, started, waiting)
    }

    #[tokio::test(start_paused = true)]
    async fn a_turn_waiting_to_start_is_refused_when_the_surge_is_seen() {
        let (a, _started, waiting) = one_started_one_waiting().await;
        a.state().gradient.mode = Mode::Limiting { limit: 1.0, calm: 0 };
        let shed = waiting.await.unwrap().expect_err("two working, one allowed");
        assert_eq!(shed.limit, 1);
        assert_eq!(a.load().0, 1);
    }

    /// `Core::begin` drops the wait when the turn is cancelled meanwhile:
    /// the turn leaves nothing behind, no work and no sample.
    #[tokio::test(start_paused = true)]
    async fn a_turn_cancelled_while_it_waits_to_start_leaves_no_work_and_no_sample() {
        let (a, _started, waiting) = one_started_one_waiting().await;
        assert_eq!(a.load().0, 2);
        waiting.abort();
        assert!(waiting.await.unwrap_err().is_cancelled());
        assert_eq!(a.load().0, 1, "only the started turn works");
        assert_eq!(a.state().open, 1, "only the started turn is open");
        assert!(a.state().gradient.samples.is_empty(), "a turn that never started is no sample");
    }

    #[test]
    fn a_turn_refused_before_it_holds_its_session_is_no_sample() {
        let a = Arc::new(Admission::new(&limits(true)));
        for _ in 0..100 {
            drop(a.try_admit().unwrap());
        }
        let s = a.state();
        assert!(s.gradient.samples.is_empty() && s.gradient.baseline.is_none(), "{:?}", s.gradient);
    }

    #[test]
    fn a_limit_outlives_no_silence() {
        let (mut g, mut now, mut working) = (Gradient::new(&limits(true)), Instant::now(), 0);
        open_load(&mut g, &mut now, &mut working, 10, 8, 16);
        open_load(&mut g, &mut now, &mut working, 50, 64, 16);
        assert!(g.limiting());
        // Nothing ends for ten seconds (no window closes): the next burst finds the gateway open.
        g.quiet(now + super::MAX_WINDOW * super::CALM_WINDOWS);
        assert!(!g.limiting(), "{g:?}");
    }

    /// A queue that fills to a cap within one window and stays there: the
    /// work is flat at the cap, window after window, so it never looks
    /// like growth — but turns are refused at the cap, demand past it, and
    /// that is growth: the gateway starts limiting. The same flat work
    /// without refusals (a closed loop at its size) is not shed.
    #[test]
    fn a_queue_that_fills_to_a_cap_within_a_window_and_stays_there_is_seen() {
        let run = |refusals: usize| {
            let (mut g, mut now) = (Gradient::new(&limits(true)), Instant::now());
            for _ in 0..5 {
                window(&mut g, &mut now, 8, Duration::from_millis(2));
            }
            (0..4)
                .map(|_| {
                    g.refused_at_cap += refusals;
                    window(&mut g, &mut now, 64, Duration::from_millis(16));
                    g.limiting()
                })
                .collect::<Vec<_>>()
        };
        assert!(run(100).iter().any(|l| *l), "refusals at the cap are demand past it: {:?}", run(100));
        assert!(run(0).iter().all(|l| !l), "flat work and nothing refused is a closed loop: {:?}", run(0));
    }

    /// A turn waiting behind its session's running turn is work, as a turn
    /// waiting anywhere is (a flood over few sessions queues there), and its
    /// sample runs from its arrival, the wait included.
    #[tokio::test(start_paused = true)]
    async fn a_turn_waiting_for_its_session_is_work_and_its_wait_is_in_its_sample() {
        let a = Arc::new(Admission::new(&limits(true)));
        let mut p = a.try_admit().unwrap();
        assert_eq!(a.load().0, 1, "waiting to start is work");
        tokio::time::advance(Duration::from_millis(50)).await;
        let waited = p.admitted().await.unwrap();
        assert_eq!(waited, Duration::from_millis(50));
        tokio::time::advance(Duration::from_millis(2)).await;
        drop(p);
        let s = a.state();
        assert_eq!(s.gradient.samples, vec![52_000], "arrival to release, the wait included");
        assert_eq!((s.open, s.working, s.waiting), (0, 0, 0));
    }

    /// Turns admitted and not started are bounded; over the bound a turn is
    /// refused at once naming it, the refusal is demand past a cap, and a
    /// turn that starts (or leaves) frees its place.
    #[tokio::test(start_paused = true)]
    async fn waiting_turns_are_bounded_and_a_refusal_names_the_bound() {
        let l = LimitsSection { max_waiting_turns: 3, ..limits(true) };
        let a = Arc::new(Admission::new(&l));
        let mut waiting: Vec<_> = (0..3).map(|_| a.try_admit().unwrap()).collect();
        let shed = a.try_admit().err().unwrap();
        assert_eq!((shed.why, shed.limit), (ShedReason::Waiting, 3));
        assert!(shed.to_string().contains("3 turns waiting to start (gateway.limits.maxWaitingTurns)"), "{shed}");
        assert_eq!(a.state().gradient.refused_at_cap, 1);
        waiting[0].admitted().await.unwrap();
        let again = a.try_admit().expect("a started turn waits no more");
        drop(waiting.pop());
        drop(again);
        assert!(a.try_admit().is_ok(), "a turn that left freed its place");
    }
}
