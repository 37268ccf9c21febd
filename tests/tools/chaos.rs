//! `chaos [--profile openclaw]`: faults across containers, with the compose
//! stack up (`.ci/images up`, with `--profile openclaw` for that profile)
//! and turns flowing from this process on the host through a gateway
//! container (TLS) to an engine's three replicas (mTLS): the window engine,
//! or with `--profile openclaw` lossless-claw under the OpenClaw host
//! (through `gateway-openclaw`). Run from the repository root; `.ci/run`
//! runs both.
//!
//! First the secrets: every container of the profile mounts only its own
//! folder of certificates; with `openclaw`, the lossless-claw container can
//! read no key but its own, and a call from it to the window engine with
//! its certificate is refused. Then, in order, each step bounded in time:
//! `docker kill` the busiest replica (its sessions move, no turn fails; a
//! DELTA engine resyncs them), kill the other two (legacy answers, the
//! quarantine shows), start all three again (re-admitted), `docker network
//! disconnect` one (a deadline, fallback, that replica quarantined) and
//! reconnect it, restart the gateway container (state on its volume),
//! `docker pause` one replica (a hang) and unpause it. It prints what it
//! did and saw, then checks that every turn was answered or failed with a
//! clear status, and that every acknowledged turn's message is in its
//! session's transcript exactly once; with `openclaw`, also that
//! lossless-claw's databases (read from the stopped replicas) hold every
//! acknowledged turn of a session exactly once on one replica and no turn
//! twice on any. Exit 1 on any violation.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ctxgate_proto::gateway::{self as api, gateway_client::GatewayClient, turn_event::Event};
use ctxgate_proto::pb::transcript_entry::Entry;
use tokio::time::Instant;
use tokio_stream::StreamExt;
use tonic::transport::{Certificate, Channel, ClientTlsConfig};

const CA: &str = "target/compose-certs/ca.pem";
/// Where .ci/certs made each service's folder (mounted at its /certs).
const CERTS: &str = "target/compose-certs";
/// The client API's bearer token (`CTXGATE_AUTH_TOKEN=…`), made with the certificates.
const TOKEN_ENV: &str = "target/compose-certs/gateway.env";
const WORKERS: usize = 4;
const SESSIONS_PER_WORKER: usize = 3;
/// A turn that takes longer than this is a hang, not an answer.
const TURN_LIMIT: Duration = Duration::from_secs(60);
/// Any docker command takes at most this; a status call or metrics read
/// at most `CALL_LIMIT`.
const DOCKER_LIMIT: Duration = Duration::from_secs(60);
const CALL_LIMIT: Duration = Duration::from_secs(10);

type R<T> = Result<T, String>;

/// What a compose profile runs: which gateway, which engine, where.
struct Profile {
    /// The gateway container's client API and metrics, published on the host.
    gateway: &'static str,
    metrics: &'static str,
    gateway_service: &'static str,
    /// The engine's `plugins.entries` id (its name in turns, metrics and
    /// status), its compose service (its DNS name) and whether it takes
    /// DELTA history (a moved session is then resynced with IngestBatch).
    entry: &'static str,
    service: &'static str,
    delta: bool,
    /// Every service of the profile and the certificate folder it mounts
    /// (its own: the gateways share the gateway's).
    services: &'static [(&'static str, &'static str)],
    /// The compose flags that show the profile's services.
    compose_flags: &'static [&'static str],
}

const DEFAULT: Profile = Profile {
    gateway: "https://127.0.0.1:7300",
    metrics: "127.0.0.1:9464",
    gateway_service: "gateway",
    entry: "window",
    service: "engine-window",
    delta: true,
    services: &[("gateway", "gateway"), ("engine-window", "engine-window"), ("engine-python", "engine-python")],
    compose_flags: &[],
};

const OPENCLAW: Profile = Profile {
    gateway: "https://127.0.0.1:7310",
    metrics: "127.0.0.1:9474",
    gateway_service: "gateway-openclaw",
    entry: "lossless",
    service: "engine-lossless",
    delta: false,
    services: &[("gateway-openclaw", "gateway"), ("engine-lossless", "engine-lossless")],
    compose_flags: &["--profile", "openclaw"],
};

/// The compose stack, driven with the docker CLI.
struct Stack {
    compose: Vec<String>,
}

impl Stack {
    async fn new(flags: &[&str]) -> Self {
        let v1 = Self::run("docker-compose", &["version"]).await.is_ok();
        let mut compose: Vec<String> =
            if v1 { vec!["docker-compose".into()] } else { vec!["docker".into(), "compose".into()] };
        compose.extend(flags.iter().map(|f| (*f).to_owned()));
        Self { compose }
    }

    /// One compose command, bounded by [`DOCKER_LIMIT`].
    async fn compose(&self, args: &[&str]) -> R<String> {
        let mut all: Vec<&str> = self.compose[1..].iter().map(String::as_str).collect();
        all.extend(args);
        Self::run(&self.compose[0], &all).await
    }

