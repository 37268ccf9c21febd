//! `loadgen`: load for a real `ctxgate serve` process (and, with `--engine
//! window`, a real window engine process), offline model, from this process
//! over loopback.
//!
//! - `closed --sessions 64 --seconds 10`: each session sends its next turn
//!   when the last one ends (after the pushback the gateway asks for, when
//!   it shed the last); turns/s and latency. `--turns 60` ends each session
//!   after that many completed turns instead (the issue's "64 clients × 60
//!   turns"; with `--rounds 2` the second round's histories are twice as
//!   long, plus the warm-up's turn, whatever the machine's pace).
//! - `open --rate 4000 --seconds 5`: arrivals on a fixed schedule, whatever
//!   the gateway does; latency runs from the *scheduled* time, so a gateway
//!   that falls behind cannot hide it (no coordinated omission). Counts
//!   what completed, what was shed (RESOURCE_EXHAUSTED or UNAVAILABLE) and
//!   what failed otherwise.
//! - `overload`: `closed` to find saturation S, `open` at S/2 for the
//!   unloaded p99, then `open` at `--factor` (4) × S on the same gateway;
//!   prints each and the ratios the issue judges (admitted p99 / unloaded
//!   p99, RSS / idle RSS, quarantines).
//! - `soak --minutes 30`: `closed` for S, then `open` at half of S for the
//!   whole time; RSS at the start and the end, and every error.
//! - `hostile --engine fault-flood`: `open` at `--rate` over calm sessions,
//!   alone and then while `--flooders` sessions' turns each have the
//!   engine flood the Host service with its grant for a second
//!   (ReadTranscript and LlmComplete from 16 tasks); the calm turns' p99
//!   side by side (the issue asks for within 2×).
//! - `burst --clients 64 --turns 3`: a fresh gateway (no warm-up) and
//!   every client at once, each a new session; counts sheds (none is the
//!   promise: a gateway that has not measured anything yet sheds nothing).
//! - `held --held 1000 --quick 8`: `--quick` closed-loop clients alone,
//!   then again while `--held` harness turns are open, each waiting on its
//!   (harness's) model; sheds and the quick clients' p99 side by side.
//!
//! The gateway's RSS (from /proc) is sampled every 100 ms: idle (after the
//! warm-up), peak and at the end.
//!
//! ```text
//! cargo build --release --workspace --bins
//! target/release/loadgen overload --engine legacy
//! target/release/loadgen overload --engine window
//! target/release/loadgen overload --engine fault-slow --seconds 12
//! target/release/loadgen closed --sessions 64 --turns 60 --rounds 2
//! target/release/loadgen soak --minutes 30
//! target/release/loadgen hostile --engine fault-flood
//! target/release/loadgen burst --clients 64
//! target/release/loadgen held --held 1000 --quick 8
//! ```

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};
use ctxgate_proto::gateway::harness_client::HarnessClient;
use ctxgate_proto::gateway::{self as api, gateway_client::GatewayClient, turn_event::Event};
use ctxgate_proto::pb::Role;
use ctxgate_tests::harness::{Drive, begin, text};
use ctxgate_tests::{EngineProcess, bin};
use tokio::time::Instant;
use tokio_stream::StreamExt;
use tonic::transport::Channel;

#[derive(Parser)]
#[command(about = "Open- and closed-loop load for a ctxgate gateway process")]
struct Args {
    #[command(subcommand)]
    run: Run,
    /// The context engine behind the gateway.
    #[arg(long, value_enum, default_value_t = EngineKind::Legacy, global = true)]
    engine: EngineKind,
    /// Client connections to the gateway (streams are spread over them).
    #[arg(long, default_value_t = 8, global = true)]
    connections: usize,
    /// Extra JSON5 lines inside the gateway config's `gateway: { limits: { … } }`.
    #[arg(long, default_value = "", global = true)]
    limits: String,
    /// The store's cache of visible tails (`store.tailCacheMiB`; unset: the
    /// gateway's default).
    #[arg(long, global = true)]
    tail_cache_mib: Option<u32>,
    /// The gateway binary (default: the `ctxgate` built next to this one),
    /// to compare builds side by side.
    #[arg(long, global = true)]
    gateway_bin: Option<std::path::PathBuf>,
    /// The store: SQLite in each gateway's state dir, or a PostgreSQL
    /// cluster this run starts (fsync on) and every gateway shares.
    #[arg(long, value_enum, default_value_t = StoreKind::Sqlite, global = true)]
    store: StoreKind,
    /// Gateway processes (more than one needs `--store postgres`); a
    /// session's consecutive turns go to different gateways.
    #[arg(long, default_value_t = 1, global = true)]
    gateways: usize,
    /// PostgreSQL connections per gateway (`store.poolSize`).
    #[arg(long, default_value_t = 16, global = true)]
    pool_size: usize,
    /// With `--store postgres`, a closed loop also lists how often each
    /// statement ran per turn (`pg_stat_statements`).
    #[arg(long, global = true)]
    statements: bool,
}

#[derive(Clone, Copy, ValueEnum, PartialEq)]
enum StoreKind {
    Sqlite,
    Postgres,
}

