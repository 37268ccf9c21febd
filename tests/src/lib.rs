//! Helpers for the workspace integration tests: start real engine and
//! gateway processes or an in-process gateway, find the workspace's
//! binaries, and a local OpenAI-compatible model server.

pub mod certs;
pub mod fake_openai;
pub mod harness;
pub mod hosting;
pub mod postgres;
pub mod proc_stat;

use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// The workspace root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ has a parent").to_path_buf()
}

/// A binary of this workspace, built next to the running test
/// (`cargo build --workspace --bins` builds them all).
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current test executable");
    // target/<profile>/deps/<test> or target/<profile>/<bin> -> target/<profile>/<name>
    let dir = exe.parent().expect("an executable has a directory");
    let dir = if dir.file_name().is_some_and(|n| n == "deps") { dir.parent().unwrap_or(dir) } else { dir };
    let path = dir.join(name);
    assert!(path.exists(), "{} is not built: run `cargo build --workspace --bins` first", path.display());
    path
}

/// An engine running as its own process, killed when dropped.
pub struct EngineProcess {
    child: Child,
    /// What the engine printed after `listening on`, as a client endpoint.
    pub endpoint: String,
    /// Every later stdout line (fixtures report events there).
    lines: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    line_added: std::sync::Arc<tokio::sync::Notify>,
}

/// How long an engine may take to print `listening on` (the Python engine
/// creates its venv on first start).
const START_TIMEOUT: Duration = Duration::from_secs(600);

impl EngineProcess {
    pub async fn start(program: impl AsRef<Path>, args: &[&str]) -> std::io::Result<Self> {
        let mut cmd = Command::new(program.as_ref());
        cmd.args(args);
        Self::spawn(cmd).await
    }

    /// [`EngineProcess::start`] for a command with more set (environment).
    pub async fn spawn(cmd: Command) -> std::io::Result<Self> {
        Self::spawn_logging_to(cmd, Stdio::inherit()).await
    }

    /// [`EngineProcess::spawn`] with its stderr (its log) sent to `log`.
    pub async fn spawn_logging_to(mut cmd: Command, log: Stdio) -> std::io::Result<Self> {
        let mut child = cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(log).kill_on_drop(true).spawn()?;
        let stdout = child.stdout.take().expect("stdout is piped");
        let mut lines = BufReader::new(stdout).lines();
        let line = tokio::time::timeout(START_TIMEOUT, lines.next_line())
            .await
            .map_err(|_| std::io::Error::other("engine did not print `listening on` in time"))??
            .ok_or_else(|| std::io::Error::other("engine exited before printing `listening on`"))?;
        let addr = line
            .strip_prefix("listening on ")
            .ok_or_else(|| std::io::Error::other(format!("unexpected first line {line:?}")))?;
        let endpoint = if addr.starts_with("unix://") { addr.to_owned() } else { format!("http://{addr}") };
        let (store, added) = (
            std::sync::Arc::<std::sync::Mutex<Vec<String>>>::default(),
            std::sync::Arc::new(tokio::sync::Notify::new()),
        );
        let (s, a) = (store.clone(), added.clone());
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                s.lock().unwrap_or_else(|e| e.into_inner()).push(line);
                a.notify_waiters();
            }
        });
        Ok(Self { child, endpoint, lines: store, line_added: added })
    }

    /// Every later stdout line so far that starts with `prefix`.
    pub fn lines_starting(&self, prefix: &str) -> Vec<String> {
        self.lines.lock().unwrap_or_else(|e| e.into_inner()).iter().filter(|l| l.starts_with(prefix)).cloned().collect()
    }

    /// The first later stdout line starting with `prefix`, waiting up to
    /// `within` for it.
    pub async fn wait_line(&self, prefix: &str, within: Duration) -> Option<String> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let added = self.line_added.notified();
            if let Some(l) = self.lines.lock().unwrap_or_else(|e| e.into_inner()).iter().find(|l| l.starts_with(prefix))
            {
                return Some(l.clone());
            }
            if tokio::time::timeout_at(deadline, added).await.is_err() {
                return None;
            }
        }
    }

    /// The later stdout lines starting with `prefix` once there are at
    /// least `n` of them, waiting up to `within`; `None` if they never come.
    pub async fn wait_lines(&self, prefix: &str, n: usize, within: Duration) -> Option<Vec<String>> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let added = self.line_added.notified();
            let lines = self.lines_starting(prefix);
            if lines.len() >= n {
                return Some(lines);
            }
            if tokio::time::timeout_at(deadline, added).await.is_err() {
                return None;
            }
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id().expect("the engine is running")
    }

    /// Sends `signal` (e.g. "TERM", "KILL") and waits for the process to exit.
    pub async fn signal_and_wait(mut self, signal: &str) -> std::io::Result<ExitStatus> {
        let status = Command::new("kill").arg(format!("-{signal}")).arg(self.pid().to_string()).status().await?;
        assert!(status.success(), "kill -{signal} failed");
        self.child.wait().await
    }
}

