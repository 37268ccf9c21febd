//! `crash-matrix`: SIGKILL the gateway (or its durable context engine) at
//! each stage of a turn's life, restart it, and check that every accepted
//! turn reached the engine exactly once and in order, and that nothing else
//! did.
//!
//! Each round runs the `ctxgate` gateway and the `ctxgate-engine-window`
//! engine as real processes, each with its own state dir in a fresh temp
//! dir. The model is a local OpenAI-compatible server inside this process.
//! The window engine implements CommitTurn and declares transcript
//! semantics, so the gateway delivers every accepted turn to it through the
//! durable outbox. A round runs a few managed (`RunTurn`) and harness
//! (`DriveTurn`) turns on 2–3 sessions, then kills at one stage picked at
//! random:
//!
//! - `before-admission`: a RunTurn (busy policy ENQUEUE) waits behind a
//!   harness turn that holds the session;
//! - `after-admission`: a harness turn has been admitted;
//! - `during-model-call`: the model streamed its first delta and hangs;
//! - `reply-stored-before-end`: a harness reply is stored (`appended`), and
//!   the turn has not ended;
//! - `during-accept`: 0–15 ms after a harness `end ACCEPTED`: before the
//!   close, between the close and the commit, or during the commit;
//! - `engine-during-commit`: the *engine*, 0–10 ms after `end ACCEPTED`
//!   (the gateway stays up until it answers, then it is killed too and
//!   restarted with the engine's new port).
//!
//! It then restarts what it killed on the same state dirs, runs one more
//! managed turn per session (a turn's start delivers its session's queued
//! commits), waits until the outbox is empty, and checks each session:
//!
//! - the gateway's branch is one chain: each entry's parent is the one
//!   before it, and seqs increase (an aborted turn's entries leave the
//!   branch, so seqs may skip);
//! - every turn a client saw accepted (`completed`, or `ended` ACCEPTED) is
//!   on the branch (else *lost*), and no turn cut before its end is there
//!   as accepted (else *corrupt*);
//! - the engine's `commits` hold each accepted turn exactly once (missing:
//!   *lost*; more than once: *duplicate*), no other turn (*corrupt*), and in
//!   the branch's order (*corrupt*);
//! - the engine holds every message of the turns it committed, and only
//!   messages that are on the branch (*corrupt*).
//!
//! The last stdout line is `crash matrix: R rounds, A turns accepted, C
//! committed once, D duplicates, L lost, K corrupt`; stderr explains each
//! problem, and the exit status is 1 when D, L or K is not 0. A round that
//! times out or fails counts as corrupt. The seed goes to stderr: `--seed S`
//! replays the same choices (the exact timing of a kill still varies).
//!
//! ```text
//! cargo build --release --workspace && target/release/crash-matrix --rounds 100
//! ```
//!
//! The gateway and the engine log to stderr; `CTXGATE_LOG=warn RUST_LOG=warn`
//! quiets them.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use ctxgate_proto::gateway::{
    self as api, gateway_client::GatewayClient, harness_client::HarnessClient, harness_event::Event as H,
    harness_request::Request as R, turn_event::Event,
};
use ctxgate_proto::pb::{Role, TranscriptEntry, transcript_entry::Entry};
use ctxgate_tests::fake_openai::{FakeOpenAi, Reply};
use ctxgate_tests::harness::{self, Drive};
use ctxgate_tests::{EngineProcess, bin};
use tokio::time::Instant;
use tokio_stream::StreamExt;
use tonic::transport::Channel;

type Gw = GatewayClient<Channel>;
type Hc = HarnessClient<Channel>;

/// The engine's entry id in the gateway config.
const ENGINE_ID: &str = "window";
/// One request and its answer.
const STEP: Duration = Duration::from_secs(5);
/// One whole turn.
const TURN_TIMEOUT: Duration = Duration::from_secs(15);
/// A process printing `listening on`.
const START_TIMEOUT: Duration = Duration::from_secs(20);
const ATTACH_TIMEOUT: Duration = Duration::from_secs(20);
const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);
/// SIGTERM until exit; then the process is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
const POLL: Duration = Duration::from_millis(10);

/// Kill the gateway (or its engine) at every stage of a turn; check that
/// each accepted turn reaches the engine exactly once.
#[derive(Parser, Debug)]
#[command(name = "crash-matrix", version)]
struct Args {
    /// Rounds to run (each starts fresh processes in a fresh temp dir).
    #[arg(long)]
    rounds: u32,
    /// The random seed (default: from the clock); printed on stderr.
    #[arg(long)]
    seed: Option<u64>,
    /// Report each round's choices and results on stderr.
    #[arg(long)]
    verbose: bool,
}

/// splitmix64: small, deterministic, good enough to pick stages and delays.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `lo..=hi`.
    fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }

    /// An index into a slice of `len` (> 0) items.
    fn index(&mut self, len: usize) -> usize {
        (self.next_u64() % len as u64) as usize
    }

    fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.index(i + 1);
            items.swap(i, j);
        }
    }
}

fn clock_seed() -> u64 {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    nanos ^ u64::from(std::process::id()).rotate_left(32)
}

/// The counts of the summary line.
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    rounds: u64,
    accepted: u64,
    committed_once: u64,
    duplicates: u64,
    lost: u64,
    corrupt: u64,
}