    /// One docker command, bounded by [`DOCKER_LIMIT`].
    async fn run(program: &str, args: &[&str]) -> R<String> {
        let mut cmd = tokio::process::Command::new(program);
        cmd.args(args).kill_on_drop(true);
        let out = tokio::time::timeout(DOCKER_LIMIT, cmd.output())
            .await
            .map_err(|_| format!("{program} {}: no answer within {DOCKER_LIMIT:?}", args.join(" ")))?
            .map_err(|e| format!("{program}: {e}"))?;
        if !out.status.success() {
            return Err(format!("{program} {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()));
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    async fn docker(&self, args: &[&str]) -> R<String> {
        Self::run("docker", args).await
    }

    /// The containers of a compose service.
    async fn ids(&self, service: &str) -> R<Vec<String>> {
        let out = self.compose(&["ps", "-q", service]).await?;
        Ok(out.lines().map(str::to_owned).filter(|l| !l.is_empty()).collect())
    }

    /// A container's network and its address on it.
    async fn network(&self, id: &str) -> R<(String, String)> {
        let f = "{{range $k, $v := .NetworkSettings.Networks}}{{$k}} {{$v.IPAddress}}{{end}}";
        let out = self.docker(&["inspect", "-f", f, id]).await?;
        let (net, ip) = out.split_once(' ').ok_or_else(|| format!("no network for {id}: {out:?}"))?;
        Ok((net.to_owned(), ip.to_owned()))
    }
}

/// What the turns saw.
#[derive(Default)]
struct Tally {
    by_engine: BTreeMap<String, u64>,
    /// Failed turns by status code and message.
    failed: BTreeMap<String, u64>,
    /// Violations: hangs, failures without a clear status.
    unclear: Vec<String>,
    /// Per session, the texts of acknowledged turns, in order.
    acked: BTreeMap<String, Vec<String>>,
}

impl Tally {
    fn snapshot(&self) -> (BTreeMap<String, u64>, u64) {
        (self.by_engine.clone(), self.failed.values().sum())
    }
}

type Client = GatewayClient<tonic::service::interceptor::InterceptedService<Channel, Bearer>>;

/// Adds `authorization: Bearer <token>` to every request.
#[derive(Clone)]
struct Bearer(tonic::metadata::MetadataValue<tonic::metadata::Ascii>);

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        req.metadata_mut().insert("authorization", self.0.clone());
        Ok(req)
    }
}

async fn connect(gateway: &'static str) -> R<Client> {
    let ca = std::fs::read(CA).map_err(|e| format!("{CA}: {e}"))?;
    let env = std::fs::read_to_string(TOKEN_ENV).map_err(|e| format!("{TOKEN_ENV}: {e}"))?;
    let token = env
        .lines()
        .find_map(|l| l.strip_prefix("CTXGATE_AUTH_TOKEN="))
        .ok_or_else(|| format!("{TOKEN_ENV}: no CTXGATE_AUTH_TOKEN= line"))?;
    let bearer = format!("Bearer {}", token.trim()).parse().map_err(|_| format!("{TOKEN_ENV}: not a header value"))?;
    let tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca)).domain_name("localhost");
    let ep = Channel::from_static(gateway).tls_config(tls).map_err(|e| e.to_string())?;
    Ok(GatewayClient::with_interceptor(ep.connect_timeout(Duration::from_secs(2)).connect_lazy(), Bearer(bearer)))
}

fn sref(key: &str) -> Option<api::SessionRef> {
    Some(api::SessionRef { agent_id: String::new(), session_key: key.into() })
}

/// One turn: the engine that served it, or the status that ended it.
async fn turn(client: &mut Client, key: &str, text: &str) -> Result<String, tonic::Status> {
    let req = api::RunTurnRequest { session: sref(key), message: text.into(), ..Default::default() };
    let mut stream = client.run_turn(req).await?.into_inner();
    let mut engine = None;
    while let Some(e) = stream.next().await {
        match e?.event {
            Some(Event::EngineSelected(s)) => engine = Some(s.engine_id),
            Some(Event::Completed(_)) => return Ok(engine.unwrap_or_default()),
            // A turn that ended failed (an abort when the gateway stops).
            Some(Event::Failed(f)) => return Err(tonic::Status::aborted(format!("turn {}: {}", f.reason, f.message))),
            _ => {}
        }
    }
    Err(tonic::Status::unknown("the turn's stream ended without Completed"))
}

/// Runs turns on its sessions until `stop`.
async fn worker(gateway: &'static str, run: u64, w: usize, tally: Arc<Mutex<Tally>>, stop: Arc<AtomicBool>) {
    let Ok(mut client) = connect(gateway).await else { return };
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        // Sessions of this run only (the gateway keeps earlier runs').
        let key = format!("chaos-{run}-{w}-{}", n as usize % SESSIONS_PER_WORKER);
        let text = format!("chaos turn {n} on {key}");
        n += 1;
        let r = tokio::time::timeout(TURN_LIMIT, turn(&mut client, &key, &text)).await;
        let pause = record(&mut tally.lock().unwrap_or_else(|e| e.into_inner()), key, text, r);
        tokio::time::sleep(pause).await;
    }
}