/// The window engine binary with its state in `state_dir`.
pub async fn start_window(state_dir: &Path, extra: &[&str]) -> EngineProcess {
    let dir = state_dir.to_str().expect("utf-8 temp dir");
    let mut args = vec!["--listen", "127.0.0.1:0", "--state-dir", dir];
    args.extend_from_slice(extra);
    EngineProcess::start(bin("ctxgate-engine-window"), &args).await.expect("window engine starts")
}

/// `ctxgate serve` as a process on loopback, its state in `state` and its
/// config read from `config` when there is one.
pub async fn serve(state: &Path, config: Option<&Path>) -> EngineProcess {
    let dir = state.to_str().expect("utf-8 temp dir");
    let mut args = vec!["serve", "--listen", "127.0.0.1:0", "--state-dir", dir];
    if let Some(c) = config {
        args.extend(["--config", c.to_str().expect("utf-8 temp dir")]);
    }
    EngineProcess::start(bin("ctxgate"), &args).await.expect("ctxgate serve starts")
}

/// Writes `text` to `dir/name` (a config file, a certificate): its path.
pub fn write_file(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("the temp dir takes a file");
    path
}

/// A client of the gateway API at `endpoint`; it connects on first use.
pub fn gateway_client(
    endpoint: &str,
) -> ctxgate_proto::gateway::gateway_client::GatewayClient<tonic::transport::Channel> {
    let channel = tonic::transport::Endpoint::from_shared(endpoint.to_owned()).expect("uri").connect_lazy();
    ctxgate_proto::gateway::gateway_client::GatewayClient::new(channel)
}

/// The Python engine (engines/python/run.sh) with its state in `state_dir`.
pub async fn start_python(state_dir: &Path) -> EngineProcess {
    start_python_with(state_dir, &[]).await
}

/// [`start_python`] with more options (`--tls-cert`, …).
pub async fn start_python_with(state_dir: &Path, extra: &[&str]) -> EngineProcess {
    let dir = state_dir.to_str().expect("utf-8 temp dir");
    let mut args = vec!["--listen", "127.0.0.1:0", "--state-dir", dir];
    args.extend_from_slice(extra);
    EngineProcess::start(repo_root().join("engines/python/run.sh"), &args).await.expect("python engine starts")
}

/// How long a test waits for any one thing the system should do (an answer,
/// an event, a turn's end) before it fails: generous for a loaded machine,
/// short enough that a broken promise is a failure with a name, not a hang.
pub const PATIENCE: Duration = Duration::from_secs(30);

/// `fut`, or a failure naming `what` did not happen within `limit`.
pub async fn within<T>(limit: Duration, what: impl std::fmt::Display, fut: impl std::future::Future<Output = T>) -> T {
    match tokio::time::timeout(limit, fut).await {
        Ok(t) => t,
        Err(_) => panic!("{what} did not happen within {limit:?}"),
    }
}

/// A gateway running in this process (the same `server::run` as the
/// binary), on loopback, with its state in a temp dir.
pub struct TestGateway {
    pub endpoint: String,
    pub client: ctxgate_proto::gateway::gateway_client::GatewayClient<tonic::transport::Channel>,
    pub metrics: Option<std::net::SocketAddr>,
    reloads: tokio::sync::mpsc::Sender<ctxgate::config::Config>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), ctxgate::api::server::ServeError>>,
    _state: tempfile::TempDir,
}