impl Tally {
    fn add(&mut self, o: &Tally) {
        self.rounds += o.rounds;
        self.accepted += o.accepted;
        self.committed_once += o.committed_once;
        self.duplicates += o.duplicates;
        self.lost += o.lost;
        self.corrupt += o.corrupt;
    }

    fn problems(&self) -> u64 {
        self.duplicates + self.lost + self.corrupt
    }

    fn failed_round() -> Self {
        Self { rounds: 1, corrupt: 1, ..Self::default() }
    }
}

/// One round's counts; every problem is explained on stderr as it is found.
struct Report {
    label: String,
    tally: Tally,
}

impl Report {
    fn lost(&mut self, what: String) {
        self.tally.lost += 1;
        eprintln!("{}: LOST: {what}", self.label);
    }

    fn duplicate(&mut self, what: String) {
        self.tally.duplicates += 1;
        eprintln!("{}: DUPLICATE: {what}", self.label);
    }

    fn corrupt(&mut self, what: String) {
        self.tally.corrupt += 1;
        eprintln!("{}: CORRUPT: {what}", self.label);
    }

    /// A round that could not run as planned (a timeout, an unexpected
    /// answer): counted as corrupt.
    fn failed(&mut self, what: String) {
        self.tally.corrupt += 1;
        eprintln!("{}: FAILED: {what}", self.label);
    }
}

/// Where the process is killed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    BeforeAdmission,
    AfterAdmission,
    DuringModelCall,
    ReplyStoredBeforeEnd,
    DuringAccept,
    EngineDuringCommit,
}

impl Stage {
    const ALL: [Stage; 6] = [
        Stage::BeforeAdmission,
        Stage::AfterAdmission,
        Stage::DuringModelCall,
        Stage::ReplyStoredBeforeEnd,
        Stage::DuringAccept,
        Stage::EngineDuringCommit,
    ];

    fn name(self) -> &'static str {
        match self {
            Stage::BeforeAdmission => "before-admission",
            Stage::AfterAdmission => "after-admission",
            Stage::DuringModelCall => "during-model-call",
            Stage::ReplyStoredBeforeEnd => "reply-stored-before-end",
            Stage::DuringAccept => "during-accept",
            Stage::EngineDuringCommit => "engine-during-commit",
        }
    }
}

/// A running gateway and its clients.
struct Gateway {
    process: EngineProcess,
    api: Gw,
    harness: Hc,
}

/// A turn a client was told is accepted.
struct Done {
    turn_id: String,
    /// The engine the turn ran on (`engine_selected`).
    engine: Option<String>,
}

/// A turn cut before its end: it must not show up as accepted.
struct Cut {
    key: String,
    turn: String,
    stage: Stage,
}

/// A session's active branch, read from the gateway.
struct Transcript {
    session_id: String,
    entries: Vec<TranscriptEntry>,
}

/// What the engine's SQLite file holds for one session.
#[derive(Default)]
struct EngineRecord {
    /// Commit keys in insertion order.
    commits: Vec<String>,
    messages: HashSet<String>,
}

/// One round: its processes, its state dirs and what clients were told.
struct Round {
    label: String,
    verbose: bool,
    rng: Rng,
    fake: FakeOpenAi,
    engine_state: PathBuf,
    gateway_state: PathBuf,
    config_path: PathBuf,
    engine: Option<EngineProcess>,
    gateway: Option<Gateway>,
    keys: Vec<String>,
    /// Client-acknowledged accepted turns per session key, in order.
    acked: BTreeMap<String, Vec<String>>,
    cut: Vec<Cut>,
    /// Turns killed mid-accept before the client heard: the store decides.
    undecided: Vec<(String, String)>,
    /// Acknowledged turns that ran on another engine than the window engine.
    degraded: HashMap<String, String>,
    /// Problems that stopped part of the round (counted as corrupt).
    failures: Vec<String>,
    turns: u32,
    /// Last: removed after the processes are gone.
    _dir: tempfile::TempDir,
}

impl Round {
    fn new(index: u32, seed: u64, verbose: bool, fake: FakeOpenAi) -> Result<Self, String> {
        let dir = tempfile::Builder::new().prefix("crash-matrix-").tempdir().map_err(|e| format!("a temp dir: {e}"))?;
        let mut rng = Rng::new(seed ^ u64::from(index).wrapping_add(1).wrapping_mul(0xD6E8_FEB8_6659_FD93));
        let keys = (0..rng.between(2, 3)).map(|i| format!("r{index}-s{i}")).collect();
        let (engine_state, gateway_state) = (dir.path().join("engine"), dir.path().join("gateway"));
        for d in [&engine_state, &gateway_state] {
            std::fs::create_dir_all(d).map_err(|e| format!("{}: {e}", d.display()))?;
        }
        let config_path = dir.path().join("ctxgate.json5");
        Ok(Self {
            label: format!("round {index}"),
            verbose,
            rng,
            fake,
            engine_state,
            gateway_state,
            config_path,
            engine: None,
            gateway: None,
            keys,
            acked: BTreeMap::new(),
            cut: Vec::new(),
            undecided: Vec::new(),
            degraded: HashMap::new(),
            failures: Vec::new(),
            turns: 0,
            _dir: dir,
        })
    }

    fn say(&self, what: impl std::fmt::Display) {
        if self.verbose {
            eprintln!("{}: {what}", self.label);
        }
    }