/// Records one turn's outcome; how long to wait before the next.
fn record(
    t: &mut Tally,
    key: String,
    text: String,
    r: Result<Result<String, tonic::Status>, tokio::time::error::Elapsed>,
) -> Duration {
    match r {
        Ok(Ok(engine)) => {
            *t.by_engine.entry(engine).or_default() += 1;
            t.acked.entry(key).or_default().push(text);
            Duration::from_millis(20)
        }
        Ok(Err(s)) => {
            if s.message().trim().is_empty() {
                t.unclear.push(format!("{key}: {:?} with no message", s.code()));
            }
            let what = format!("{:?}: {}", s.code(), s.message().chars().take(100).collect::<String>());
            *t.failed.entry(what).or_default() += 1;
            // A shed or a restarting gateway: back off as asked.
            let ms = s.metadata().get("grpc-retry-pushback-ms").and_then(|v| v.to_str().ok()?.parse().ok());
            Duration::from_millis(ms.unwrap_or(250))
        }
        Err(_) => {
            t.unclear.push(format!("{key}: no answer within {TURN_LIMIT:?}"));
            Duration::from_millis(250)
        }
    }
}

async fn status(client: &mut Client, entry: &str) -> R<api::EngineStatus> {
    let mut req = tonic::Request::new(api::StatusRequest {});
    req.set_timeout(CALL_LIMIT);
    let s = client.get_status(req).await.map_err(|s| s.message().to_owned())?.into_inner();
    s.engines.into_iter().find(|e| e.id == entry).ok_or_else(|| format!("no engine {entry} in status"))
}

fn in_service(r: &api::ReplicaStatus) -> bool {
    r.quarantine.is_none()
}

/// Polls status until `ok` (at most `within`); how long it took.
async fn until(
    client: &mut Client,
    entry: &str,
    what: &str,
    within: Duration,
    ok: impl Fn(&api::EngineStatus) -> bool,
) -> R<Duration> {
    let start = Instant::now();
    let mut last = None;
    while start.elapsed() < within {
        match status(client, entry).await {
            Ok(e) if ok(&e) => return Ok(start.elapsed()),
            Ok(e) => last = Some(e),
            Err(_) => {}
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(format!("{what}: not within {within:?}; last status: {}", last.map(|e| describe(&e)).unwrap_or_default()))
}

fn describe(e: &api::EngineStatus) -> String {
    let replicas: Vec<String> = e
        .replicas
        .iter()
        .map(|r| format!("{} {}{}", r.address, r.health, if r.quarantine.is_some() { " (quarantined)" } else { "" }))
        .collect();
    let q = e.quarantine.as_ref().map_or(String::new(), |q| format!(", engine quarantined: {}", q.reason));
    format!("[{}]{q}", replicas.join(", "))
}

/// Whether a call's answer is a refusal of the connection (the engine ends
/// the handshake on a certificate it will not take; with TLS 1.3 the client
/// may see the close rather than the alert), never an answer.
fn refused_at_handshake(answer: &str) -> bool {
    answer.starts_with("refused: UNAVAILABLE")
}

/// A client certificate (PEM certificate and key) the compose CA signs for
/// DNS name `name`, made with openssl in `target/chaos-certs`.
async fn client_certificate(name: &str) -> R<(String, String)> {
    let dir = std::path::Path::new("target/chaos-certs");
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let [key, csr, ext, pem] =
        ["key", "csr", "ext", "pem"].map(|x| dir.join(format!("{name}.{x}")).to_string_lossy().into_owned());
    std::fs::write(&ext, format!("subjectAltName=DNS:{name}\nextendedKeyUsage=clientAuth\n"))
        .map_err(|e| format!("{ext}: {e}"))?;
    let ca = format!("{CERTS}/ca.pem");
    let ca_key = format!("{CERTS}/ca/ca.key");
    let steps: [&[&str]; 3] = [
        &["genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", &key],
        &["req", "-new", "-key", &key, "-subj", &format!("/CN={name}"), "-out", &csr],
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            &ca,
            "-CAkey",
            &ca_key,
            "-set_serial",
            "7",
            "-days",
            "1",
            "-extfile",
            &ext,
            "-out",
            &pem,
        ],
    ];
    for args in steps {
        Stack::run("openssl", args).await?;
    }
    let read = |p: &str| std::fs::read_to_string(p).map_err(|e| format!("{p}: {e}"));
    Ok((read(&pem)?, read(&key)?))
}

/// The engine's resyncs so far (IngestBatch calls that did not fail: a
/// session that moved to a replica that lacks its history, whether the
/// replica reported the gap or a turn in flight fell back to the full
/// history), from the gateway's metrics; why not, when they cannot be read
/// within [`CALL_LIMIT`].
async fn resyncs(metrics: &str, entry: &str) -> R<u64> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let read = async {
        let mut s = tokio::net::TcpStream::connect(metrics).await.map_err(|e| format!("connect: {e}"))?;
        s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").await.map_err(|e| format!("write: {e}"))?;
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.map_err(|e| format!("read: {e}"))?;
        Ok::<_, String>(String::from_utf8_lossy(&out).into_owned())
    };
    let out = tokio::time::timeout(CALL_LIMIT, read)
        .await
        .map_err(|_| format!("{metrics}/metrics: no answer within {CALL_LIMIT:?}"))?
        .map_err(|e| format!("{metrics}/metrics: {e}"))?;
    if !out.starts_with("HTTP/1.") || !out.contains("ctxgate_") {
        return Err(format!("{metrics}/metrics: not the gateway's metrics: {}", out.lines().next().unwrap_or("")));
    }
    let sum = |series: &str| -> u64 {
        out.lines().filter(|l| l.starts_with(series)).filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok()).sum()
    };
    let calls = sum(&format!("ctxgate_engine_calls_total{{engine=\"{entry}\",method=\"IngestBatch\"}}"));
    // Failures carry a code label after the method.
    let failed = sum(&format!("ctxgate_engine_failures_total{{engine=\"{entry}\",method=\"IngestBatch\","));
    Ok(calls.saturating_sub(failed))
}