#[derive(Subcommand)]
enum Run {
    Closed {
        #[arg(long, default_value_t = 64)]
        sessions: usize,
        #[arg(long, default_value_t = 10.0)]
        seconds: f64,
        /// Each session stops after this many turns (completed or failed;
        /// a shed turn is sent again), instead of after `--seconds` (which
        /// it ignores; a run ends after ten minutes at most).
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
        turns: Option<u64>,
        /// Runs over the same sessions, one after the other (their
        /// histories grow: the second shows what that costs).
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
        rounds: u64,
    },
    Open {
        #[arg(long)]
        rate: f64,
        #[arg(long, default_value_t = 5.0)]
        seconds: f64,
        /// Arrivals go round-robin over this many sessions.
        #[arg(long, default_value_t = 4096)]
        sessions: usize,
    },
    Overload {
        #[arg(long, default_value_t = 64)]
        sessions: usize,
        #[arg(long, default_value_t = 4.0)]
        factor: f64,
        #[arg(long, default_value_t = 10.0)]
        seconds: f64,
        /// The open loops go round-robin over this many sessions (fewer
        /// sessions: turns wait behind their session's running turn).
        #[arg(long, default_value_t = 4096)]
        open_sessions: usize,
    },
    Soak {
        #[arg(long, default_value_t = 30.0)]
        minutes: f64,
        #[arg(long, default_value_t = 64)]
        sessions: usize,
    },
    Burst {
        #[arg(long, default_value_t = 64)]
        clients: usize,
        #[arg(long, default_value_t = 3)]
        turns: usize,
    },
    /// One turn on each of `sessions` sessions at `rate` (peak RSS), then
    /// the gateway restarted over what it stored (RSS once it serves).
    Memory {
        #[arg(long, default_value_t = 100_000)]
        sessions: usize,
        #[arg(long, default_value_t = 1500.0)]
        rate: f64,
    },
    Held {
        #[arg(long, default_value_t = 1000)]
        held: usize,
        #[arg(long, default_value_t = 8)]
        quick: usize,
        /// Each quick phase; the held turns stay open for the second.
        #[arg(long, default_value_t = 10.0)]
        seconds: f64,
    },
    Hostile {
        #[arg(long, default_value_t = 100.0)]
        rate: f64,
        #[arg(long, default_value_t = 10.0)]
        seconds: f64,
        #[arg(long, default_value_t = 4)]
        flooders: usize,
    },
}

#[derive(Clone, Copy, ValueEnum, PartialEq)]
enum EngineKind {
    Legacy,
    Window,
    /// The fault fixture with `--fault flood`: turns of sessions named
    /// `flood-…` flood the Host service; the others are plain.
    FaultFlood,
    /// The fault fixture with `--fault serial-10ms`: an engine that serves
    /// ~100 Assembles a second, one at a time.
    FaultSlow,
}

impl EngineKind {
    /// The engine's id in the gateway's config (none: legacy).
    fn id(self) -> Option<&'static str> {
        match self {
            Self::Legacy => None,
            Self::Window => Some("window"),
            Self::FaultFlood | Self::FaultSlow => Some("fault"),
        }
    }
}

/// What a run saw.
#[derive(Default)]
struct Tally {
    /// Latency of each completed turn, µs.
    latencies: Vec<u64>,
    shed: u64,
    /// Other errors, with the first few messages.
    errors: u64,
    samples: Vec<String>,
    /// Open loop only: (arrival since the start, latency if completed).
    timeline: Vec<(Duration, Option<Duration>)>,
}

impl Tally {
    fn add(&mut self, outcome: Outcome, latency: Duration) {
        match outcome {
            Outcome::Completed => self.latencies.push(latency.as_micros() as u64),
            Outcome::Shed(_) => self.shed += 1,
            Outcome::Error(e) => {
                self.errors += 1;
                if self.samples.len() < 5 {
                    self.samples.push(e);
                }
            }
        }
    }

    fn percentile(&self, p: f64) -> Duration {
        percentile(&mut self.latencies.clone(), p)
    }

    fn report(&self, what: &str, elapsed: Duration) {
        let rate = self.latencies.len() as f64 / elapsed.as_secs_f64();
        println!(
            "{what}: {} completed ({rate:.0}/s over {:.1} s), {} shed, {} errors; latency p50 {:.2} ms, p90 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
            self.latencies.len(),
            elapsed.as_secs_f64(),
            self.shed,
            self.errors,
            ms(self.percentile(0.5)),
            ms(self.percentile(0.9)),
            ms(self.percentile(0.99)),
            ms(self.percentile(1.0)),
        );
        for s in &self.samples {
            println!("  error: {s}");
        }
    }