    fn fail(&mut self, what: String) {
        self.failures.push(what);
    }

    fn api(&self) -> Result<Gw, String> {
        self.gateway.as_ref().map(|g| g.api.clone()).ok_or_else(|| "the gateway is not running".to_owned())
    }

    fn harness(&self) -> Result<Hc, String> {
        self.gateway.as_ref().map(|g| g.harness.clone()).ok_or_else(|| "the gateway is not running".to_owned())
    }

    /// A user message that says which turn it is.
    fn next_text(&mut self, key: &str, what: &str) -> String {
        self.turns += 1;
        format!("{key} turn {}: {what}; remember ticket OPS-{}", self.turns, self.turns)
    }

    fn ack(&mut self, key: &str, done: Done) {
        if let Some(engine) = done.engine.filter(|e| e != ENGINE_ID) {
            self.degraded.insert(done.turn_id.clone(), engine);
        }
        self.acked.entry(key.to_owned()).or_default().push(done.turn_id);
    }

    fn mark_cut(&mut self, key: &str, turn: &str, stage: Stage) {
        self.cut.push(Cut { key: key.to_owned(), turn: turn.to_owned(), stage });
    }

    // ---- processes ----

    async fn start_engine(&mut self) -> Result<(), String> {
        let dir = utf8(&self.engine_state)?;
        let args = ["--listen", "127.0.0.1:0", "--state-dir", dir.as_str()];
        let program = bin("ctxgate-engine-window");
        let process = within("starting the window engine", START_TIMEOUT, async {
            EngineProcess::start(&program, &args).await.map_err(|e| e.to_string())
        })
        .await?;
        self.say(format_args!("window engine on {}", process.endpoint));
        self.engine = Some(process);
        Ok(())
    }

    /// Writes the config (the engine's current endpoint) and starts the
    /// gateway on the round's gateway state dir.
    async fn start_gateway(&mut self) -> Result<(), String> {
        let engine = self.engine.as_ref().map(|e| e.endpoint.clone()).ok_or("the engine is not running")?;
        std::fs::write(&self.config_path, gateway_config(&engine, &self.fake.base_url))
            .map_err(|e| format!("writing {}: {e}", self.config_path.display()))?;
        let (state, config) = (utf8(&self.gateway_state)?, utf8(&self.config_path)?);
        let args = ["serve", "--listen", "127.0.0.1:0", "--state-dir", state.as_str(), "--config", config.as_str()];
        let program = bin("ctxgate");
        let process = within("starting the gateway", START_TIMEOUT, async {
            EngineProcess::start(&program, &args).await.map_err(|e| e.to_string())
        })
        .await?;
        let channel = tonic::transport::Endpoint::from_shared(process.endpoint.clone())
            .map_err(|e| format!("the gateway's endpoint {}: {e}", process.endpoint))?
            .connect_lazy();
        self.say(format_args!("gateway on {}", process.endpoint));
        self.gateway =
            Some(Gateway { api: GatewayClient::new(channel.clone()), harness: HarnessClient::new(channel), process });
        Ok(())
    }

    async fn kill_gateway(&mut self) -> Result<(), String> {
        match self.gateway.take() {
            Some(g) => kill(g.process, "the gateway").await,
            None => Ok(()),
        }
    }

    async fn kill_engine(&mut self) -> Result<(), String> {
        match self.engine.take() {
            Some(e) => kill(e, "the engine").await,
            None => Ok(()),
        }
    }

    /// SIGTERM both, gateway first; wait (bounded) for them to exit.
    async fn stop(&mut self) {
        if let Some(g) = self.gateway.take() {
            terminate(g.process).await;
        }
        if let Some(e) = self.engine.take() {
            terminate(e).await;
        }
    }

