//! The limiter's arithmetic on synthetic windows and ticks, and the
//! admission of permits on tokio's paused clock.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::gradient::{Gradient, MIN_SAMPLES, Mode, WINDOW};
use super::{Admission, LimitsSection, Permit, Shed, ShedReason};
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
    /// look like a surge or after [`super::gradient::HOLD_MAX`].
    fn recheck(&mut self) {
        // Held turns arrived while the gateway was open: under its maximum.
        while let Some(&since) = self.held.front() {
            if self.g.refuses_start(self.working(), self.g.max as usize) {
                self.held.pop_front();
                self.g.ending(self.now, self.working());
                self.shed += 1;
            } else if !self.g.suspect(self.now) || self.now.duration_since(since) >= super::gradient::HOLD_MAX {
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
    assert_eq!(slow_at_floor, super::gradient::FLOOR_WINDOWS as usize, "{g:?}");
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
    g.ticks.streak_start = Some(now - 2 * super::gradient::TICK);
    g.ticks.streak_len = super::gradient::HOLD_FROM;
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
    assert!(waited >= super::gradient::TICK && waited <= super::gradient::HOLD_MAX, "{waited:?}");
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
    g.quiet(now + super::gradient::MAX_WINDOW * super::gradient::CALM_WINDOWS);
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
