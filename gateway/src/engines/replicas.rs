//! One configured engine as a set of replicas. A plain endpoint is a set
//! of one; `dns:///NAME:PORT` makes every address NAME resolves to a
//! replica, re-resolved every few seconds (every second while a replica is
//! out of service), the convention of Kubernetes headless services and
//! compose services with replicas; gRPC's `ipv4:`/`ipv6:` lists name them
//! outright.
//!
//! - Each replica is a [`Guarded`] of its own: its own channel, health
//!   monitor, quarantine and `maxConcurrentCalls`. One replica's failure is
//!   that replica's; the engine is out of service only when every replica is.
//! - A call goes to a replica in service, chosen by the engine's declared
//!   `replica_affinity`: rendezvous hashing of the session for engines that
//!   keep session state (every gateway picks the same replica, and only a
//!   departed replica's sessions move), else the less busy of two picked at
//!   random (power of two choices).
//! - With no replica in service, the call goes to one anyway: a quarantined
//!   `Guarded` answers as legacy, so fallback stays in one place.
//! - A session that moved left its state behind on the replicas it was on:
//!   ForgetSession goes to every replica (it is queued until all took it),
//!   and a subagent's rollback and end to every replica in service.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, RwLock, Weak};
use std::time::Duration;

use async_trait::async_trait;
use ctxgate_proto::{Method, pb};
use ctxgate_runtime::Endpoint;
use hickory_resolver::TokioResolver;
use hickory_resolver::config::LookupIpStrategy;
use tokio_util::sync::CancellationToken;

use super::guarded::{Guarded, Health, MethodStats, QuarantineRecord};
use super::remote::Remote;
use super::{Call, CompactReply, Engine, EngineCallError, Legacy, ProgressFn};
use crate::config::{EngineEntry, MAX_REPLICAS, OnFailure, Target};
use crate::metrics::Metrics;

/// How often a name is resolved again while every replica is in service.
const RESOLVE_EVERY: Duration = Duration::from_secs(5);
/// … and while one is out of service (it may have moved).
const RESOLVE_EVERY_DEGRADED: Duration = Duration::from_secs(1);
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(5);

/// One address of the engine, with its own guard and health monitor.
pub struct Replica {
    /// The address dialled; `None` for the placeholder that dials the name
    /// itself while it resolves to nothing.
    addr: Option<SocketAddr>,
    pub guarded: Arc<Guarded>,
    /// Stops this replica's monitor when the replica leaves the set.
    stop: CancellationToken,
}

impl Drop for Replica {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl Replica {
    pub fn address(&self) -> &str {
        &self.guarded.remote.endpoint
    }

    fn in_service(&self) -> bool {
        !self.guarded.is_quarantined()
    }
}

/// How the engine's calls are spread over its replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Affinity {
    /// Any replica (power of two choices on calls in flight).
    None,
    /// A session's calls go to one replica (rendezvous hashing).
    Session,
}

impl Affinity {
    /// What the engine declared; unspecified: SESSION for a DELTA engine
    /// (it holds the history), NONE otherwise.
    pub fn of(info: &pb::EngineInfo) -> Self {
        match pb::ReplicaAffinity::try_from(info.replica_affinity).unwrap_or_default() {
            pb::ReplicaAffinity::Session => Self::Session,
            pb::ReplicaAffinity::None => Self::None,
            pb::ReplicaAffinity::Unspecified if super::delta(info) => Self::Session,
            pb::ReplicaAffinity::Unspecified => Self::None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Session => "session",
        }
    }
}

/// What makes a replica at an address.
struct Maker {
    id: String,
    entry: EngineEntry,
    compact_timeout: Duration,
    legacy: Arc<Legacy>,
    metrics: Metrics,
    stop: CancellationToken,
}

impl Maker {
    fn replica(&self, addr: Option<SocketAddr>, target: &Target) -> Result<Arc<Replica>, String> {
        let at = addr.map_or_else(|| target.by_name(), Endpoint::Tcp);
        let remote = Remote::new(&self.id, &self.entry, self.compact_timeout, &at, self.metrics.spans.clone())?;
        let max = self.entry.max_concurrent_calls;
        let fallback = self.entry.on_failure == OnFailure::Legacy;
        let guarded = Arc::new(Guarded::new(remote, self.legacy.clone(), self.metrics.clone(), max, fallback));
        let stop = self.stop.child_token();
        tokio::spawn(super::health::monitor(guarded.clone(), stop.clone()));
        Ok(Arc::new(Replica { addr, guarded, stop }))
    }
}