    /// Until the gateway reports the window engine attached and in service.
    async fn wait_attached(&self) -> Result<(), String> {
        let gw = self.api()?;
        let deadline = Instant::now() + ATTACH_TIMEOUT;
        loop {
            let last = match status(&gw).await {
                Ok(s) => {
                    if s.engines.iter().any(attached) {
                        return Ok(());
                    }
                    format!("{:?}", s.engines.iter().find(|e| e.id == ENGINE_ID))
                }
                Err(e) => e,
            };
            if Instant::now() >= deadline {
                return Err(format!("the window engine was not attached within {ATTACH_TIMEOUT:?}: {last}"));
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Until the gateway reports a turn waiting behind a running one.
    async fn wait_queued(&self) -> Result<(), String> {
        let gw = self.api()?;
        let deadline = Instant::now() + STEP;
        loop {
            if status(&gw).await?.turns_queued >= 1 {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!("the enqueued turn never showed as queued within {STEP:?}"));
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Until the outbox is empty (every accepted turn delivered).
    async fn wait_drained(&self) -> Result<(), String> {
        let gw = self.api()?;
        let deadline = Instant::now() + DRAIN_TIMEOUT;
        loop {
            let s = status(&gw).await?;
            if s.outbox_queued == 0 {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "the outbox still holds {} commits ({} blocked) after {DRAIN_TIMEOUT:?}: {:?}",
                    s.outbox_queued, s.outbox_blocked, s.blocked_commits
                ));
            }
            tokio::time::sleep(POLL * 5).await;
        }
    }

    // ---- turns ----

    async fn managed_turn(&mut self, key: &str, what: &str) -> Result<(), String> {
        let req = run_request(key, self.next_text(key, what), api::BusyPolicy::Enqueue);
        let done = within(&format!("a managed turn on {key}"), TURN_TIMEOUT, run_managed(self.api()?, req)).await?;
        self.ack(key, done);
        Ok(())
    }

    async fn harness_turn(&mut self, key: &str) -> Result<(), String> {
        let hc = self.harness()?;
        let user = self.next_text(key, "a harness turn");
        let done = within(&format!("a harness turn on {key}"), TURN_TIMEOUT, harness_accepted(hc, key, user)).await?;
        self.ack(key, done);
        Ok(())
    }

    /// Step 1: 1–3 managed turns and 0–2 harness turns per session, mixed.
    async fn warm_up(&mut self) -> Result<(), String> {
        for key in self.keys.clone() {
            let mut plan = vec![true; self.rng.between(1, 3) as usize];
            plan.extend(vec![false; self.rng.between(0, 2) as usize]);
            self.rng.shuffle(&mut plan);
            for managed in plan {
                if managed {
                    self.managed_turn(&key, "a normal turn").await?;
                } else {
                    self.harness_turn(&key).await?;
                }
            }
        }
        Ok(())
    }

    // ---- step 2: the crash ----

    /// A harness turn on `key` whose message says `what`, read up to
    /// `admitted` (bounded by STEP): the stream and the turn id.
    async fn admit(&mut self, key: &str, what: &str) -> Result<(Drive, String), String> {
        let hc = self.harness()?;
        let user = self.next_text(key, what);
        within("admitting the turn", STEP, open_admitted(&hc, key, &user)).await
    }

    /// Sends `end ACCEPTED` and waits 0–`max_ms` ms (picked at random) for
    /// `ended`; `Err` when it did not come in that time.
    async fn end_within(
        &mut self,
        drive: &mut Drive,
        max_ms: u64,
    ) -> Result<Result<api::Ended, String>, tokio::time::error::Elapsed> {
        let delay = Duration::from_millis(self.rng.between(0, max_ms));
        send_end(drive).await;
        tokio::time::timeout(delay, await_ended(drive)).await
    }

    async fn crash(&mut self, stage: Stage, key: &str) -> Result<(), String> {
        match stage {
            Stage::BeforeAdmission => self.crash_before_admission(key).await,
            Stage::AfterAdmission => self.crash_after_admission(key).await,
            Stage::DuringModelCall => self.crash_during_model_call(key).await,
            Stage::ReplyStoredBeforeEnd => self.crash_reply_stored_before_end(key).await,
            Stage::DuringAccept => self.crash_during_accept(key).await,
            Stage::EngineDuringCommit => self.crash_engine_during_commit(key).await,
        }
    }

    /// A harness turn holds the session; a RunTurn (ENQUEUE) waits behind
    /// it, not admitted; the gateway dies.
    async fn crash_before_admission(&mut self, key: &str) -> Result<(), String> {
        let hc = self.harness()?;
        let user = self.next_text(key, "holds the session");
        let (holder, turn) = within("admitting the holder", STEP, open_admitted(&hc, key, &user)).await?;
        self.mark_cut(key, &turn, Stage::BeforeAdmission);
        let req = run_request(key, self.next_text(key, "waits behind the holder"), api::BusyPolicy::Enqueue);
        let mut waiter = tokio::spawn(watch_admission(self.api()?, req));
        let queued = self.wait_queued().await;
        self.kill_gateway().await?;
        drop(holder);
        match tokio::time::timeout(STEP, &mut waiter).await {
            Ok(Ok(Some(t))) => {
                self.mark_cut(key, &t, Stage::BeforeAdmission);
                self.fail(format!("the queued turn {t} on {key} was admitted while the session was held"));
            }
            Ok(_) => {}
            Err(_) => waiter.abort(),
        }
        queued
    }

    /// A harness turn is admitted; the gateway dies.
    async fn crash_after_admission(&mut self, key: &str) -> Result<(), String> {
        let (drive, turn) = self.admit(key, "admitted, then the gateway dies").await?;
        self.mark_cut(key, &turn, Stage::AfterAdmission);
        self.kill_gateway().await?;
        drop(drive);
        Ok(())
    }

    /// A managed turn's model streams one delta and hangs; the gateway dies.
    async fn crash_during_model_call(&mut self, key: &str) -> Result<(), String> {
        self.fake.turns([Reply::Hang("partial".into())]);
        let gw = self.api()?;
        let req = run_request(key, self.next_text(key, "the model hangs"), api::BusyPolicy::Enqueue);
        let mut stream = within("RunTurn", STEP, async {
            gw.clone().run_turn(req).await.map(tonic::Response::into_inner).map_err(|s| s.to_string())
        })
        .await?;
        let turn = within("the model's first delta", STEP, first_delta(&mut stream)).await?;
        self.mark_cut(key, &turn, Stage::DuringModelCall);
        self.kill_gateway().await?;
        drop(stream);
        Ok(())
    }

    /// A harness reply is stored (`appended`), the turn not ended; the
    /// gateway dies.
    async fn crash_reply_stored_before_end(&mut self, key: &str) -> Result<(), String> {
        let (mut drive, turn) = self.admit(key, "the reply is stored, the turn never ends").await?;
        self.mark_cut(key, &turn, Stage::ReplyStoredBeforeEnd);
        within("storing the reply", STEP, store_reply(&mut drive, "a reply that is never accepted")).await?;
        self.kill_gateway().await?;
        drop(drive);
        Ok(())
    }

    /// `end ACCEPTED`, then the gateway dies 0–15 ms later (or as soon as
    /// `ended` arrives).
    async fn crash_during_accept(&mut self, key: &str) -> Result<(), String> {
        let (mut drive, turn) = self.admit(key, "the gateway dies while it accepts").await?;
        within("storing the reply", STEP, store_reply(&mut drive, "a reply accepted at the crash")).await?;
        let ended = self.end_within(&mut drive, 15).await;
        self.kill_gateway().await?;
        match ended {
            Ok(Ok(e)) if e.outcome == api::TurnOutcome::Accepted as i32 => {
                let engine = engine_of(&drive);
                self.ack(key, Done { turn_id: turn, engine });
            }
            Ok(Ok(e)) => return Err(format!("turn {turn} ended with outcome {} instead of accepted", e.outcome)),
            Ok(Err(e)) => return Err(e),
            Err(_) => self.undecided.push((key.to_owned(), turn)),
        }
        Ok(())
    }

    /// `end ACCEPTED`, then the engine dies 0–10 ms later; the gateway
    /// (still up) must answer `ended` ACCEPTED. Then the gateway is killed
    /// too: the restarted engine has a new port for the config.
    async fn crash_engine_during_commit(&mut self, key: &str) -> Result<(), String> {
        let (mut drive, turn) = self.admit(key, "the engine dies while it commits").await?;
        within("storing the reply", STEP, store_reply(&mut drive, "a reply committed at the crash")).await?;
        let early = self.end_within(&mut drive, 10).await;
        self.kill_engine().await?;
        let ended = match early {
            Ok(r) => r,
            Err(_) => within("ended, after the engine died", STEP, await_ended(&mut drive)).await,
        }?;
        if ended.outcome != api::TurnOutcome::Accepted as i32 {
            return Err(format!("turn {turn} ended with outcome {} instead of accepted", ended.outcome));
        }
        let engine = engine_of(&drive);
        self.ack(key, Done { turn_id: turn, engine });
        self.kill_gateway().await?;
        drop(drive);
        Ok(())
    }

    // ---- step 3: restart and settle ----

    async fn recover(&mut self) -> Result<(), String> {
        if self.engine.is_none() {
            self.start_engine().await?;
        }
        if self.gateway.is_none() {
            self.start_gateway().await?;
        }
        self.wait_attached().await?;
        for key in self.keys.clone() {
            if let Err(e) = self.managed_turn(&key, "after the restart").await {
                self.fail(format!("the turn after the restart on {key}: {e}"));
            }
        }
        if let Err(e) = self.wait_drained().await {
            // The check counts each undelivered accepted turn as lost.
            eprintln!("{}: {e}", self.label);
        }
        Ok(())
    }

    /// Every session's active branch (visible_only = false).
    async fn transcripts(&self) -> Result<BTreeMap<String, Transcript>, String> {
        let gw = self.api()?;
        let mut out = BTreeMap::new();
        for key in &self.keys {
            let req = api::GetTranscriptRequest { session: sref(key), visible_only: false, ..Default::default() };
            let r = within(&format!("GetTranscript {key}"), STEP, async {
                gw.clone().get_transcript(req).await.map(tonic::Response::into_inner).map_err(|s| s.to_string())
            })
            .await?;
            let session_id =
                r.session.map(|s| s.session_id).ok_or_else(|| format!("GetTranscript {key}: no session"))?;
            out.insert(key.clone(), Transcript { session_id, entries: r.entries });
        }
        Ok(out)
    }

    /// Steps 1–3, and the gateway's side of the record (read while it is up).
    async fn exercise(&mut self) -> Result<BTreeMap<String, Transcript>, String> {
        self.start_engine().await?;
        self.start_gateway().await?;
        self.wait_attached().await?;
        let stage = Stage::ALL[self.rng.index(Stage::ALL.len())];
        let i = self.rng.index(self.keys.len());
        let key = self.keys[i].clone();
        self.say(format_args!("sessions {:?}; crash {} on {key}", self.keys, stage.name()));
        let done = match self.warm_up().await {
            Err(e) => Err(format!("before the crash: {e}")),
            Ok(()) => self.crash(stage, &key).await.map_err(|e| format!("{}: {e}", stage.name())),
        };
        if let Err(e) = done {
            // Crash here instead, and still check what was stored.
            self.fail(e);
            self.kill_gateway().await?;
        }
        self.recover().await?;
        self.transcripts().await
    }

    // ---- step 4: the check ----

    fn check(
        &self,
        transcripts: &BTreeMap<String, Transcript>,
        engine: &HashMap<String, EngineRecord>,
        report: &mut Report,
    ) {
        let none = EngineRecord::default();
        for key in &self.keys {
            let Some(t) = transcripts.get(key) else {
                report.corrupt(format!("{key}: the gateway has no transcript"));
                continue;
            };
            if let Some(problem) = chain_problem(&t.entries) {
                report.corrupt(format!("{key}: the branch is not one chain: {problem}"));
            }

            // The gateway's store is the authority on what was accepted.
            let accepted = accepted_turns(&t.entries);
            let accepted_set: HashSet<&str> = accepted.iter().map(String::as_str).collect();
            report.tally.accepted += accepted.len() as u64;
            for turn in self.acked.get(key).into_iter().flatten() {
                if !accepted_set.contains(turn.as_str()) {
                    report.lost(format!("{key}: turn {turn} was acknowledged as accepted but is not on the branch"));
                }
            }
            for cut in self.cut.iter().filter(|c| &c.key == key) {
                if accepted_set.contains(cut.turn.as_str()) {
                    report.corrupt(format!(
                        "{key}: turn {} was cut ({}) before its end, yet the branch has it accepted",
                        cut.turn,
                        cut.stage.name()
                    ));
                }
            }
            for (k, turn) in self.undecided.iter().filter(|(k, _)| k == key) {
                let fate = if accepted_set.contains(turn.as_str()) { "accepted" } else { "rewound" };
                self.say(format_args!("{k}: turn {turn}, cut mid-accept, was {fate}"));
            }

            // The engine's side: each accepted turn exactly once, in order.
            let record = engine.get(&t.session_id).unwrap_or(&none);
            let mut counts: HashMap<&str, usize> = HashMap::new();
            for k in &record.commits {
                *counts.entry(k.as_str()).or_default() += 1;
            }
            for turn in &accepted {
                match counts.get(turn.as_str()) {
                    Some(1) => report.tally.committed_once += 1,
                    Some(_) => {}
                    None => {
                        let hint =
                            self.degraded.get(turn).map(|e| format!(" (it ran on engine {e:?})")).unwrap_or_default();
                        report.lost(format!("{key}: accepted turn {turn} never reached the engine{hint}"));
                    }
                }
            }
            let mut seen = HashSet::new();
            for k in &record.commits {
                if !seen.insert(k.as_str()) {
                    continue;
                }
                let n = counts.get(k.as_str()).copied().unwrap_or(0);
                if n > 1 {
                    report.duplicate(format!("{key}: the engine holds turn {k} {n} times"));
                }
                if !accepted_set.contains(k.as_str()) {
                    report.corrupt(format!("{key}: the engine committed turn {k}, which is not an accepted turn"));
                }
            }
            let engine_order: Vec<&str> =
                seen_order(&record.commits).into_iter().filter(|k| accepted_set.contains(k)).collect();
            let gateway_order: Vec<&str> =
                accepted.iter().map(String::as_str).filter(|t| counts.contains_key(t)).collect();
            if engine_order != gateway_order {
                report.corrupt(format!(
                    "{key}: the engine committed {engine_order:?}, the branch accepted {gateway_order:?}"
                ));
            }

            // Messages: the engine holds its committed turns' messages, and
            // nothing that is not on the branch.
            let committed: HashSet<&str> = gateway_order.iter().copied().collect();
            let mut on_branch = HashSet::new();
            let mut missing = Vec::new();
            for e in &t.entries {
                if let Some(Entry::Message(m)) = &e.entry {
                    on_branch.insert(m.id.as_str());
                    if committed.contains(e.turn_id.as_str()) && !record.messages.contains(&m.id) {
                        missing.push(m.id.as_str());
                    }
                }
            }
            if !missing.is_empty() {
                report.corrupt(format!(
                    "{key}: the engine lacks {} message(s) of committed turns: {missing:?}",
                    missing.len()
                ));
            }
            let mut stray: Vec<&str> =
                record.messages.iter().map(String::as_str).filter(|id| !on_branch.contains(id)).collect();
            stray.sort_unstable();
            if !stray.is_empty() {
                report.corrupt(format!(
                    "{key}: the engine holds {} message(s) that are not on the branch: {stray:?}",
                    stray.len()
                ));
            }
        }
    }
}

/// Runs one round to its tally; never panics on a problem it can name.
async fn run_round(mut round: Round) -> Tally {
    let mut report = Report { label: round.label.clone(), tally: Tally { rounds: 1, ..Tally::default() } };
    let transcripts = match round.exercise().await {
        Ok(t) => Some(t),
        Err(e) => {
            report.failed(format!("the round could not finish: {e}"));
            None
        }
    };
    round.stop().await;
    for f in std::mem::take(&mut round.failures) {
        report.failed(f);
    }
    if let Some(t) = transcripts {
        let ids: Vec<&str> = t.values().map(|t| t.session_id.as_str()).collect();
        match read_engine(&round.engine_state.join("window.sqlite"), &ids) {
            Ok(engine) => round.check(&t, &engine, &mut report),
            Err(e) => report.failed(e),
        }
    }
    round.say(format_args!(
        "{} turns accepted, {} committed once, {} problems",
        report.tally.accepted,
        report.tally.committed_once,
        report.tally.problems()
    ));
    report.tally
}

// ---- helpers ----

/// `work`, bounded by `limit`; errors name `what`.
async fn within<T>(what: &str, limit: Duration, work: impl Future<Output = Result<T, String>>) -> Result<T, String> {
    match tokio::time::timeout(limit, work).await {
        Ok(r) => r.map_err(|e| format!("{what}: {e}")),
        Err(_) => Err(format!("{what}: no answer within {limit:?}")),
    }
}

fn utf8(p: &Path) -> Result<String, String> {
    p.to_str().map(str::to_owned).ok_or_else(|| format!("{} is not UTF-8", p.display()))
}

fn gateway_config(engine: &str, model: &str) -> String {
    format!(
        "{{
  models: {{ provider: 'openai', baseUrl: '{model}', model: 'gpt-test', contextWindow: 32000, maxOutputTokens: 512, requestTimeoutSeconds: 5 }},
  plugins: {{ slots: {{ contextEngine: '{ENGINE_ID}' }}, entries: {{ {ENGINE_ID}: {{ endpoint: '{engine}' }} }} }},
}}
"
    )
}

async fn kill(p: EngineProcess, what: &str) -> Result<(), String> {
    within(&format!("SIGKILL of {what}"), STEP, async move {
        p.signal_and_wait("KILL").await.map(drop).map_err(|e| e.to_string())
    })
    .await
}

/// SIGTERM and a bounded wait; a process still running is killed on drop.
async fn terminate(p: EngineProcess) {
    let _ = tokio::time::timeout(STOP_TIMEOUT, p.signal_and_wait("TERM")).await;
}

fn attached(e: &api::EngineStatus) -> bool {
    e.id == ENGINE_ID && !e.name.is_empty() && e.quarantine.is_none() && e.health.starts_with("SERVING")
}

async fn status(gw: &Gw) -> Result<api::StatusResult, String> {
    within("GetStatus", STEP, async {
        gw.clone().get_status(api::StatusRequest {}).await.map(tonic::Response::into_inner).map_err(|s| s.to_string())
    })
    .await
}

fn sref(key: &str) -> Option<api::SessionRef> {
    Some(api::SessionRef { agent_id: String::new(), session_key: key.into() })
}

fn run_request(key: &str, message: String, busy: api::BusyPolicy) -> api::RunTurnRequest {
    api::RunTurnRequest { session: sref(key), message, system_prompt: None, busy_policy: busy as i32 }
}

/// A managed turn to `completed`.
async fn run_managed(mut gw: Gw, req: api::RunTurnRequest) -> Result<Done, String> {
    let mut stream = gw.run_turn(req).await.map_err(|s| format!("RunTurn: {s}"))?.into_inner();
    let (mut turn, mut engine) = (None, None);
    while let Some(e) = stream.next().await {
        match e.map_err(|s| format!("the turn's stream broke: {s}"))?.event {
            Some(Event::Admitted(a)) => turn = Some(a.turn_id),
            Some(Event::EngineSelected(s)) => engine = Some(s.engine_id),
            Some(Event::Completed(_)) => {
                let turn_id = turn.ok_or("completed without being admitted")?;
                return Ok(Done { turn_id, engine });
            }
            Some(Event::Failed(f)) => return Err(format!("the turn failed: {}: {}", f.reason, f.message)),
            _ => {}
        }
    }
    Err("the stream ended without completed or failed".into())
}

/// A RunTurn that should wait unadmitted: its turn id if it was admitted.
async fn watch_admission(mut gw: Gw, req: api::RunTurnRequest) -> Option<String> {
    let mut stream = gw.run_turn(req).await.ok()?.into_inner();
    while let Some(Ok(e)) = stream.next().await {
        if let Some(Event::Admitted(a)) = e.event {
            return Some(a.turn_id);
        }
    }
    None
}

/// Reads a managed turn's events up to the model's first delta: its turn id.
async fn first_delta(stream: &mut tonic::Streaming<api::TurnEvent>) -> Result<String, String> {
    let mut turn = None;
    while let Some(e) = stream.next().await {
        match e.map_err(|s| s.to_string())?.event {
            Some(Event::Admitted(a)) => turn = Some(a.turn_id),
            Some(Event::ModelDelta(_)) => return turn.ok_or_else(|| "a model delta before admission".to_owned()),
            Some(Event::Completed(_)) => return Err("the turn completed; the model did not hang".into()),
            Some(Event::Failed(f)) => return Err(format!("the turn failed: {}: {}", f.reason, f.message)),
            _ => {}
        }
    }
    Err("the stream ended before the model's first delta".into())
}

/// Opens a harness turn and reads up to `admitted`: its turn id.
async fn open_admitted(hc: &Hc, key: &str, user: &str) -> Result<(Drive, String), String> {
    let mut d = Drive::open(hc, harness::begin(key, user)).await.map_err(|s| format!("DriveTurn: {s}"))?;
    let turn = d
        .until(|e| if let H::Admitted(a) = e { Some(a.turn_id.clone()) } else { None })
        .await
        .map_err(|s| format!("waiting for admitted: {s}"))?;
    Ok((d, turn))
}

/// The first context, then an assistant reply, `appended`.
async fn store_reply(d: &mut Drive, reply: &str) -> Result<(), String> {
    d.context().await.map_err(|s| format!("waiting for context: {s}"))?;
    d.append(vec![harness::text(Role::Assistant, reply)]).await.map_err(|s| format!("append: {s}"))?;
    Ok(())
}

async fn send_end(d: &mut Drive) {
    d.send(R::End(api::End { outcome: api::TurnOutcome::Accepted as i32, ..Default::default() })).await;
}

async fn await_ended(d: &mut Drive) -> Result<api::Ended, String> {
    d.until(|e| match e {
        H::Ended(x) => Some(Ok(*x)),
        H::Failed(f) => Some(Err(format!("the turn failed: {}: {}", f.reason, f.message))),
        _ => None,
    })
    .await
    .map_err(|s| format!("waiting for ended: {s}"))?
}

fn engine_of(d: &Drive) -> Option<String> {
    d.seen.iter().find_map(|e| if let H::EngineSelected(s) = e { Some(s.engine_id.clone()) } else { None })
}

/// A whole harness turn: begin, context, reply, end ACCEPTED, `ended`, close.
async fn harness_accepted(hc: Hc, key: &str, user: String) -> Result<Done, String> {
    let (mut d, turn_id) = open_admitted(&hc, key, &user).await?;
    store_reply(&mut d, &format!("the answer to: {user}")).await?;
    send_end(&mut d).await;
    let ended = await_ended(&mut d).await?;
    if ended.outcome != api::TurnOutcome::Accepted as i32 {
        return Err(format!("turn {turn_id} ended with outcome {} instead of accepted", ended.outcome));
    }
    d.close();
    while d.next().await.map_err(|s| format!("after ended: {s}"))?.is_some() {}
    let engine = engine_of(&d);
    Ok(Done { turn_id, engine })
}

/// The problem with the branch as one chain, if any: each parent is the
/// entry before, and seqs increase (they skip where a turn was rewound).
fn chain_problem(entries: &[TranscriptEntry]) -> Option<String> {
    for (i, e) in entries.iter().enumerate() {
        let prev = i.checked_sub(1).map(|j| &entries[j]);
        let want = prev.map(|p| p.id.as_str());
        if e.parent_id.as_deref() != want {
            return Some(format!("entry {i} ({}) has parent {:?}, not {want:?}", e.id, e.parent_id));
        }
        if let Some(p) = prev.filter(|p| e.seq <= p.seq) {
            return Some(format!("entry {i} has seq {} after seq {}", e.seq, p.seq));
        }
    }
    None
}

/// Turns with a non-user message on the branch, in branch order.
fn accepted_turns(entries: &[TranscriptEntry]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for e in entries {
        let replied = matches!(&e.entry, Some(Entry::Message(m)) if m.role != Role::User as i32);
        if replied && !out.contains(&e.turn_id) {
            out.push(e.turn_id.clone());
        }
    }
    out
}

/// The distinct keys in order of first appearance.
fn seen_order(keys: &[String]) -> Vec<&str> {
    let mut out: Vec<&str> = Vec::new();
    for k in keys {
        if !out.contains(&k.as_str()) {
            out.push(k);
        }
    }
    out
}

/// The engine's commits (rowid order) and message ids for each session.
fn read_engine(db_path: &Path, session_ids: &[&str]) -> Result<HashMap<String, EngineRecord>, String> {
    let sql = |e: rusqlite::Error| format!("reading {}: {e}", db_path.display());
    let db = rusqlite::Connection::open_with_flags(db_path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY).map_err(sql)?;
    let mut commits =
        db.prepare("SELECT advancement_key FROM commits WHERE session_id = ?1 ORDER BY rowid").map_err(sql)?;
    let mut messages = db.prepare("SELECT id FROM messages WHERE session_id = ?1").map_err(sql)?;
    let mut out = HashMap::new();
    for sid in session_ids {
        let c = commits
            .query_map([*sid], |r| r.get::<_, String>(0))
            .map_err(sql)?
            .collect::<Result<Vec<_>, _>>()
            .map_err(sql)?;
        let m = messages
            .query_map([*sid], |r| r.get::<_, String>(0))
            .map_err(sql)?
            .collect::<Result<HashSet<_>, _>>()
            .map_err(sql)?;
        out.insert((*sid).to_owned(), EngineRecord { commits: c, messages: m });
    }
    Ok(out)
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let seed = args.seed.unwrap_or_else(clock_seed);
    eprintln!("crash-matrix: seed {seed} (replay with --seed {seed})");
    // Fail fast (with the build hint) when a binary is missing.
    let _ = (bin("ctxgate"), bin("ctxgate-engine-window"));
    let fake = FakeOpenAi::start().await;
    let mut total = Tally::default();
    for index in 0..args.rounds {
        let tally = match Round::new(index, seed, args.verbose, fake.clone()) {
            Err(e) => {
                eprintln!("round {index}: FAILED: {e}");
                Tally::failed_round()
            }
            // Its own task: a panic (e.g. a process gone before its
            // signal) fails the round, not the run.
            Ok(round) => match tokio::spawn(run_round(round)).await {
                Ok(t) => t,
                Err(e) => {
                    eprintln!("round {index}: FAILED: {e}");
                    Tally::failed_round()
                }
            },
        };
        total.add(&tally);
    }
    if total.problems() > 0 {
        eprintln!(
            "crash-matrix: {} duplicates, {} lost, {} corrupt (see above); replay with --seed {seed}",
            total.duplicates, total.lost, total.corrupt
        );
    }
    println!(
        "crash matrix: {} rounds, {} turns accepted, {} committed once, {} duplicates, {} lost, {} corrupt",
        total.rounds, total.accepted, total.committed_once, total.duplicates, total.lost, total.corrupt
    );
    if total.problems() > 0 { ExitCode::FAILURE } else { ExitCode::SUCCESS }
}