impl TestGateway {
    pub async fn start(mut config: ctxgate::config::Config) -> Self {
        let state = tempfile::tempdir().expect("temp dir");
        config.state_dir = state.path().to_path_buf();
        config.gateway.listen = "127.0.0.1:0".into();
        let listeners = ctxgate::api::server::Listeners::bind(&config).await.expect("bind");
        let addr = listeners.api.local_addr().expect("addr");
        let metrics = listeners.metrics.as_ref().map(|l| l.local_addr().expect("addr"));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (reloads, reload_rx) = tokio::sync::mpsc::channel(1);
        let store = ctxgate::store::open(&config).await.expect("the store opens");
        let task = tokio::spawn(ctxgate::api::server::run_with_reloads(
            config,
            store,
            listeners,
            async {
                let _ = stopped.await;
            },
            reload_rx,
        ));
        let endpoint = format!("http://{addr}");
        let client = gateway_client(&endpoint);
        Self { endpoint, client, metrics, reloads, stop: Some(stop), task, _state: state }
    }

    /// Applies `config` to the engines, as SIGHUP does for `ctxgate serve`.
    pub async fn reload(&self, config: ctxgate::config::Config) {
        self.reloads.send(config).await.expect("the gateway runs");
    }

    /// Waits (bounded: 15 s) until engine `id` is attached and in service.
    pub async fn wait_attached(&self, id: &str) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        loop {
            let s = self.client.clone().get_status(ctxgate_proto::gateway::StatusRequest {}).await.expect("status");
            let s = s.into_inner();
            if s.engines.iter().any(|e| e.id == id && e.quarantine.is_none() && !e.name.is_empty()) {
                return;
            }
            assert!(tokio::time::Instant::now() < deadline, "engine {id} never attached: {s:?}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let _ = (&mut self.task).await;
    }
}

/// Runs a manual Compact of session `key` to its end: the events, and the
/// status that ended the stream if it failed.
pub async fn compact_to_end(
    client: &ctxgate_proto::gateway::gateway_client::GatewayClient<tonic::transport::Channel>,
    key: &str,
) -> (Vec<ctxgate_proto::gateway::CompactionEvent>, Option<tonic::Status>) {
    use tokio_stream::StreamExt;
    let session = Some(ctxgate_proto::gateway::SessionRef { agent_id: String::new(), session_key: key.into() });
    let req = ctxgate_proto::gateway::CompactSessionRequest { session, custom_instructions: None };
    within(PATIENCE, format!("the compaction of {key:?} ending"), async {
        let mut stream = match client.clone().compact(req).await {
            Ok(s) => s.into_inner(),
            Err(status) => return (Vec::new(), Some(status)),
        };
        let mut events = Vec::new();
        while let Some(e) = stream.next().await {
            match e {
                Ok(e) => events.push(e),
                Err(status) => return (events, Some(status)),
            }
        }
        (events, None)
    })
    .await
}

/// `GET /metrics` with a bare HTTP/1.0 request.
pub async fn metrics_text(addr: std::net::SocketAddr) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("metrics endpoint");
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").await.expect("write");
    let mut out = String::new();
    s.read_to_string(&mut out).await.expect("read");
    out
}

/// A counter's value in the Prometheus text (0 when absent).
pub fn counter(metrics: &str, name: &str, labels: &str) -> u64 {
    let key = format!("{name}{{{labels}}} ");
    metrics.lines().find_map(|l| l.strip_prefix(&key)).map_or(0, |v| v.trim().parse().expect("a counter's value"))
}

/// What a test script printed (stdout and stderr) and whether it passed;
/// it gets the conformance kit's path in `CTXGATE_CONFORMANCE`.
pub async fn run_script(script: &str, limit: Duration) -> (bool, String) {
    // `script` is the path, then its arguments (split at spaces).
    let mut words = script.split(' ');
    let run = Command::new(repo_root().join(words.next().unwrap_or_default()))
        .args(words)
        .env("CTXGATE_CONFORMANCE", bin("ctxgate-conformance"))
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(limit, run)
        .await
        .unwrap_or_else(|_| panic!("{script} did not finish within {limit:?}"))
        .unwrap_or_else(|e| panic!("{script} could not run: {e}"));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}