pub struct Replicas {
    id: String,
    /// The endpoint as configured.
    pub endpoint: String,
    target: Target,
    maker: Maker,
    /// Never empty: swapped whole when the name resolves differently.
    set: RwLock<Arc<[Arc<Replica>]>>,
}

impl Replicas {
    /// The engine `entry` configures: one replica, or (for `dns:///`) the
    /// name's placeholder until the first resolution, which starts now.
    /// Must run inside a tokio runtime; everything stops with `stop`.
    pub fn start(
        id: &str,
        entry: &EngineEntry,
        compact_timeout: Duration,
        legacy: Arc<Legacy>,
        metrics: Metrics,
        stop: CancellationToken,
    ) -> Result<Arc<Self>, String> {
        let target = entry.target()?;
        let maker = Maker { id: id.to_owned(), entry: entry.clone(), compact_timeout, legacy, metrics, stop };
        let first: Vec<Arc<Replica>> = match &target {
            Target::Static(addrs) => {
                addrs.iter().map(|a| maker.replica(Some(*a), &target)).collect::<Result<_, _>>()?
            }
            Target::One(_) | Target::Dns { .. } => vec![maker.replica(None, &target)?],
        };
        let replicas = Arc::new(Self {
            id: id.to_owned(),
            endpoint: entry.endpoint.to_string(),
            target: target.clone(),
            maker,
            set: RwLock::new(Arc::from(first)),
        });
        if let Target::Dns { host, port } = target {
            let stop = replicas.maker.stop.clone();
            tokio::spawn(resolve_loop(Arc::downgrade(&replicas), host, port, stop));
        }
        Ok(replicas)
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// The replicas now (never empty).
    pub fn replicas(&self) -> Arc<[Arc<Replica>]> {
        self.set.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Out of service: every replica is quarantined.
    pub fn is_quarantined(&self) -> bool {
        !self.replicas().iter().any(|r| r.in_service())
    }

    /// Why the engine is out of service (the first replica's record), or
    /// `None` while a replica serves.
    pub fn quarantine_record(&self) -> Option<QuarantineRecord> {
        let set = self.replicas();
        if set.iter().any(|r| r.in_service()) {
            return None;
        }
        set.first().and_then(|r| r.guarded.quarantine_record())
    }

    /// The best health among the replicas.
    pub fn health(&self) -> Health {
        let set = self.replicas();
        let serving = set.iter().find(|r| r.in_service()).or(set.first());
        serving.map_or(Health::Unknown, |r| r.guarded.health())
    }

    /// The info of a replica's last successful attach (replicas are one
    /// engine: any of them speaks for all).
    pub fn attached_info(&self) -> Option<Arc<pb::EngineInfo>> {
        let set = self.replicas();
        let in_service = set.iter().filter(|r| r.in_service());
        in_service.chain(set.iter()).find_map(|r| r.guarded.attached_info())
    }

    /// What a turn does when this engine cannot serve it.
    pub fn on_failure(&self) -> OnFailure {
        self.maker.entry.on_failure
    }

    pub fn affinity(&self) -> Option<Affinity> {
        self.attached_info().as_deref().map(Affinity::of)
    }

    /// Every replica's counters, added up.
    pub fn stats(&self) -> BTreeMap<Method, MethodStats> {
        let mut out: BTreeMap<Method, MethodStats> = BTreeMap::new();
        for r in self.replicas().iter() {
            for (m, s) in r.guarded.stats() {
                *out.entry(m).or_default() += s;
            }
        }
        out
    }

    /// Operator re-admission of every quarantined replica.
    pub fn readmit(&self, why: &str) -> bool {
        self.replicas().iter().fold(false, |any, r| r.guarded.readmit(why) | any)
    }

    /// The replica for a call about `session` (a session id or key; `None`:
    /// no session, any replica).
    pub fn pick(&self, session: Option<&str>) -> Arc<Guarded> {
        let set = self.replicas();
        let up: Vec<&Arc<Replica>> = set.iter().filter(|r| r.in_service()).collect();
        let by_session = || session.filter(|_| self.affinity() == Some(Affinity::Session));
        let chosen = match up.as_slice() {
            // None in service: a quarantined replica answers as legacy.
            [] => &set[0],
            [only] => only,
            up if let Some(key) = by_session() => owner(up, |r| r.address(), key).unwrap_or(&set[0]),
            up => {
                let a = fastrand::usize(..up.len());
                let b = (a + 1 + fastrand::usize(..up.len() - 1)) % up.len();
                let (a, b) = (up[a], up[b]);
                if b.guarded.in_flight() < a.guarded.in_flight() { b } else { a }
            }
        };
        chosen.guarded.clone()
    }

    /// Whether a replica other than `this` is in service.
    fn another_in_service(&self, this: &Arc<Guarded>) -> bool {
        self.replicas().iter().any(|r| r.in_service() && !Arc::ptr_eq(&r.guarded, this))
    }

    /// Every replica's answer to a call that concerns them all: the first
    /// failure is the answer (a queued call stays queued until every one
    /// took it), else the first reply. `quarantined`: send to those too
    /// (they answer Quarantined, so the call waits for them).
    async fn every<T, F, Fut>(&self, quarantined: bool, f: F) -> R<T>
    where
        F: Fn(Arc<Guarded>) -> Fut,
        Fut: std::future::Future<Output = R<T>>,
    {
        let set = self.replicas();
        let mut to: Vec<Arc<Guarded>> =
            set.iter().filter(|r| quarantined || r.in_service()).map(|r| r.guarded.clone()).collect();
        if to.is_empty() {
            // None in service: a quarantined replica answers as legacy.
            to.push(set[0].guarded.clone());
        }
        let mut first = None;
        for r in futures_util::future::join_all(to.into_iter().map(f)).await {
            match r {
                Ok(t) => {
                    first.get_or_insert(t);
                }
                Err(e) => return Err(e),
            }
        }
        first.ok_or(EngineCallError::Quarantined)
    }

    /// Replaces the set with `addrs` (sorted, deduplicated, non-empty):
    /// replicas still there keep their connection, health and quarantine.
    fn update(&self, addrs: &[SocketAddr]) {
        let current = self.replicas();
        // Compared as dialled: the name's placeholder may be one of them.
        if current.iter().map(|r| r.address().to_owned()).eq(addrs.iter().map(SocketAddr::to_string)) {
            return;
        }
        let mut next = Vec::with_capacity(addrs.len());
        for a in addrs {
            // The placeholder dialled by name is kept if the name is this address.
            let same = |r: &&Arc<Replica>| r.addr == Some(*a) || (r.addr.is_none() && r.address() == a.to_string());
            if let Some(r) = current.iter().find(same) {
                next.push(r.clone());
                continue;
            }
            match self.maker.replica(Some(*a), &self.target) {
                Ok(r) => next.push(r),
                Err(e) => {
                    tracing::error!(engine = %self.id, address = %a, error = %e, "cannot build a replica's client")
                }
            }
        }
        // Nothing built, or nothing new (a replica that could not be built).
        if next.is_empty()
            || (next.len() == current.len() && next.iter().zip(current.iter()).all(|(n, c)| Arc::ptr_eq(n, c)))
        {
            return;
        }
        let names = |s: &[Arc<Replica>]| s.iter().map(|r| r.address().to_owned()).collect::<Vec<_>>().join(", ");
        tracing::info!(engine = %self.id, before = %names(&current), now = %names(&next), "engine replicas changed");
        // A departed replica's series goes with it (not on drop: a reload's
        // new replica at the same address shares the series).
        for gone in current.iter().filter(|r| !next.iter().any(|n| Arc::ptr_eq(n, r))) {
            gone.guarded.retire();
        }
        *self.set.write().unwrap_or_else(|e| e.into_inner()) = Arc::from(next);
    }
}

/// The system's stub resolver on the runtime: hickory over the system's
/// resolv.conf (search domains, ndots) and hosts file, so a lookup is a
/// future on the runtime — cancelled when its timeout ends it — not a
/// blocking thread that getaddrinfo holds for as long as the resolver
/// hangs. Both families, as getaddrinfo gives them.
fn system_resolver() -> Result<TokioResolver, String> {
    let mut builder =
        TokioResolver::builder_tokio().map_err(|e| format!("reading the system's resolver configuration: {e}"))?;
    let opts = builder.options_mut();
    opts.ip_strategy = LookupIpStrategy::Ipv4AndIpv6;
    // Two tries within the pass's own bound (A and AAAA are asked
    // together and joined: a server that drops one costs a try, not the
    // pass).
    opts.timeout = RESOLVE_TIMEOUT / 3;
    opts.attempts = 1;
    builder.build().map_err(|e| format!("building the resolver: {e}"))
}

/// Every address of `host` now. The resolver is new each pass, so nothing
/// is answered from a cache: a replica set must follow the records as they
/// are (a headless Service's 30 s TTL would hide a new pod that long).
async fn system_lookup(resolver: &TokioResolver, host: &str) -> Result<Vec<IpAddr>, String> {
    let found = resolver.lookup_ip(host).await.map_err(|e| e.to_string())?;
    Ok(found.iter().collect())
}

/// The replicas' addresses now: every A/AAAA record, sorted, at most
/// [`MAX_REPLICAS`]. A lookup that outlives [`RESOLVE_TIMEOUT`] is dropped,
/// which cancels it: nothing of it is left running.
async fn resolve(
    host: &str,
    port: u16,
    lookup: impl Future<Output = Result<Vec<IpAddr>, String>>,
) -> Result<Vec<SocketAddr>, String> {
    let found = tokio::time::timeout(RESOLVE_TIMEOUT, lookup)
        .await
        .map_err(|_| format!("resolving {host} took over {RESOLVE_TIMEOUT:?}"))?
        .map_err(|e| format!("resolving {host}: {e}"))?;
    let mut addrs: Vec<SocketAddr> = found.into_iter().map(|ip| SocketAddr::new(ip, port)).collect();
    addrs.sort();
    addrs.dedup();
    addrs.truncate(MAX_REPLICAS);
    Ok(addrs)
}

/// Re-resolves `host` until the replicas are dropped or `stop` fires. A
/// failed or empty resolution keeps the replicas there are (a DNS blip is
/// not an outage).
async fn resolve_loop(replicas: Weak<Replicas>, host: String, port: u16, stop: CancellationToken) {
    let mut failing = false;
    loop {
        let Some(set) = replicas.upgrade() else { return };
        // Read afresh each pass, as glibc re-reads hosts and a changed
        // resolv.conf: an edited one takes effect. (Two small local files
        // read in place, every few seconds per engine: not worth a thread.)
        let found = match system_resolver() {
            Ok(resolver) => tokio::select! {
                r = resolve(&host, port, system_lookup(&resolver, &host)) => r,
                () = stop.cancelled() => return,
            },
            Err(e) => Err(e),
        };
        match found {
            Ok(addrs) if !addrs.is_empty() => {
                failing = false;
                set.update(&addrs);
            }
            r => {
                if !failing {
                    let why = r.err().unwrap_or_else(|| format!("{host} has no address"));
                    tracing::warn!(engine = %set.id, error = %why, "engine replicas not resolved; keeping the ones there are");
                }
                failing = true;
            }
        }
        let degraded = failing || set.replicas().iter().any(|r| !r.in_service());
        drop(set);
        let wait = if degraded { RESOLVE_EVERY_DEGRADED } else { RESOLVE_EVERY };
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            () = stop.cancelled() => return,
        }
    }
}

/// The replica among `up` that owns `session`: the highest rendezvous
/// weight of (address, session), so every gateway picks the same one and
/// only a departed replica's sessions move.
fn owner<'a, T: ?Sized>(up: &[&'a T], address: impl Fn(&T) -> &str, session: &str) -> Option<&'a T> {
    up.iter().copied().max_by_key(|r| rendezvous(address(r), session))
}

