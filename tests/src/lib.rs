//! Helpers for the workspace integration tests: start real engine
//! processes, find the workspace's binaries.

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
    // target/<profile>/deps/<test> -> target/<profile>/<name>
    let path = exe.parent().and_then(Path::parent).expect("test binary lives in target/<profile>/deps").join(name);
    assert!(path.exists(), "{} is not built: run `cargo build --workspace --bins` first", path.display());
    path
}

/// An engine running as its own process, killed when dropped.
pub struct EngineProcess {
    child: Child,
    /// What the engine printed after `listening on`, as a client endpoint.
    pub endpoint: String,
}

/// How long an engine may take to print `listening on` (the Python engine
/// creates its venv on first start).
const START_TIMEOUT: Duration = Duration::from_secs(600);

impl EngineProcess {
    pub async fn start(program: impl AsRef<Path>, args: &[&str]) -> std::io::Result<Self> {
        let mut child = Command::new(program.as_ref())
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()?;
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
        // Anything else the engine prints goes nowhere (it must print nothing).
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(Self { child, endpoint })
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
