//! A remote engine behind quarantine and legacy fallback (OpenClaw's
//! guarded engine, with health-driven re-admission because containers
//! restart on their own).
//!
//! - First failure wins: the record keeps the operation, reason and time.
//! - Set by a failed or timed-out call, a contract violation, or health
//!   (unreachable, NOT_SERVING); never by an abort, never by UNIMPLEMENTED.
//! - While quarantined every call gets legacy's answer and `info` reads as
//!   legacy's. Compact and PrepareSubagentSpawn failures surface; other
//!   failed calls get legacy's result for that same call.
//! - Cleared when health reports SERVING after the penalty (1 s, doubling to
//!   60 s each time a trial fails), by `readmit`, or by a config reload; the
//!   first call after that is a trial.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use ctxgate_proto::{Method, pb};
use prost::Message;
use tokio::time::Instant;

use super::remote::Remote;
use super::{Call, CompactReply, Engine, EngineCallError, Legacy, ProgressFn};
use crate::metrics::Metrics;

const FIRST_PENALTY: Duration = Duration::from_secs(1);
const MAX_PENALTY: Duration = Duration::from_secs(60);
/// The longest reason a record keeps (it is shown and logged).
const MAX_REASON_CHARS: usize = 1_000;

/// What took an engine out of service.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuarantineCause {
    /// Not attached yet, or its attach (GetInfo and its validation) failed.
    Attach,
    /// The health monitor: unreachable or NOT_SERVING.
    Health,
    /// A failed, timed-out or contract-breaking call of this method.
    Call(Method),
}

impl QuarantineCause {
    /// The operation as `ctxgate status` and the metrics name it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Attach => "attach",
            Self::Health => "health",
            Self::Call(m) => m.name(),
        }
    }
}

impl std::fmt::Display for QuarantineCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why an engine is out of service.
#[derive(Debug, Clone, PartialEq)]
pub struct QuarantineRecord {
    pub cause: QuarantineCause,
    pub reason: String,
    pub since: SystemTime,
    since_instant: Instant,
    pub penalty: Duration,
}

/// What the health monitor last saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    Unknown,
    Serving,
    NotServing,
    Unreachable,
    /// The engine serves no health service: counted as healthy.
    NoHealthService,
}

impl Health {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Unknown => "UNKNOWN",
            Self::Serving => "SERVING",
            Self::NotServing => "NOT_SERVING",
            Self::Unreachable => "UNREACHABLE",
            Self::NoHealthService => "SERVING (no health service)",
        }
    }

    fn healthy(self) -> bool {
        matches!(self, Self::Serving | Self::NoHealthService)
    }
}

/// Per-method counters shown by `ctxgate status`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MethodStats {
    pub calls: u64,
    pub failures: u64,
    pub timeouts: u64,
    pub fallbacks: u64,
    /// Shed as overload (also counted in `fallbacks`).
    pub shed: u64,
}

impl std::ops::AddAssign for MethodStats {
    fn add_assign(&mut self, o: Self) {
        self.calls += o.calls;
        self.failures += o.failures;
        self.timeouts += o.timeouts;
        self.fallbacks += o.fallbacks;
        self.shed += o.shed;
    }
}

struct State {
    quarantine: Option<QuarantineRecord>,
    penalty: Duration,
    trial: bool,
    health: Health,
    stats: BTreeMap<Method, MethodStats>,
}

pub struct Guarded {
    pub remote: Remote,
    legacy: Arc<Legacy>,
    metrics: Metrics,
    /// `maxConcurrentCalls`: one permit per call in flight to the engine.
    slots: tokio::sync::Semaphore,
    max_calls: usize,
    state: Mutex<State>,
    /// Woken when something may change whether re-admission is due.
    pub changed: tokio::sync::Notify,
    /// Left its replica set: a call still in flight to it must not bring
    /// its metric series back.
    retired: std::sync::atomic::AtomicBool,
    /// Legacy answers a call this engine cannot (`onFailure: legacy`);
    /// otherwise the failure surfaces to the turn (`onFailure: fail`).
    fallback: bool,
}

type R<T> = Result<T, EngineCallError>;