    /// Admitted turns and their p99 by when they arrived (an open loop's
    /// overload onset against its steady state).
    fn report_timeline(&self, slice: Duration) {
        let mut slices: BTreeMap<u64, (Vec<u64>, u64)> = BTreeMap::new();
        for (at, latency) in &self.timeline {
            let e = slices.entry((at.as_millis() / slice.as_millis().max(1)) as u64).or_default();
            match latency {
                Some(l) => e.0.push(l.as_micros() as u64),
                None => e.1 += 1,
            }
        }
        let line: Vec<String> = slices
            .into_iter()
            .map(|(k, (mut l, not_done))| {
                let p99 = ms(percentile(&mut l, 0.99));
                format!(
                    "{:.1}s: {} done, {not_done} not done, p99 {p99:.0} ms",
                    (k * slice.as_millis() as u64) as f64 / 1e3,
                    l.len()
                )
            })
            .collect();
        println!("  by arrival: {}", line.join(" | "));
    }
}

/// The `p` quantile of latencies in µs (zero for none).
fn percentile(latencies: &mut [u64], p: f64) -> Duration {
    latencies.sort_unstable();
    if latencies.is_empty() {
        return Duration::ZERO;
    }
    let i = ((latencies.len() as f64 * p).ceil() as usize).clamp(1, latencies.len()) - 1;
    Duration::from_micros(latencies[i])
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

enum Outcome {
    Completed,
    /// With the gateway's `grpc-retry-pushback-ms`.
    Shed(Option<Duration>),
    Error(String),
}

/// The gateways (and engine, and PostgreSQL) under load.
struct Stack {
    /// Connection-major: channel `j` goes to gateway `j % gateways`.
    channels: Vec<Channel>,
    /// The first gateway (its RSS is what is reported); `None` only while
    /// it restarts.
    gateway: Option<EngineProcess>,
    /// How the first gateway was started (program, arguments).
    first_gateway: (std::path::PathBuf, Vec<String>),
    /// The other gateways (`--gateways N`).
    more: Vec<EngineProcess>,
    _engine: Option<EngineProcess>,
    postgres: Option<ctxgate_tests::postgres::Postgres>,
    _dir: tempfile::TempDir,
}

impl Stack {
    async fn start(args: &Args) -> Result<Self, String> {
        let (engine, connections, limits) = (args.engine, args.connections, args.limits.as_str());
        let gateway_bin = args.gateway_bin.clone();
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let path = |p: &str| dir.path().join(p).to_str().map(str::to_owned).ok_or("non-UTF-8 temp dir");
        let engine_process = match engine {
            EngineKind::Legacy => None,
            EngineKind::Window => {
                let state = path("engine")?;
                std::fs::create_dir_all(&state).map_err(|e| e.to_string())?;
                let args = ["--listen", "127.0.0.1:0", "--state-dir", state.as_str()];
                Some(EngineProcess::start(bin("ctxgate-engine-window"), &args).await.map_err(|e| e.to_string())?)
            }
            EngineKind::FaultFlood | EngineKind::FaultSlow => {
                let fault = if engine == EngineKind::FaultFlood { "flood" } else { "serial-10ms" };
                let args = ["--listen", "127.0.0.1:0", "--fault", fault];
                Some(EngineProcess::start(bin("ctxgate-fault-engine"), &args).await.map_err(|e| e.to_string())?)
            }
        };
        let plugins = match (&engine_process, engine.id()) {
            (Some(e), Some(id)) => format!(
                "plugins: {{ slots: {{ contextEngine: '{id}' }}, entries: {{ {id}: {{ endpoint: '{}' }} }} }},",
                e.endpoint
            ),
            _ => String::new(),
        };
        if args.gateways > 1 && args.store != StoreKind::Postgres {
            return Err("several gateways need one shared store: add --store postgres".into());
        }
        let postgres = match args.store {
            StoreKind::Sqlite => None,
            StoreKind::Postgres => Some(ctxgate_tests::postgres::Postgres::start(true).await),
        };
        let tails = args.tail_cache_mib.map_or(String::new(), |m| format!("tailCacheMiB: {m},"));
        let store = match &postgres {
            None => format!("store: {{ {tails} }},"),
            Some(pg) => {
                format!("store: {{ url: '{}', poolSize: {}, {tails} }},", pg.database("loadgen").await, args.pool_size)
            }
        };
        let config = format!("{{ gateway: {{ limits: {{ {limits} }} }}, {plugins} {store} }}\n");
        let config_path = path("ctxgate.json5")?;
        std::fs::write(&config_path, config).map_err(|e| e.to_string())?;
        let program = gateway_bin.unwrap_or_else(|| bin("ctxgate"));
        let mut gateways = Vec::new();
        for g in 0..args.gateways.max(1) {
            let state = path(&format!("gateway-{g}"))?;
            let args =
                ["serve", "--listen", "127.0.0.1:0", "--state-dir", state.as_str(), "--config", config_path.as_str()];
            gateways.push(EngineProcess::start(&program, &args).await.map_err(|e| e.to_string())?);
        }
        let mut channels = Vec::new();
        for _ in 0..connections.max(1) {
            for g in &gateways {
                let endpoint =
                    tonic::transport::Endpoint::from_shared(g.endpoint.clone()).map_err(|e| e.to_string())?;
                channels.push(endpoint.tcp_nodelay(true).connect().await.map_err(|e| e.to_string())?);
            }
        }
        let gateway = gateways.remove(0);
        let first_gateway = (
            program,
            vec![
                "serve".to_owned(),
                "--listen".into(),
                "127.0.0.1:0".into(),
                "--state-dir".into(),
                path("gateway-0")?,
                "--config".into(),
                config_path,
            ],
        );
        let stack = Self {
            channels,
            gateway: Some(gateway),
            first_gateway,
            more: gateways,
            _engine: engine_process,
            postgres,
            _dir: dir,
        };
        if let Some(id) = engine.id() {
            stack.wait_attached(id).await?;
        }
        Ok(stack)
    }

    /// The PostgreSQL server's counters, once the last second's are
    /// published (None on SQLite).
    async fn store_work(&self) -> Option<ctxgate_tests::postgres::Work> {
        let pg = self.postgres.as_ref()?;
        tokio::time::sleep(Duration::from_millis(1500)).await;
        Some(pg.work("loadgen").await)
    }

    /// How often each statement has run so far, when asked for
    /// (`--statements`, PostgreSQL only).
    async fn statement_calls(&self, asked: bool) -> Option<HashMap<String, (i64, f64)>> {
        Some(self.postgres.as_ref().filter(|_| asked)?.statement_calls("loadgen").await)
    }

    fn client(&self, i: usize) -> GatewayClient<Channel> {
        GatewayClient::new(self.channels[i % self.channels.len()].clone())
    }

    async fn wait_attached(&self, id: &str) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let s = self.client(0).get_status(api::StatusRequest {}).await.map_err(|e| e.to_string())?.into_inner();
            if s.engines.iter().any(|e| e.id == id && e.quarantine.is_none() && !e.name.is_empty()) {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("the engine {id:?} never attached"));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The engines the gateway holds in quarantine, with the reason.
    async fn quarantined(&self) -> Result<Vec<String>, String> {
        let s = self.client(0).get_status(api::StatusRequest {}).await.map_err(|e| e.to_string())?.into_inner();
        Ok(s.engines.iter().filter_map(|e| e.quarantine.as_ref().map(|q| format!("{}: {q:?}", e.id))).collect())
    }

    fn gateway(&self) -> &EngineProcess {
        self.gateway.as_ref().expect("the first gateway runs (it is missing only inside restart)")
    }

    /// CPU time every gateway has used: with several, a turn's cost is
    /// theirs together.
    fn gateways_cpu(&self) -> Duration {
        self.gateway.iter().chain(&self.more).map(|g| cpu_time(g.pid())).sum()
    }

    /// Stops the first gateway (SIGTERM: a clean shutdown) and starts it
    /// again over the same state and config.
    async fn restart(&mut self) -> Result<(), String> {
        if let Some(g) = self.gateway.take() {
            g.signal_and_wait("TERM").await.map_err(|e| e.to_string())?;
        }
        let (program, args) = &self.first_gateway;
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.gateway = Some(EngineProcess::start(program, &args).await.map_err(|e| e.to_string())?);
        Ok(())
    }

    fn rss_kib(&self) -> u64 {
        rss_kib(self.gateway().pid())
    }

    /// One warm-up turn per session (creating a session is not a steady
    /// turn's cost).
    /// 16 at a time; a shed warm-up turn is retried after its pushback,
    /// so every session is created before anything is measured.
    async fn warm_up(&self, sessions: usize) -> Result<(), String> {
        let mut set = tokio::task::JoinSet::new();
        for i in 0..sessions {
            if set.len() >= 16
                && let Some(r) = set.join_next().await
            {
                r.map_err(|e| e.to_string())??;
            }
            let c = self.client(i);
            set.spawn(async move {
                loop {
                    match one_turn(c.clone(), i).await {
                        Outcome::Completed => return Ok(()),
                        Outcome::Shed(p) => tokio::time::sleep(p.unwrap_or(Duration::from_millis(100))).await,
                        Outcome::Error(e) => return Err(format!("warm-up: {e}")),
                    }
                }
            });
        }
        while let Some(r) = set.join_next().await {
            r.map_err(|e| e.to_string())??;
        }
        Ok(())
    }
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(Path::new("/proc").join(pid.to_string()).join("status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Each statement that ran between two readings, per turn, most frequent
/// first (the readings' own statements and the counters' are left out).
fn print_statements(before: &HashMap<String, (i64, f64)>, after: &HashMap<String, (i64, f64)>, turns: f64) {
    let mut ran: Vec<(i64, f64, &str)> = after
        .iter()
        .map(|(q, &(n, ms))| {
            let (n0, ms0) = before.get(q).copied().unwrap_or_default();
            (n - n0, ms - ms0, q.as_str())
        })
        .filter(|(n, _, q)| *n > 0 && !q.contains("pg_stat_"))
        .collect();
    ran.sort_by(|a, b| b.0.cmp(&a.0).then(a.2.cmp(b.2)));
    println!("    calls  µs run  (per turn; the run is the executor's, not parsing or the round trip)");
    for (n, ms, q) in ran {
        let q = q.split_whitespace().collect::<Vec<_>>().join(" ");
        println!(
            "    {:>5.2}  {:>6.0}  {}",
            n as f64 / turns,
            ms * 1e3 / turns,
            q.chars().take(100).collect::<String>()
        );
    }
}

/// CPU time the process has used (user + system), from /proc: the
/// gateway's cost per turn, whatever the client's own share of the cores.
fn cpu_time(pid: u32) -> Duration {
    ctxgate_tests::proc_stat::proc_stat(pid).map_or(Duration::ZERO, |p| p.cpu())
}

/// Peak RSS while `f` runs (sampled every 100 ms).
struct RssWatch {
    peak: Arc<AtomicU64>,
    stop: tokio_util::sync::CancellationToken,
}

impl RssWatch {
    fn start(pid: u32) -> Self {
        let peak = Arc::new(AtomicU64::new(rss_kib(pid)));
        let stop = tokio_util::sync::CancellationToken::new();
        let (p, s) = (peak.clone(), stop.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            while s.run_until_cancelled(tick.tick()).await.is_some() {
                p.fetch_max(rss_kib(pid), Ordering::Relaxed);
            }
        });
        Self { peak, stop }
    }

    fn peak(&self) -> u64 {
        self.peak.load(Ordering::Relaxed)
    }
}

impl Drop for RssWatch {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn key(i: usize) -> String {
    format!("load-{i}")
}

async fn one_turn(c: GatewayClient<Channel>, session: usize) -> Outcome {
    turn_on(c, key(session)).await
}

async fn turn_on(mut c: GatewayClient<Channel>, session_key: String) -> Outcome {
    let req = api::RunTurnRequest {
        session: Some(api::SessionRef { agent_id: String::new(), session_key }),
        message: "How is the build going today?".into(),
        ..Default::default()
    };
    let classify = |s: tonic::Status| match s.code() {
        tonic::Code::ResourceExhausted | tonic::Code::Unavailable => Outcome::Shed(
            s.metadata()
                .get("grpc-retry-pushback-ms")
                .and_then(|v| v.to_str().ok()?.parse().ok())
                .map(Duration::from_millis),
        ),
        _ => Outcome::Error(format!("{:?}: {}", s.code(), s.message())),
    };
    let mut stream = match c.run_turn(req).await {
        Ok(s) => s.into_inner(),
        Err(s) => return classify(s),
    };
    let mut done = false;
    while let Some(e) = stream.next().await {
        match e.map(|e| e.event) {
            Ok(Some(Event::Completed(_))) => done = true,
            Ok(Some(Event::Failed(f))) => return Outcome::Error(format!("turn failed: {}", f.message)),
            Ok(_) => {}
            Err(s) => return classify(s),
        }
    }
    if done { Outcome::Completed } else { Outcome::Error("the stream ended without `completed`".into()) }
}

/// How long a `--turns` run may last, whatever it has left.
const TURNS_DEADLINE: Duration = Duration::from_secs(600);

/// How long each closed-loop session goes on.
#[derive(Clone, Copy)]
enum Until {
    Seconds(f64),
    Turns(u64),
}

async fn closed(stack: &Stack, sessions: usize, seconds: f64) -> (Tally, Duration) {
    closed_until(stack, sessions, Until::Seconds(seconds)).await
}

async fn closed_until(stack: &Stack, sessions: usize, limit: Until) -> (Tally, Duration) {
    let tally = Arc::new(Mutex::new(Tally::default()));
    let started = Instant::now();
    // A turn ends completed or failed; a shed one is sent again (for at
    // most ten minutes: a gateway that sheds every turn ends the run).
    let going = move |ended: u64| match limit {
        Until::Seconds(s) => started.elapsed() < Duration::from_secs_f64(s),
        Until::Turns(k) => ended < k && started.elapsed() < TURNS_DEADLINE,
    };
    let tasks: Vec<_> = (0..sessions)
        .map(|i| {
            let (clients, tally) =
                ((0..stack.channels.len()).map(|k| stack.client(i + k)).collect::<Vec<_>>(), tally.clone());
            tokio::spawn(async move {
                let (mut n, mut ended) = (0, 0);
                while going(ended) {
                    let t = Instant::now();
                    // The next connection each turn: with several gateways,
                    // the next gateway.
                    let outcome = one_turn(clients[n % clients.len()].clone(), i).await;
                    n += 1;
                    // A shed client waits as the gateway asks (as gRPC's
                    // retry policy does), then sends its next turn.
                    let pause = match outcome {
                        Outcome::Shed(p) => p.unwrap_or(Duration::from_millis(100)),
                        Outcome::Completed | Outcome::Error(_) => {
                            ended += 1;
                            Duration::ZERO
                        }
                    };
                    tally.lock().unwrap_or_else(|e| e.into_inner()).add(outcome, t.elapsed());
                    tokio::time::sleep(pause).await;
                }
            })
        })
        .collect();
    for t in tasks {
        let _ = t.await;
    }
    let elapsed = started.elapsed();
    (take(tally), elapsed)
}

/// `timeline`: keep each arrival's outcome for [`Tally::report_timeline`]
/// (not in a soak: it would grow with every turn).
async fn open(stack: &Stack, rate: f64, seconds: f64, sessions: usize, timeline: bool) -> (Tally, Duration) {
    let tally = Arc::new(Mutex::new(Tally::default()));
    let n = (rate * seconds).round() as u64;
    let started = Instant::now();
    // Finished arrivals are reaped as it goes (a soak makes millions).
    let mut tasks = tokio::task::JoinSet::new();
    for k in 0..n {
        let scheduled = started + Duration::from_secs_f64(k as f64 / rate);
        tokio::time::sleep_until(scheduled).await;
        while tasks.try_join_next().is_some() {}
        let session = k as usize % sessions;
        let (c, tally) = (stack.client(k as usize), tally.clone());
        tasks.spawn(async move {
            let outcome = one_turn(c, session).await;
            let latency = scheduled.elapsed();
            let completed = matches!(outcome, Outcome::Completed).then_some(latency);
            let mut t = tally.lock().unwrap_or_else(|e| e.into_inner());
            if timeline {
                t.timeline.push((scheduled - started, completed));
            }
            t.add(outcome, latency);
        });
    }
    while tasks.join_next().await.is_some() {}
    let elapsed = started.elapsed();
    (take(tally), elapsed)
}

fn take(t: Arc<Mutex<Tally>>) -> Tally {
    std::mem::take(&mut *t.lock().unwrap_or_else(|e| e.into_inner()))
}

/// The gateway's CPU over an open loop's calls, refused and failed ones
/// included (in an overload most are refused: what a refusal costs shows
/// here).
fn print_call_cpu(used: Duration, t: &Tally, elapsed: Duration) {
    println!(
        "  gateway CPU: {:.0} µs per call answered (turns, refusals, errors), {:.0} % of a core",
        used.as_secs_f64() * 1e6 / (t.latencies.len() as u64 + t.shed + t.errors).max(1) as f64,
        100.0 * used.as_secs_f64() / elapsed.as_secs_f64()
    );
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

async fn run(args: Args) -> Result<bool, String> {
    let stack = Stack::start(&args).await?;
    let engine = args.engine.id().unwrap_or("legacy");
    let mut ok = true;
    match args.run {
        Run::Closed { sessions, seconds, turns, rounds } => {
            let limit = turns.map_or(Until::Seconds(seconds), Until::Turns);
            stack.warm_up(sessions).await?;
            for round in 1..=rounds {
                let before = stack.store_work().await;
                let calls_before = stack.statement_calls(args.statements).await;
                let cpu = stack.gateways_cpu();
                let (t, e) = closed_until(&stack, sessions, limit).await;
                t.report(&format!("closed loop, {engine}, {sessions} sessions, round {round}"), e);
                let used = stack.gateways_cpu().saturating_sub(cpu);
                println!(
                    "  gateway CPU{}: {:.0} µs per turn ({:.0} % of a core)",
                    if stack.more.is_empty() { "" } else { " (all gateways)" },
                    used.as_secs_f64() * 1e6 / t.latencies.len().max(1) as f64,
                    100.0 * used.as_secs_f64() / e.as_secs_f64()
                );
                if let (Some(before), Some(after)) = (before, stack.store_work().await) {
                    let (w, turns) = (after - before, t.latencies.len().max(1) as f64);
                    println!(
                        "  PostgreSQL per turn: {:.1} statements, {:.2} commits, {:.2} WAL flushes, {:.0} µs of CPU",
                        w.statements as f64 / turns,
                        w.commits as f64 / turns,
                        w.wal_flushes as f64 / turns,
                        w.cpu.as_secs_f64() * 1e6 / turns
                    );
                }
                if let (Some(before), Some(after)) = (calls_before, stack.statement_calls(args.statements).await) {
                    print_statements(&before, &after, t.latencies.len().max(1) as f64);
                }
                ok &= t.errors == 0;
            }
        }
        Run::Open { rate, seconds, sessions } => {
            stack.warm_up(sessions).await?;
            let idle = stack.rss_kib();
            let watch = RssWatch::start(stack.gateway().pid());
            let cpu = stack.gateways_cpu();
            let (t, e) = open(&stack, rate, seconds, sessions, false).await;
            let used = stack.gateways_cpu().saturating_sub(cpu);
            t.report(&format!("open loop, {engine}, {rate:.0}/s offered"), e);
            print_call_cpu(used, &t, e);
            println!("gateway RSS: idle {:.1} MiB, peak {:.1} MiB", mib(idle), mib(watch.peak()));
            ok &= t.errors == 0;
        }
        Run::Overload { sessions, factor, seconds, open_sessions } => {
            stack.warm_up(sessions).await?;
            let (base, e) = closed(&stack, sessions, seconds).await;
            base.report(&format!("closed loop, {engine}, {sessions} sessions"), e);
            let saturation = base.latencies.len() as f64 / e.as_secs_f64();
            stack.warm_up(open_sessions).await?;
            // Unloaded: the same open-loop traffic at half of saturation.
            let (calm, e) = open(&stack, saturation / 2.0, seconds / 2.0, open_sessions, false).await;
            calm.report(&format!("open loop, {engine}, {:.0}/s offered (unloaded: ½ saturation)", saturation / 2.0), e);
            let rate = saturation * factor;
            let idle = stack.rss_kib();
            let watch = RssWatch::start(stack.gateway().pid());
            let cpu = stack.gateways_cpu();
            let (t, e) = open(&stack, rate, seconds / 2.0, open_sessions, true).await;
            let used = stack.gateways_cpu().saturating_sub(cpu);
            t.report(&format!("open loop, {engine}, {rate:.0}/s offered ({factor}× saturation)"), e);
            print_call_cpu(used, &t, e);
            t.report_timeline(Duration::from_millis(500));
            let quarantined = stack.quarantined().await?;
            let p99 = ms(t.percentile(0.99)) / ms(calm.percentile(0.99)).max(1e-3);
            let rss = mib(watch.peak()) / mib(idle).max(1e-3);
            println!(
                "overload verdict: shed {:.0} %, admitted p99 / unloaded p99 = {p99:.2} (≤ 3), peak RSS / idle = {rss:.2} ({:.1} / {:.1} MiB, ≤ 2), {} errors, quarantined: {quarantined:?}",
                100.0 * t.shed as f64 / (t.shed + t.latencies.len() as u64 + t.errors).max(1) as f64,
                mib(watch.peak()),
                mib(idle),
                t.errors,
            );
            ok &= t.errors == 0 && calm.errors == 0 && quarantined.is_empty() && p99 <= 3.0 && rss <= 2.0;
        }
        Run::Soak { minutes, sessions } => {
            stack.warm_up(sessions).await?;
            let (base, e) = closed(&stack, sessions, 10.0).await;
            base.report(&format!("closed loop, {engine}, {sessions} sessions"), e);
            let rate = base.latencies.len() as f64 / e.as_secs_f64() / 2.0;
            stack.warm_up(1024).await?;
            let start = stack.rss_kib();
            let watch = RssWatch::start(stack.gateway().pid());
            let (t, e) = open(&stack, rate, minutes * 60.0, 1024, false).await;
            let end = stack.rss_kib();
            t.report(&format!("soak, {engine}, {rate:.0}/s for {minutes} min"), e);
            let growth = 100.0 * (end as f64 - start as f64) / start.max(1) as f64;
            println!(
                "soak verdict: RSS start {:.1} MiB, end {:.1} MiB ({growth:+.1} %), peak {:.1} MiB; {} shed, {} errors",
                mib(start),
                mib(end),
                mib(watch.peak()),
                t.shed,
                t.errors
            );
            ok &= t.errors == 0 && t.shed == 0 && growth < 5.0;
        }
        Run::Burst { clients, turns } => {
            let tally = Arc::new(Mutex::new(Tally::default()));
            let started = Instant::now();
            let tasks: Vec<_> = (0..clients)
                .map(|i| {
                    let (c, tally) = (stack.client(i), tally.clone());
                    tokio::spawn(async move {
                        for _ in 0..turns {
                            // Shed turns are retried after the pushback: each
                            // client completes all of its turns (within 100
                            // tries: a gateway gone is no burst to measure).
                            for _ in 0..100 {
                                let t = Instant::now();
                                let outcome = one_turn(c.clone(), i).await;
                                let retry = match &outcome {
                                    Outcome::Shed(p) => Some(p.unwrap_or(Duration::from_millis(100))),
                                    _ => None,
                                };
                                tally.lock().unwrap_or_else(|e| e.into_inner()).add(outcome, t.elapsed());
                                match retry {
                                    Some(p) => tokio::time::sleep(p).await,
                                    None => break,
                                }
                            }
                        }
                    })
                })
                .collect();
            for t in tasks {
                let _ = t.await;
            }
            let t = take(tally);
            t.report(
                &format!("burst on a fresh gateway, {engine}, {clients} clients × {turns} turns"),
                started.elapsed(),
            );
            println!("burst verdict: {} shed (0 asked)", t.shed);
            ok &= t.errors == 0 && t.shed == 0;
        }
        Run::Memory { sessions, rate } => {
            let watch = RssWatch::start(stack.gateway().pid());
            let (t, e) = open(&stack, rate, sessions as f64 / rate, sessions, false).await;
            t.report(&format!("open loop, {engine}, one turn on each of {sessions} sessions"), e);
            let peak = watch.peak();
            drop(watch);
            let mut stack = stack;
            stack.restart().await?;
            // Serving again: a status call, then a turn on a stored session.
            let mut c = GatewayClient::new(
                tonic::transport::Endpoint::from_shared(stack.gateway().endpoint.clone())
                    .map_err(|e| e.to_string())?
                    .connect()
                    .await
                    .map_err(|e| e.to_string())?,
            );
            c.get_status(api::StatusRequest {}).await.map_err(|e| e.to_string())?;
            let after = one_turn(c, 0).await;
            println!(
                "gateway RSS: peak {:.1} MiB while serving; {:.1} MiB after a restart over the {sessions} stored sessions ({})",
                mib(peak),
                mib(stack.rss_kib()),
                if matches!(after, Outcome::Completed) {
                    "a stored session's turn completed"
                } else {
                    "a stored session's turn FAILED"
                }
            );
            ok &= t.errors == 0 && matches!(after, Outcome::Completed);
            return Ok(ok);
        }
        Run::Held { held, quick, seconds } => {
            stack.warm_up(quick).await?;
            let (idle, e) = closed(&stack, quick, seconds).await;
            idle.report(&format!("closed loop, {engine}, {quick} sessions, nothing held"), e);
            // Held turns on connections of their own (at most 200 streams
            // each, under the per-connection limit).
            let endpoint =
                tonic::transport::Endpoint::from_shared(stack.gateway().endpoint.clone()).map_err(|e| e.to_string())?;
            let mut channels = Vec::new();
            for _ in 0..held.div_ceil(200) {
                channels.push(endpoint.clone().connect().await.map_err(|e| e.to_string())?);
            }
            let opened = Instant::now();
            let mut set = tokio::task::JoinSet::new();
            let mut drives = Vec::new();
            let mut refused = Vec::new();
            for i in 0..held {
                if set.len() >= 32
                    && let Some(r) = set.join_next().await
                {
                    match r.map_err(|e| e.to_string())? {
                        Ok(d) => drives.push(d),
                        Err(s) => refused.push(s),
                    }
                }
                let client = HarnessClient::new(channels[i % channels.len()].clone());
                set.spawn(async move {
                    let mut d = Drive::open(&client, begin(&format!("held-{i}"), "Think this over.")).await?;
                    d.context().await?;
                    Ok::<_, tonic::Status>(d)
                });
            }
            while let Some(r) = set.join_next().await {
                match r.map_err(|e| e.to_string())? {
                    Ok(d) => drives.push(d),
                    Err(s) => refused.push(s),
                }
            }
            println!(
                "held: {} harness turns open (their models running) in {:.1} s, {} refused{}",
                drives.len(),
                opened.elapsed().as_secs_f64(),
                refused.len(),
                refused.first().map(|s| format!(" (first: {:?}: {})", s.code(), s.message())).unwrap_or_default()
            );
            let (busy, e) = closed(&stack, quick, seconds).await;
            busy.report(&format!("closed loop, {engine}, {quick} sessions, {} turns held", drives.len()), e);
            // The held turns' models answer: each stores its reply and ends.
            let mut ended = 0;
            let mut failures = Vec::new();
            for mut d in drives {
                let step = async {
                    d.append(vec![text(Role::Assistant, "Here is what I think.")]).await?;
                    d.end(api::TurnOutcome::Accepted).await
                };
                match step.await {
                    Ok(_) => ended += 1,
                    Err(s) => failures.push(format!("{:?}: {}", s.code(), s.message())),
                }
            }
            let p99 = ms(busy.percentile(0.99)) / ms(idle.percentile(0.99)).max(1e-3);
            println!(
                "held verdict: quick p99 with the held turns / without = {p99:.2} (≤ 2); {} shed; {} held refused; {ended} held ended, {} failed{}",
                busy.shed + idle.shed,
                refused.len(),
                failures.len(),
                failures.first().map(|f| format!(" (first: {f})")).unwrap_or_default()
            );
            ok &= refused.is_empty()
                && failures.is_empty()
                && busy.errors == 0
                && busy.shed + idle.shed == 0
                && p99 <= 2.0;
        }
        Run::Hostile { rate, seconds, flooders } => {
            if args.engine != EngineKind::FaultFlood {
                return Err("hostile needs --engine fault-flood".into());
            }
            stack.warm_up(256).await?;
            let (calm, e) = open(&stack, rate, seconds, 256, false).await;
            calm.report(&format!("open loop, {rate:.0}/s, no flood"), e);
            // The flooding sessions' turns, back to back, meanwhile.
            let stop = tokio_util::sync::CancellationToken::new();
            let floods: Vec<_> = (0..flooders)
                .map(|i| {
                    let (c, stop) = (stack.client(i), stop.clone());
                    tokio::spawn(async move {
                        let mut n = 0u64;
                        while !stop.is_cancelled() {
                            if matches!(turn_on(c.clone(), format!("flood-{i}")).await, Outcome::Completed) {
                                n += 1;
                            }
                        }
                        n
                    })
                })
                .collect();
            tokio::time::sleep(Duration::from_millis(500)).await;
            let (loaded, e) = open(&stack, rate, seconds, 256, false).await;
            stop.cancel();
            let mut flood_turns = 0;
            for f in floods {
                flood_turns += f.await.unwrap_or(0);
            }
            loaded.report(&format!("open loop, {rate:.0}/s, {flooders} sessions flooding the Host service"), e);
            let p99 = ms(loaded.percentile(0.99)) / ms(calm.percentile(0.99)).max(1e-3);
            let quarantined = stack.quarantined().await?;
            println!(
                "hostile verdict: calm p99 with the flood / without = {p99:.2} (≤ 2); {flood_turns} flooding turns completed; quarantined: {quarantined:?}"
            );
            ok &= loaded.errors == 0 && calm.errors == 0 && p99 <= 2.0;
        }
    }
    Ok(ok)
}

#[tokio::main]
async fn main() -> ExitCode {
    match run(Args::parse()).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("loadgen: {e}");
            ExitCode::from(2)
        }
    }
}