struct Run {
    profile: &'static Profile,
    stack: Stack,
    client: Client,
    tally: Arc<Mutex<Tally>>,
    violations: Vec<String>,
    started: Instant,
}

impl Run {
    fn say(&self, what: &str) {
        println!("[{:>6.1} s] {what}", self.started.elapsed().as_secs_f64());
    }

    fn check(&mut self, ok: bool, what: String) {
        if !ok {
            println!("  VIOLATION: {what}");
            self.violations.push(what);
        }
    }

    /// Turns keep flowing for `d`; what they saw meanwhile.
    async fn flow(&mut self, d: Duration) -> (BTreeMap<String, u64>, u64) {
        let before = self.tally.lock().unwrap_or_else(|e| e.into_inner()).snapshot();
        tokio::time::sleep(d).await;
        let after = self.tally.lock().unwrap_or_else(|e| e.into_inner()).snapshot();
        let engines = after.0.iter().map(|(k, v)| (k.clone(), v - before.0.get(k).copied().unwrap_or(0))).collect();
        let seen: BTreeMap<String, u64> = engines;
        println!("           turns: {seen:?}, failed: {}", after.1 - before.1);
        (seen, after.1 - before.1)
    }

    /// How a replica left service, as the gateway shows it now.
    async fn how_out(&mut self, address: &str) -> &'static str {
        match status(&mut self.client, self.profile.entry).await {
            Ok(e) => match e.replicas.iter().find(|r| r.address == address) {
                Some(r) if r.quarantine.is_some() => "quarantined",
                Some(_) => "in service again",
                None => "dropped (its name no longer resolves to it)",
            },
            Err(_) => "out of service",
        }
    }

    fn waited(&mut self, r: R<Duration>, what: &str) -> Option<Duration> {
        match r {
            Ok(d) => {
                self.say(&format!("{what} after {:.1} s", d.as_secs_f64()));
                Some(d)
            }
            Err(e) => {
                self.check(false, e);
                None
            }
        }
    }

    async fn docker(&mut self, args: &[&str]) {
        self.say(&format!("docker {}", args.join(" ")));
        if let Err(e) = self.stack.docker(args).await {
            self.check(false, e);
        }
    }

    /// `docker pause`, tried up to three times: the kernel can fail to
    /// freeze a container caught in uninterruptible IO ("unable to
    /// freeze"), which says nothing of ctxgate.
    async fn pause(&mut self, id: &str) {
        for attempt in 1..=3 {
            self.say(&format!("docker pause {id}"));
            match self.stack.docker(&["pause", id]).await {
                Ok(_) => return,
                Err(e) if attempt < 3 && e.contains("unable to freeze") => {
                    self.say(&format!("the container could not be frozen ({e}); again in 1 s"));
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                Err(e) => return self.check(false, e),
            }
        }
    }

    /// The container behind a replica address.
    async fn container_at(&self, ids: &[String], address: &str) -> R<String> {
        for id in ids {
            if self.stack.network(id).await.is_ok_and(|(_, ip)| address.starts_with(&format!("{ip}:"))) {
                return Ok(id.clone());
            }
        }
        Err(format!("no container at {address}"))
    }

    /// The replica that has served the most calls: its address and the
    /// container behind it (one of `windows`).
    async fn busiest(&mut self, windows: &[String]) -> R<(String, String)> {
        let e = status(&mut self.client, self.profile.entry).await?;
        let address = e.replicas.iter().max_by_key(|r| r.calls).map(|r| r.address.clone()).ok_or("no replicas")?;
        let container = self.container_at(windows, &address).await?;
        Ok((address, container))
    }

    /// Waits (at most `within`) until the replica at `address` is out of
    /// service, quarantined or dropped once its name stopped resolving to
    /// it, and says how long that took and which it was (then `note`).
    async fn until_out(&mut self, address: &str, what: &str, within: Duration, note: &str) {
        let gone = |e: &api::EngineStatus| e.replicas.iter().all(|r| r.address != address || !in_service(r));
        let d = until(&mut self.client, self.profile.entry, what, within, gone).await;
        let how = self.how_out(address).await;
        self.waited(d, &format!("replica {address} {how}{note}"));
    }

    /// Polls the gateway's count of resyncs until it passes `gaps` (at most
    /// `within`): the last count and when it was read.
    async fn until_resynced(&self, gaps: u64, within: Duration) -> R<(u64, Duration)> {
        let start = Instant::now();
        loop {
            let now = resyncs(self.profile.metrics, self.profile.entry).await?;
            if now > gaps || start.elapsed() >= within {
                return Ok((now, start.elapsed()));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Polls the engine's status until `ok` (at most `within`).
    async fn until(&mut self, what: &str, within: Duration, ok: impl Fn(&api::EngineStatus) -> bool) -> R<Duration> {
        until(&mut self.client, self.profile.entry, what, within, ok).await
    }

    async fn status(&mut self) -> R<api::EngineStatus> {
        status(&mut self.client, self.profile.entry).await
    }

    /// Turns served by `engine` in `seen`.
    fn served(seen: &BTreeMap<String, u64>, engine: &str) -> u64 {
        seen.get(engine).copied().unwrap_or(0)
    }

    async fn scenario(&mut self) -> R<()> {
        let p = self.profile;
        let replicas = self.stack.ids(p.service).await?;
        let gateway = self.stack.ids(p.gateway_service).await?.first().cloned().ok_or("no gateway container")?;
        self.check(replicas.len() == 3, format!("3 {} replicas expected, found {}", p.service, replicas.len()));
        let all = |e: &api::EngineStatus| e.replicas.len() == 3 && e.replicas.iter().all(in_service);
        let d = self.until("three replicas in service", Duration::from_secs(30), all).await;
        self.waited(d, &format!("three {} replicas in service", p.service));

        self.say("baseline");
        let (seen, failed) = self.flow(Duration::from_secs(3)).await;
        self.check(failed == 0 && Self::served(&seen, p.entry) > 0, format!("baseline: served by {}", p.entry));

        // 1. The busiest replica dies: its sessions move (a DELTA engine
        // resyncs them), no turn fails.
        let (busiest, victim) = self.busiest(&replicas).await?;
        let gaps = resyncs(p.metrics, p.entry).await;
        if let Err(e) = &gaps {
            self.check(false, format!("the gateway's metrics before the kill: {e}"));
        }
        self.docker(&["kill", &victim]).await;
        self.until_out(&busiest, "the killed replica out of service", Duration::from_secs(20), "").await;
        let (seen, failed) = self.flow(Duration::from_secs(4)).await;
        self.check(failed == 0, format!("kill one replica: {failed} turn(s) failed"));
        if p.delta
            && let Ok(gaps) = gaps
        {
            // Turns keep flowing: a moved session resyncs at its next turn,
            // which a worker stalled behind the dead replica reaches late.
            match self.until_resynced(gaps, Duration::from_secs(20)).await {
                Ok((now, d)) if now > gaps => {
                    self.say(&format!("{} resync(s) on the other replicas after {:.1} s", now - gaps, d.as_secs_f64()))
                }
                Ok(_) => self
                    .check(false, "kill one replica: its sessions should resync elsewhere (none within 20 s)".into()),
                Err(e) => self.check(false, format!("kill one replica: the gateway's metrics: {e}")),
            }
        }
        self.check(Self::served(&seen, "legacy") == 0, format!("kill one replica: turns degraded to legacy: {seen:?}"));
        let e = self.status().await?;
        self.check(
            e.quarantine.is_none(),
            format!("two replicas left, yet the engine is quarantined: {}", describe(&e)),
        );

        // 2. All of them die: legacy answers, the quarantine shows.
        for id in replicas.iter().filter(|id| **id != victim) {
            self.docker(&["kill", id]).await;
        }
        let out = |e: &api::EngineStatus| e.quarantine.is_some();
        let d = self.until("the engine quarantined", Duration::from_secs(20), out).await;
        self.waited(d, "engine quarantined (every replica down)");
        let e = self.status().await?;
        self.say(&format!("status: {}", describe(&e)));
        // Turns in flight when the last replicas died wait out their engine
        // call's deadline before legacy answers them (lossless-claw's are
        // long): legacy gets up to 12 s to show.
        let (mut seen, mut failed) = self.flow(Duration::from_secs(3)).await;
        for _ in 0..3 {
            if Self::served(&seen, "legacy") > 0 {
                break;
            }
            let (more, f) = self.flow(Duration::from_secs(3)).await;
            failed += f;
            for (k, v) in more {
                *seen.entry(k).or_default() += v;
            }
        }
        self.check(failed == 0, format!("all replicas down: {failed} turn(s) failed"));
        self.check(
            Self::served(&seen, "legacy") > 0,
            "all replicas down: legacy should answer (none within 12 s)".into(),
        );

        // 3. They come back: re-admitted.
        for id in &replicas {
            self.docker(&["start", id]).await;
        }
        let d = self.until("three replicas re-admitted", Duration::from_secs(60), all).await;
        self.waited(d, "three replicas re-admitted");
        let (seen, failed) = self.flow(Duration::from_secs(3)).await;
        self.check(failed == 0 && Self::served(&seen, p.entry) > 0, format!("after restart: served by {}", p.entry));

        // 4. One replica cut off the network: a deadline, fallback, quarantined.
        let (busiest, cut) = self.busiest(&replicas).await?;
        let (net, _) = self.stack.network(&cut).await?;
        self.docker(&["network", "disconnect", &net, &cut]).await;
        // Out of service either way: quarantined when a call to it reached
        // its deadline, or dropped when its name stopped resolving to it.
        self.until_out(&busiest, "the cut-off replica out of service", Duration::from_secs(40), "").await;
        let e = self.status().await?;
        self.say(&format!("status: {}", describe(&e)));
        let (_, failed) = self.flow(Duration::from_secs(3)).await;
        self.check(failed == 0, format!("network disconnect: {failed} turn(s) failed"));
        // Back on the network under its service name (compose's alias).
        self.docker(&["network", "connect", "--alias", p.service, &net, &cut]).await;
        let d = self.until("three replicas in service again", Duration::from_secs(60), all).await;
        self.waited(d, "three replicas in service again (reconnected)");

        // 5. The gateway restarts: its state is on its volume.
        self.docker(&["restart", "-t", "5", &gateway]).await;
        let up = |e: &api::EngineStatus| !e.replicas.is_empty() && e.replicas.iter().any(in_service);
        let d = self.until("the gateway back", Duration::from_secs(60), up).await;
        self.waited(d, &format!("gateway back, serving through {}", p.entry));
        let (seen, _) = self.flow(Duration::from_secs(3)).await;
        self.check(Self::served(&seen, p.entry) > 0, format!("after the gateway restart: served by {}", p.entry));

        // 6. One replica paused: a hang, then a deadline; unpaused: back.
        let (busiest, paused) = self.busiest(&replicas).await?;
        self.pause(&paused).await;
        self.until_out(&busiest, "the paused replica out of service", Duration::from_secs(40), " (a hang)").await;
        let (_, failed) = self.flow(Duration::from_secs(3)).await;
        self.check(failed == 0, format!("pause: {failed} turn(s) failed"));
        self.docker(&["unpause", &paused]).await;
        let d = self.until("three replicas in service after unpause", Duration::from_secs(60), all).await;
        self.waited(d, "three replicas in service again (unpaused)");
        self.flow(Duration::from_secs(2)).await;
        Ok(())
    }

    /// Each container mounts only its own folder of certificates, and that
    /// folder holds the CA and its own pair.
    async fn mounts(&mut self) -> R<()> {
        for (service, folder) in self.profile.services {
            let mut held: Vec<String> = std::fs::read_dir(format!("{CERTS}/{folder}"))
                .map_err(|e| format!("{CERTS}/{folder}: {e}"))?
                .filter_map(|e| e.ok()?.file_name().into_string().ok())
                .collect();
            held.sort();
            let want = vec!["ca.pem".to_owned(), format!("{folder}.key"), format!("{folder}.pem")];
            self.check(held == want, format!("{CERTS}/{folder} holds {held:?}, not just the CA and its own pair"));
            for id in self.stack.ids(service).await? {
                let f = "{{range .Mounts}}{{.Source}} {{.Destination}}\n{{end}}";
                let mounts = self.stack.docker(&["inspect", "-f", f, &id]).await?;
                let certs: Vec<&str> = mounts
                    .lines()
                    .filter(|l| l.contains("compose-certs") || l.ends_with(" /certs") || l.contains(" /certs/"))
                    .collect();
                let own = certs.len() == 1 && certs[0].ends_with(&format!("/compose-certs/{folder} /certs"));
                self.check(own, format!("{service} ({id:.12}) mounts {certs:?}, not only its own certificates"));
            }
            self.say(&format!("{service}: mounts only {CERTS}/{folder} (the CA and its own pair)"));
        }
        Ok(())
    }

    /// From inside a lossless-claw container (where third-party plugin code
    /// runs): the private keys it can read, and calls to the window engine
    /// with its own certificate (server-only), with a client certificate
    /// the CA signed for another name (the name check alone refuses it),
    /// and, as the control, with one the CA signed for the gateway's name.
    async fn plugin_reach(&mut self) -> R<()> {
        let id = self.stack.ids(self.profile.service).await?.first().cloned().ok_or("no lossless-claw container")?;
        let find = "find / \\( -path /proc -o -path /sys \\) -prune -o -type f \\( -name '*.key' -o -name '*.pem' \\) \
                    -readable -print0 | xargs -0 grep -l 'PRIVATE KEY'";
        let keys = self.stack.docker(&["exec", &id, "sh", "-c", find]).await?;
        let keys: Vec<&str> = keys.lines().collect();
        self.say(&format!("lossless-claw container: readable private keys {keys:?}"));
        self.check(keys == ["/certs/engine-lossless.key"], format!("the lossless-claw container can read {keys:?}"));
        let own = self.call_window(&id, None).await?;
        self.say(&format!("GetInfo on the window engine with the lossless-claw certificate: {own}"));
        self.check(refused_at_handshake(&own), format!("the lossless-claw certificate: {own}"));
        let stranger = self.call_window(&id, Some(client_certificate("engine-lossless").await?)).await?;
        self.say(&format!("… with a client certificate the CA signed for engine-lossless: {stranger}"));
        self.check(refused_at_handshake(&stranger), format!("a client certificate for another name: {stranger}"));
        let gateway = self.call_window(&id, Some(client_certificate("gateway").await?)).await?;
        self.say(&format!("… with one the CA signed for gateway (the control): {gateway}"));
        self.check(gateway == "served", format!("a client certificate naming the gateway: {gateway}"));
        Ok(())
    }

    /// GetInfo on the window engine from inside container `id`, over mTLS
    /// with the grpc-js the host itself runs on, presenting `pair` (PEM
    /// certificate and key) or the container's own: "served" or "refused:
    /// STATUS: DETAILS".
    async fn call_window(&self, id: &str, pair: Option<(String, String)>) -> R<String> {
        let call = r#"
            const grpc = require("/app/engine-sdk/typescript/node_modules/@grpc/grpc-js");
            const fs = require("fs");
            const cert = process.env.CLIENT_CERT || fs.readFileSync("/certs/engine-lossless.pem");
            const key = process.env.CLIENT_KEY || fs.readFileSync("/certs/engine-lossless.key");
            const creds = grpc.credentials.createSsl(fs.readFileSync("/certs/ca.pem"), Buffer.from(key), Buffer.from(cert));
            const c = new grpc.Client("dns:engine-window:7401", creds);
            c.makeUnaryRequest("/contextengine.v1.ContextEngine/GetInfo", (b) => b, (b) => b, Buffer.alloc(0),
              new grpc.Metadata(), { deadline: Date.now() + 10000 }, (err) => {
                console.log(err ? `refused: ${grpc.status[err.code]}: ${err.details}`.split("\n")[0] : "served");
                process.exit(0);
              });"#;
        let mut args = vec!["exec".to_owned()];
        if let Some((cert, key)) = pair {
            args.extend(["-e".into(), format!("CLIENT_CERT={cert}"), "-e".into(), format!("CLIENT_KEY={key}")]);
        }
        args.extend([id.to_owned(), "node".into(), "-e".into(), call.into()]);
        self.stack.docker(&args.iter().map(String::as_str).collect::<Vec<_>>()).await
    }

    /// lossless-claw's own record, read from its stopped replicas: each
    /// acknowledged turn of a session once on one replica, no turn twice on
    /// any (a replica a session left keeps what it had then).
    async fn lossless_record(&mut self) -> R<()> {
        let ids = self.stack.ids(self.profile.service).await?;
        self.say(&format!("stopping the {} replicas to read their databases", ids.len()));
        self.stack.compose(&["stop", "-t", "20", self.profile.service]).await?;
        let dir = std::path::Path::new("target/chaos-lossless");
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let mut held: Vec<(String, Vec<String>)> = Vec::new();
        for id in &ids {
            let to = dir.join(&id[..12]);
            self.stack.docker(&["cp", &format!("{id}:/state"), to.to_str().ok_or("path")?]).await?;
            let db = to.join("lcm.db");
            let texts = (|| -> rusqlite::Result<Vec<String>> {
                let c = rusqlite::Connection::open(&db)?;
                let mut q = c.prepare("SELECT content FROM messages WHERE role = 'user'")?;
                q.query_map([], |r| r.get(0))?.collect()
            })()
            .map_err(|e| format!("{}: {e}", db.display()))?;
            held.push((id[..12].to_owned(), texts));
        }
        let acked = self.tally.lock().unwrap_or_else(|e| e.into_inner()).acked.clone();
        let (mut complete, mut sessions) = (0, 0);
        for (key, texts) in &acked {
            sessions += 1;
            let counts: Vec<Vec<usize>> = held
                .iter()
                .map(|(_, h)| texts.iter().map(|t| h.iter().filter(|m| *m == t).count()).collect())
                .collect();
            for ((replica, _), c) in held.iter().zip(&counts) {
                for (t, n) in texts.iter().zip(c) {
                    self.check(*n <= 1, format!("{key}: replica {replica} holds {t:?} {n} times"));
                }
            }
            if counts.iter().any(|c| c.iter().all(|n| *n == 1)) {
                complete += 1;
            } else {
                let best = counts.iter().map(|c| c.iter().filter(|n| **n == 1).count()).max().unwrap_or(0);
                self.check(
                    false,
                    format!("{key}: no replica holds all {} acknowledged turns (at most {best})", texts.len()),
                );
            }
        }
        let total: usize = held.iter().map(|(_, h)| h.len()).sum();
        self.say(&format!(
            "lossless-claw's databases: {total} user messages over {} replicas; {complete} of {sessions} sessions held whole, once, on one replica",
            held.len()
        ));
        Ok(())
    }

    /// Every acknowledged turn's message, once, in its session.
    async fn verify(&mut self) {
        let acked = self.tally.lock().unwrap_or_else(|e| e.into_inner()).acked.clone();
        for (key, texts) in acked {
            let mut seen = Vec::new();
            let mut token = String::new();
            loop {
                let req =
                    api::GetTranscriptRequest { session: sref(&key), page_token: token.clone(), ..Default::default() };
                let mut req = tonic::Request::new(req);
                req.set_timeout(CALL_LIMIT);
                let page = match self.client.get_transcript(req).await {
                    Ok(p) => p.into_inner(),
                    Err(s) => {
                        self.check(false, format!("{key}: transcript unreadable: {}", s.message()));
                        break;
                    }
                };
                for e in page.entries {
                    if let Some(Entry::Message(m)) = e.entry {
                        seen.push(ctxgate::provider::message_text(&m));
                    }
                }
                if page.next_page_token.is_empty() {
                    break;
                }
                token = page.next_page_token;
            }
            for t in &texts {
                let n = seen.iter().filter(|s| *s == t).count();
                self.check(n == 1, format!("{key}: acknowledged {t:?} is in the transcript {n} times"));
            }
        }
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let profile: &'static Profile = match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        [] | ["--profile", "default"] => &DEFAULT,
        ["--profile", "openclaw"] => &OPENCLAW,
        _ => {
            eprintln!("usage: chaos [--profile default|openclaw]");
            return ExitCode::from(2);
        }
    };
    let client = match connect(profile.gateway).await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("chaos: {e} (is the stack up? `.ci/images up`)");
            return ExitCode::FAILURE;
        }
    };
    let tally = Arc::new(Mutex::new(Tally::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let mut run = Run {
        profile,
        stack: Stack::new(profile.compose_flags).await,
        client,
        tally: tally.clone(),
        violations: Vec::new(),
        started: Instant::now(),
    };
    let secrets = async {
        run.mounts().await?;
        if profile.entry == OPENCLAW.entry { run.plugin_reach().await } else { Ok(()) }
    };
    if let Err(e) = secrets.await {
        run.check(false, e);
    }
    let id = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let workers: Vec<_> =
        (0..WORKERS).map(|w| tokio::spawn(worker(profile.gateway, id, w, tally.clone(), stop.clone()))).collect();
    if let Err(e) = run.scenario().await {
        run.check(false, e);
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        let _ = tokio::time::timeout(TURN_LIMIT, w).await;
    }
    run.verify().await;
    let unclear = {
        let t = tally.lock().unwrap_or_else(|e| e.into_inner());
        let acked: usize = t.acked.values().map(Vec::len).sum();
        println!("turns acknowledged: {acked} (by engine: {:?})", t.by_engine);
        println!("turns failed with a status: {}", t.failed.values().sum::<u64>());
        for (what, n) in &t.failed {
            println!("  {n} × {what}");
        }
        t.unclear.clone()
    };
    for u in &unclear {
        run.check(false, format!("unclear: {u}"));
    }
    if profile.delta {
        match resyncs(profile.metrics, profile.entry).await {
            Ok(n) => println!("resyncs (IngestBatch calls) since the gateway's restart: {n}"),
            Err(e) => println!("resyncs (IngestBatch calls) since the gateway's restart: unknown ({e})"),
        }
    }
    if profile.entry == OPENCLAW.entry
        && let Err(e) = run.lossless_record().await
    {
        run.check(false, e);
    }
    if run.violations.is_empty() {
        println!("chaos: every turn answered or failed with a clear status; nothing acknowledged was lost");
        ExitCode::SUCCESS
    } else {
        println!("chaos: {} violation(s)", run.violations.len());
        ExitCode::FAILURE
    }
}