impl Guarded {
    /// A new engine starts quarantined until its first attach succeeds.
    pub fn new(remote: Remote, legacy: Arc<Legacy>, metrics: Metrics, max_calls: usize, fallback: bool) -> Self {
        let pending = QuarantineRecord {
            cause: QuarantineCause::Attach,
            reason: "not attached yet".into(),
            since: SystemTime::now(),
            since_instant: Instant::now(),
            penalty: Duration::ZERO,
        };
        let state = State {
            quarantine: Some(pending),
            penalty: FIRST_PENALTY,
            trial: false,
            health: Health::Unknown,
            stats: BTreeMap::new(),
        };
        let slots = tokio::sync::Semaphore::new(max_calls.max(1));
        metrics.replica_in_service(&remote.id, &remote.endpoint, false);
        Self {
            remote,
            legacy,
            metrics,
            slots,
            max_calls,
            state: Mutex::new(state),
            changed: tokio::sync::Notify::new(),
            retired: std::sync::atomic::AtomicBool::new(false),
            fallback,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn id(&self) -> &str {
        &self.remote.id
    }

    pub fn quarantine_record(&self) -> Option<QuarantineRecord> {
        self.lock().quarantine.clone()
    }

    pub fn is_quarantined(&self) -> bool {
        self.lock().quarantine.is_some()
    }

    pub fn health(&self) -> Health {
        self.lock().health
    }

    pub fn stats(&self) -> BTreeMap<Method, MethodStats> {
        self.lock().stats.clone()
    }

    /// This replica left its set: its metric series is removed and stays so.
    pub fn retire(&self) {
        self.retired.store(true, std::sync::atomic::Ordering::Relaxed);
        self.metrics.replica_gone(&self.remote.id, &self.remote.endpoint);
    }

    fn replica_gauge(&self, up: bool) {
        if !self.retired.load(std::sync::atomic::Ordering::Relaxed) {
            self.metrics.replica_in_service(&self.remote.id, &self.remote.endpoint, up);
        }
    }

    /// Calls in flight to the engine now.
    pub fn in_flight(&self) -> usize {
        self.max_calls.max(1) - self.slots.available_permits()
    }

    /// Takes the engine out of service; the first failure wins.
    pub fn quarantine(&self, cause: QuarantineCause, reason: &str) {
        let mut s = self.lock();
        if s.quarantine.is_some() {
            return;
        }
        if std::mem::take(&mut s.trial) {
            // The trial after a re-admission failed: wait longer next time.
            s.penalty = (s.penalty * 2).min(MAX_PENALTY);
        }
        tracing::error!(
            engine = %self.remote.id, address = %self.remote.endpoint, operation = %cause, reason,
            "context engine failed; quarantining it and falling back to \"legacy\" until health reports SERVING again"
        );
        s.quarantine = Some(QuarantineRecord {
            cause,
            reason: reason.into(),
            since: SystemTime::now(),
            since_instant: Instant::now(),
            penalty: s.penalty,
        });
        drop(s);
        self.metrics.engine_quarantined(&self.remote.id, cause.as_str());
        self.replica_gauge(false);
        self.changed.notify_waiters();
    }

    /// An attach (GetInfo and its validation) failed: while the engine waits
    /// for an attach, its record says why (a contract violation names its
    /// field path), not only that it is "not attached yet".
    pub fn attach_failed(&self, reason: &str) {
        let mut s = self.lock();
        if let Some(q) = s.quarantine.as_mut().filter(|q| q.cause == QuarantineCause::Attach) {
            q.reason = reason.chars().take(MAX_REASON_CHARS).collect();
        }
    }

    /// Records what the health monitor saw.
    pub fn set_health(&self, h: Health) {
        self.lock().health = h;
        match h {
            Health::NotServing => self.quarantine(QuarantineCause::Health, "health check reports NOT_SERVING"),
            Health::Unreachable => self.quarantine(QuarantineCause::Health, "engine unreachable"),
            _ => {}
        }
        self.changed.notify_waiters();
    }

    /// When re-admission becomes due (quarantined, healthy, penalty served),
    /// or `None` if it does not apply now.
    pub fn readmit_at(&self) -> Option<Instant> {
        let s = self.lock();
        let q = s.quarantine.as_ref()?;
        s.health.healthy().then_some(q.since_instant + q.penalty)
    }

    /// Back in service; the next call is a trial.
    pub fn readmit(&self, why: &str) -> bool {
        let mut s = self.lock();
        let Some(q) = s.quarantine.take() else { return false };
        s.trial = q.cause != QuarantineCause::Attach;
        drop(s);
        self.replica_gauge(true);
        tracing::info!(engine = %self.remote.id, address = %self.remote.endpoint, why, after = %q.reason, "context engine re-admitted");
        self.changed.notify_waiters();
        true
    }

    /// The info of the engine's last successful attach, quarantined or not.
    pub fn attached_info(&self) -> Option<Arc<pb::EngineInfo>> {
        self.remote.info()
    }

    /// The engine's info, or legacy's while it is out of service.
    fn effective_info(&self) -> Arc<pb::EngineInfo> {
        if self.is_quarantined() {
            return self.legacy.info();
        }
        self.remote.info().unwrap_or_else(|| self.legacy.info())
    }

    fn count(&self, method: Method, f: impl FnOnce(&mut MethodStats)) {
        f(self.lock().stats.entry(method).or_default());
    }

    /// One guarded call: legacy while quarantined; the remote otherwise,
    /// with quarantine on failure and legacy's answer where allowed.
    async fn guard<T, Rf, Lf>(&self, method: Method, surfaces: bool, bytes_out: usize, remote: Rf, legacy: Lf) -> R<T>
    where
        T: Sized + Size,
        Rf: Future<Output = R<T>>,
        Lf: Future<Output = R<T>>,
    {
        if self.is_quarantined() {
            if !self.fallback {
                return Err(EngineCallError::Quarantined);
            }
            self.count(method, |s| s.fallbacks += 1);
            self.metrics.engine_fallback(&self.remote.id, method.name());
            return legacy.await;
        }
        let r = match self.slots.try_acquire() {
            Ok(_permit) => {
                let started = Instant::now();
                self.count(method, |s| s.calls += 1);
                let r = remote.await;
                let bytes_in = r.as_ref().map_or(0, Size::size);
                // Overload is not a failure: it is counted as shed below.
                let code =
                    r.as_ref().err().filter(|e| !matches!(e, EngineCallError::Overloaded { .. })).map(|e| e.code());
                self.metrics.engine_call(&self.remote.id, method.name(), started.elapsed(), bytes_out, bytes_in, code);
                r
            }
            // Shed here: the engine never sees the call.
            Err(_) => Err(EngineCallError::Overloaded {
                method,
                detail: format!("{} calls in flight (maxConcurrentCalls)", self.max_calls),
            }),
        };
        match r {
            Ok(t) => {
                let mut s = self.lock();
                if std::mem::take(&mut s.trial) {
                    // The trial passed: the next quarantine starts from 1 s again.
                    s.penalty = FIRST_PENALTY;
                }
                Ok(t)
            }
            // An abort is the caller's doing; UNIMPLEMENTED means "not implemented".
            Err(e @ (EngineCallError::Cancelled | EngineCallError::Unimplemented(_))) => Err(e),
            // The engine lost its copy of the history: the caller resyncs.
            Err(e @ EngineCallError::HistoryGap { .. }) => {
                tracing::info!(engine = %self.remote.id, %method, "history gap; resyncing the session");
                self.metrics.engine_history_gap(&self.remote.id, method.name());
                Err(e)
            }
            // Overload is not breakage: legacy answers this call, nothing
            // is quarantined. A commit has no legacy answer: it stays queued.
            Err(e @ EngineCallError::Overloaded { .. }) => {
                tracing::debug!(engine = %self.remote.id, error = %e, "engine call shed");
                self.count(method, |s| {
                    s.shed += 1;
                    s.fallbacks += 1;
                });
                self.metrics.engine_shed(&self.remote.id, method.name());
                self.metrics.engine_fallback(&self.remote.id, method.name());
                if method.queued() || !self.fallback {
                    return Err(e);
                }
                legacy.await
            }
            // A queued call refused: about that row (a poison turn), not
            // the engine, which stays in service for every other session.
            Err(EngineCallError::Failed { method, code, detail }) if method.queued() && refusal(code) => {
                tracing::warn!(engine = %self.remote.id, %method, ?code, detail, "engine refused a queued call");
                self.count(method, |s| s.failures += 1);
                Err(EngineCallError::Refused { method, code, detail })
            }
            Err(e) => {
                self.count(method, |s| {
                    s.failures += 1;
                    if matches!(e, EngineCallError::DeadlineExceeded { .. }) {
                        s.timeouts += 1;
                    }
                });
                self.quarantine(QuarantineCause::Call(method), &e.to_string());
                if surfaces || !self.fallback {
                    return Err(e);
                }
                self.count(method, |s| s.fallbacks += 1);
                self.metrics.engine_fallback(&self.remote.id, method.name());
                legacy.await
            }
        }
    }
}

/// An answer about the call rather than the way to the engine: transport
/// failures (UNAVAILABLE, UNKNOWN, a CANCELLED connection) stay engine
/// failures. DEADLINE_EXCEEDED never reaches here (its own variant).
fn refusal(code: tonic::Code) -> bool {
    !matches!(code, tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled)
}

/// Encoded size of a reply, for the byte counters.
trait Size {
    fn size(&self) -> usize;
}

impl<T: Message> Size for T {
    fn size(&self) -> usize {
        self.encoded_len()
    }
}

impl Size for CompactReply {
    fn size(&self) -> usize {
        match self {
            CompactReply::Done(r) => r.encoded_len(),
            CompactReply::DelegateToHost(d) => d.encoded_len(),
        }
    }
}

#[async_trait]
impl Engine for Guarded {
    fn info(&self) -> Arc<pb::EngineInfo> {
        self.effective_info()
    }

    async fn bootstrap(&self, req: pb::BootstrapRequest, call: &Call) -> R<pb::BootstrapResult> {
        let n = req.encoded_len();
        self.guard(
            Method::Bootstrap,
            call.surface_failures,
            n,
            self.remote.bootstrap(req.clone(), call),
            self.legacy.bootstrap(req, call),
        )
        .await
    }

    async fn ingest(&self, req: pb::IngestRequest, call: &Call) -> R<pb::IngestResult> {
        let n = req.encoded_len();
        self.guard(Method::Ingest, false, n, self.remote.ingest(req.clone(), call), self.legacy.ingest(req, call)).await
    }

    async fn ingest_batch(&self, req: pb::IngestBatchRequest, call: &Call) -> R<pb::IngestBatchResult> {
        let n = req.encoded_len();
        self.guard(Method::IngestBatch, true, n, self.remote.ingest_batch(req, call), async {
            Err(EngineCallError::Quarantined)
        })
        .await
    }

    async fn assemble(&self, req: pb::AssembleRequest, call: &Call) -> R<pb::AssembleResult> {
        let n = req.encoded_len();
        // A delta holds only what is new: legacy cannot answer it (the
        // turn asks again with the whole history).
        if req.cursor.is_some() {
            let no_fallback = async { Err(EngineCallError::Quarantined) };
            return self.guard(Method::Assemble, true, n, self.remote.assemble(req, call), no_fallback).await;
        }
        let surfaces = call.surface_failures;
        self.guard(
            Method::Assemble,
            surfaces,
            n,
            self.remote.assemble(req.clone(), call),
            self.legacy.assemble(req, call),
        )
        .await
    }

    async fn compact(&self, req: pb::CompactRequest, call: &Call, progress: &ProgressFn<'_>) -> R<CompactReply> {
        let n = req.encoded_len();
        let legacy = self.legacy.compact(req.clone(), call, progress);
        self.guard(Method::Compact, true, n, self.remote.compact(req, call, progress), legacy).await
    }

    async fn after_turn(&self, req: pb::AfterTurnRequest, call: &Call) -> R<pb::AfterTurnResult> {
        let n = req.encoded_len();
        // Legacy's no-op would look like the engine acknowledged the delta.
        if req.cursor.is_some() {
            let no_fallback = async { Err(EngineCallError::Quarantined) };
            return self.guard(Method::AfterTurn, true, n, self.remote.after_turn(req, call), no_fallback).await;
        }
        self.guard(
            Method::AfterTurn,
            false,
            n,
            self.remote.after_turn(req.clone(), call),
            self.legacy.after_turn(req, call),
        )
        .await
    }

    async fn commit_turn(&self, req: pb::CommitTurnRequest, call: &Call) -> R<pb::CommitTurnResult> {
        let n = req.encoded_len();
        // No legacy answer exists for a commit: the turn stays queued.
        self.guard(Method::CommitTurn, true, n, self.remote.commit_turn(req, call), async {
            Err(EngineCallError::Quarantined)
        })
        .await
    }

    async fn maintain(&self, req: pb::MaintainRequest, call: &Call) -> R<pb::MaintainResult> {
        let n = req.encoded_len();
        let surfaces = call.surface_failures;
        self.guard(
            Method::Maintain,
            surfaces,
            n,
            self.remote.maintain(req.clone(), call),
            self.legacy.maintain(req, call),
        )
        .await
    }

    async fn prepare_subagent_spawn(
        &self,
        req: pb::PrepareSubagentSpawnRequest,
        call: &Call,
    ) -> R<pb::PrepareSubagentSpawnResult> {
        let n = req.encoded_len();
        let legacy = self.legacy.prepare_subagent_spawn(req.clone(), call);
        self.guard(Method::PrepareSubagentSpawn, true, n, self.remote.prepare_subagent_spawn(req, call), legacy).await
    }

    async fn rollback_subagent_spawn(
        &self,
        req: pb::RollbackSubagentSpawnRequest,
        call: &Call,
    ) -> R<pb::RollbackSubagentSpawnResult> {
        let n = req.encoded_len();
        let legacy = self.legacy.rollback_subagent_spawn(req.clone(), call);
        self.guard(Method::RollbackSubagentSpawn, false, n, self.remote.rollback_subagent_spawn(req, call), legacy)
            .await
    }

    async fn on_subagent_ended(&self, req: pb::OnSubagentEndedRequest, call: &Call) -> R<pb::OnSubagentEndedResult> {
        let n = req.encoded_len();
        self.guard(
            Method::OnSubagentEnded,
            false,
            n,
            self.remote.on_subagent_ended(req.clone(), call),
            self.legacy.on_subagent_ended(req, call),
        )
        .await
    }

    async fn call_tool(&self, req: pb::CallToolRequest, call: &Call) -> R<pb::CallToolResult> {
        if self.is_quarantined() {
            return Err(EngineCallError::Quarantined);
        }
        // A tool's trouble is the model's to read, not the engine's
        // quarantine: transport failures still reach the health monitor.
        let started = Instant::now();
        self.count(Method::CallTool, |s| s.calls += 1);
        let bytes_out = req.encoded_len();
        let r = match self.slots.try_acquire() {
            Ok(_permit) => self.remote.call_tool(req, call).await,
            Err(_) => Err(EngineCallError::Overloaded {
                method: Method::CallTool,
                detail: format!("{} calls in flight (maxConcurrentCalls)", self.max_calls),
            }),
        };
        let code = r.as_ref().err().filter(|e| !matches!(e, EngineCallError::Cancelled)).map(|e| e.code());
        if code.is_some() {
            self.count(Method::CallTool, |s| {
                s.failures += 1;
                if matches!(r, Err(EngineCallError::DeadlineExceeded { .. })) {
                    s.timeouts += 1;
                }
            });
        }
        let bytes_in = r.as_ref().map_or(0, Size::size);
        self.metrics.engine_call(
            &self.remote.id,
            Method::CallTool.name(),
            started.elapsed(),
            bytes_out,
            bytes_in,
            code,
        );
        r
    }

    async fn forget_session(&self, req: pb::ForgetSessionRequest, call: &Call) -> R<pb::ForgetSessionResult> {
        let n = req.encoded_len();
        // Legacy forgetting would drop the queued forget: it stays queued.
        self.guard(Method::ForgetSession, true, n, self.remote.forget_session(req, call), async {
            Err(EngineCallError::Quarantined)
        })
        .await
    }
}