/// A replica's rendezvous score for a session. Every gateway must compute
/// the same score (so it is written out, not std's hasher, whose algorithm
/// may change between releases): FNV-1a over both strings, then
/// SplitMix64's finaliser, because FNV alone mixes the last bytes poorly.
fn rendezvous(replica: &str, session: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in replica.bytes().chain([0]).chain(session.bytes()) {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// The session a request is about, for affinity.
trait Keyed {
    fn session(&self) -> Option<&str>;
}

macro_rules! keyed {
    ($($Req:ty => |$r:ident| $key:expr),* $(,)?) => {
        $(impl Keyed for $Req {
            fn session(&self) -> Option<&str> {
                let $r = self;
                Some($key).filter(|k: &&str| !k.is_empty())
            }
        })*
    };
}

keyed! {
    pb::BootstrapRequest => |r| r.session_id.as_str(),
    pb::IngestRequest => |r| r.session_id.as_str(),
    pb::IngestBatchRequest => |r| r.session_id.as_str(),
    pb::AssembleRequest => |r| r.session_id.as_str(),
    pb::CompactRequest => |r| r.session_id.as_str(),
    pb::AfterTurnRequest => |r| r.session_id.as_str(),
    pb::CommitTurnRequest => |r| r.session_id.as_str(),
    pb::MaintainRequest => |r| r.session_id.as_str(),
    pb::CallToolRequest => |r| r.session_id.as_str(),
    // A spawn forks the parent's state: the parent's replica holds it.
    pb::PrepareSubagentSpawnRequest => |r| r.parent_session_id.as_deref().unwrap_or(&r.parent_session_key),
}

type R<T> = Result<T, EngineCallError>;

/// The Engine impl: each method's request goes to its replica. Written as
/// one macro around the whole impl, since `#[async_trait]` must see the
/// methods' `async fn`s.
macro_rules! routed {
    ($($name:ident($Req:ty) -> $Res:ty, retried: $retried:literal;)*) => {
        #[async_trait]
        impl Engine for Replicas {
            /// A replica in service speaks for the engine; legacy's info when none is.
            fn info(&self) -> Arc<pb::EngineInfo> {
                let set = self.replicas();
                let r = set.iter().find(|r| r.in_service()).unwrap_or(&set[0]);
                r.guarded.info()
            }

            $(async fn $name(&self, req: $Req, call: &Call) -> R<$Res> {
                let replica = self.pick(req.session());
                if !$retried || !self.another_in_service(&replica) {
                    return replica.$name(req, call).await;
                }
                // Idempotent: a replica that fails it (dead before the
                // health monitor noticed; quarantined by this call) is
                // replaced once by another in service, not by legacy.
                match replica.$name(req.clone(), &call.surfacing_failures()).await {
                    Err(e) if replica.is_quarantined() && !matches!(e, EngineCallError::Cancelled) => {
                        tracing::info!(engine = %self.id, error = %e, "a replica failed; asking another");
                        self.pick(req.session()).$name(req, call).await
                    }
                    r => r,
                }
            })*

            async fn compact(&self, req: pb::CompactRequest, call: &Call, progress: &ProgressFn<'_>) -> R<CompactReply> {
                let replica = self.pick(req.session());
                replica.compact(req, call, progress).await
            }

            // The child's state may be on any replica (a spawn writes it on
            // the parent's, its turns on its own).
            async fn rollback_subagent_spawn(
                &self,
                req: pb::RollbackSubagentSpawnRequest,
                call: &Call,
            ) -> R<pb::RollbackSubagentSpawnResult> {
                self.every(false, |g| {
                    let req = req.clone();
                    async move { g.rollback_subagent_spawn(req, call).await }
                })
                .await
            }

            async fn on_subagent_ended(&self, req: pb::OnSubagentEndedRequest, call: &Call) -> R<pb::OnSubagentEndedResult> {
                self.every(false, |g| {
                    let req = req.clone();
                    async move { g.on_subagent_ended(req, call).await }
                })
                .await
            }

            // Every copy of the session goes, including those a quarantined
            // replica holds: the queued forget waits for it.
            async fn forget_session(&self, req: pb::ForgetSessionRequest, call: &Call) -> R<pb::ForgetSessionResult> {
                self.every(true, |g| {
                    let req = req.clone();
                    async move { g.forget_session(req, call).await }
                })
                .await
            }
        }
    };
}

// `retried`: idempotent for the engine (a read, or a write by message id
// or session that a second replica can repeat), so a dead replica's call
// goes to another before legacy answers it. The request is cloned for it
// only while another replica is in service.
routed! {
    bootstrap(pb::BootstrapRequest) -> pb::BootstrapResult, retried: true;
    ingest(pb::IngestRequest) -> pb::IngestResult, retried: false;
    ingest_batch(pb::IngestBatchRequest) -> pb::IngestBatchResult, retried: true;
    assemble(pb::AssembleRequest) -> pb::AssembleResult, retried: true;
    after_turn(pb::AfterTurnRequest) -> pb::AfterTurnResult, retried: false;
    commit_turn(pb::CommitTurnRequest) -> pb::CommitTurnResult, retried: false;
    maintain(pb::MaintainRequest) -> pb::MaintainResult, retried: true;
    prepare_subagent_spawn(pb::PrepareSubagentSpawnRequest) -> pb::PrepareSubagentSpawnResult, retried: false;
    call_tool(pb::CallToolRequest) -> pb::CallToolResult, retried: false;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lookup that outlives its timeout is cancelled, not left running;
    /// the next pass asks anew.
    #[tokio::test(start_paused = true)]
    async fn a_hung_lookup_is_cancelled_at_its_timeout() {
        struct Running(Arc<std::sync::atomic::AtomicBool>);
        impl Drop for Running {
            fn drop(&mut self) {
                self.0.store(false, std::sync::atomic::Ordering::SeqCst);
            }
        }
        let running = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let hung = {
            let guard = Running(running.clone());
            async move {
                let _guard = guard;
                std::future::pending::<Result<Vec<IpAddr>, String>>().await
            }
        };
        let err = resolve("engines", 7401, hung).await.unwrap_err();
        assert!(err.contains("took over"), "{err}");
        assert!(!running.load(std::sync::atomic::Ordering::SeqCst), "the lookup was dropped with its wait");
        let answer =
            async { Ok(vec![IpAddr::from([10, 0, 0, 2]), IpAddr::from([10, 0, 0, 1]), IpAddr::from([10, 0, 0, 1])]) };
        let addrs = resolve("engines", 7401, answer).await.unwrap();
        assert_eq!(addrs, [SocketAddr::from(([10, 0, 0, 1], 7401)), SocketAddr::from(([10, 0, 0, 2], 7401))]);
    }

    /// Lookups need no blocking thread: with the runtime's only one held
    /// (as a hung getaddrinfo would hold it), a name still resolves.
    #[test]
    fn a_lookup_runs_on_the_runtime_not_on_a_blocking_thread() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .max_blocking_threads(1)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let (held, release) = std::sync::mpsc::channel::<()>();
            let blocker = tokio::task::spawn_blocking(move || release.recv());
            let resolver = system_resolver().unwrap();
            let addrs = resolve("localhost", 7401, system_lookup(&resolver, "localhost")).await;
            drop(held);
            blocker.await.unwrap().unwrap_err();
            let addrs = addrs.unwrap();
            assert!(addrs.contains(&SocketAddr::from(([127, 0, 0, 1], 7401))), "{addrs:?}");
        });
    }

    #[test]
    fn rendezvous_moves_only_a_departed_replicas_sessions() {
        let all = ["10.0.0.1:7401", "10.0.0.2:7401", "10.0.0.3:7401"];
        // The production rule, as `pick` applies it to the replicas in service.
        fn owner<'a>(set: &[&'a str], s: &str) -> &'a str {
            super::owner(set, |a| a, s).unwrap()
        }
        let sessions: Vec<String> = (0..3000).map(|i| format!("session-{i}")).collect();
        let mut per = BTreeMap::<&str, usize>::new();
        for s in &sessions {
            *per.entry(owner(&all, s)).or_default() += 1;
        }
        // Spread: each replica gets about a third.
        assert!(per.values().all(|n| (800..1200).contains(n)), "{per:?}");
        let without = [all[0], all[2]];
        for s in &sessions {
            let (before, after) = (owner(&all, s), owner(&without, s));
            if before == all[1] {
                assert_ne!(after, all[1]);
            } else {
                assert_eq!(before, after, "{s} moved though its replica stayed");
            }
        }
        // Pinned: gateways of different versions must pick the same
        // replica, so a change of the function fails here.
        // (FNV-1a 64 and SplitMix64's finaliser, computed independently.)
        assert_eq!(rendezvous("10.0.0.1:7401", "session-0"), 0x8254_8325_e299_582c);
        assert_ne!(rendezvous("10.0.0.1:7401", "session-0"), rendezvous("10.0.0.1:7401", "session-1"));
    }

    #[test]
    fn affinity_defaults_to_session_for_delta_engines() {
        let mut info = pb::EngineInfo::default();
        assert_eq!(Affinity::of(&info), Affinity::None);
        info.history_delivery = pb::HistoryDelivery::Delta as i32;
        assert_eq!(Affinity::of(&info), Affinity::Session);
        info.replica_affinity = pb::ReplicaAffinity::None as i32;
        assert_eq!(Affinity::of(&info), Affinity::None);
        info.history_delivery = pb::HistoryDelivery::Full as i32;
        info.replica_affinity = pb::ReplicaAffinity::Session as i32;
        assert_eq!(Affinity::of(&info), Affinity::Session);
        // An unknown value from a newer engine is unspecified.
        info.replica_affinity = 99;
        assert_eq!(Affinity::of(&info), Affinity::None);
    }
}
