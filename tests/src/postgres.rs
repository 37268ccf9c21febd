//! A PostgreSQL server of the test's own: a fresh cluster in a temporary
//! directory on a free loopback port, stopped (and removed) when dropped.
//! PostgreSQL refuses to run as root, so as root the cluster is made and
//! run as the `postgres` user (the Debian package creates it).

use std::os::unix::fs::chown;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::proc_stat::proc_stat;

pub struct Postgres {
    child: Child,
    port: u16,
    /// The CA that signed the server's certificate, when it speaks TLS.
    cert: Option<PathBuf>,
    _dir: tempfile::TempDir,
}

/// Where the server binaries are: `CTXGATE_PG_BIN`, else Debian's
/// `/usr/lib/postgresql/<version>/bin` (the newest).
fn bin_dir() -> PathBuf {
    if let Ok(d) = std::env::var("CTXGATE_PG_BIN") {
        return d.into();
    }
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.path().join("bin")).filter(|p| p.join("initdb").exists()).collect())
        .unwrap_or_default();
    versions.sort();
    versions.pop().unwrap_or_else(|| {
        panic!(
            "PostgreSQL server binaries not found (initdb); install postgresql-15 (.ci/run does) or set CTXGATE_PG_BIN"
        )
    })
}

/// (uid, gid) of the `postgres` user, when running as root.
fn run_as() -> Option<(u32, u32)> {
    let me = std::fs::read_to_string("/proc/self/status").ok()?;
    let uid_line = me.lines().find(|l| l.starts_with("Uid:"))?;
    if uid_line.split_whitespace().nth(1)? != "0" {
        return None;
    }
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    let fields: Vec<&str> = passwd.lines().find(|l| l.starts_with("postgres:"))?.split(':').collect();
    Some((fields.get(2)?.parse().ok()?, fields.get(3)?.parse().ok()?))
}

fn command(bin: &Path, user: Option<(u32, u32)>) -> Command {
    let mut c = Command::new(bin);
    if let Some((uid, gid)) = user {
        c.uid(uid).gid(gid);
    }
    c.env("LC_ALL", "C").stdin(Stdio::null());
    c
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("a free port")
}

impl Postgres {
    /// A new cluster, started and accepting connections. `durable`: keep
    /// PostgreSQL's fsync on (benchmarks); tests turn it off for speed.
    pub async fn start(durable: bool) -> Self {
        Self::start_with(durable, false).await
    }

    /// A cluster that also accepts TLS, with a certificate for `localhost`
    /// and 127.0.0.1 signed by a CA of its own ([`Postgres::cert`]), made
    /// by `openssl`.
    pub async fn start_tls() -> Self {
        Self::start_with(false, true).await
    }

    /// The CA certificate (PEM) of a TLS cluster.
    pub fn cert(&self) -> Option<&Path> {
        self.cert.as_deref()
    }

    async fn start_with(durable: bool, tls: bool) -> Self {
        let bin = bin_dir();
        let user = run_as();
        let dir = tempfile::tempdir().expect("a temporary directory");
        if let Some((uid, gid)) = user {
            chown(dir.path(), Some(uid), Some(gid)).expect("chown the cluster directory to postgres");
        }
        let data = dir.path().join("data");
        let (data_arg, sock) = (data.display().to_string(), dir.path().display().to_string());
        let out = command(&bin.join("initdb"), user)
            .args(["-D", &data_arg, "-U", "postgres", "-A", "trust", "-E", "UTF8", "--locale=C"])
            .arg("--no-sync")
            .output()
            .expect("initdb runs");
        assert!(out.status.success(), "initdb failed: {}", String::from_utf8_lossy(&out.stderr));
        let (mut ssl, mut cert) = (Vec::new(), None);
        if tls {
            let d = dir.path();
            let (crt, key) = (d.join("server.crt"), d.join("server.key"));
            std::fs::write(
                d.join("server.ext"),
                "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n",
            )
            .expect("write the extensions");
            // A CA, and a server certificate it signs (a self-signed CA
            // cannot be the server's own certificate under webpki).
            let openssl = |args: &[&str]| {
                let out = Command::new("openssl").current_dir(d).args(args).output().expect("openssl runs");
                assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
            };
            let ca = "req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=ctxgate-test-ca -keyout ca.key -out ca.crt";
            let csr = "req -newkey rsa:2048 -nodes -subj /CN=localhost -keyout server.key -out server.csr";
            let sign = "x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 1 \
                        -extfile server.ext -out server.crt";
            for step in [ca, csr, sign] {
                openssl(&step.split_whitespace().collect::<Vec<_>>());
            }
            for f in [&crt, &key] {
                if let Some((uid, gid)) = user {
                    chown(f, Some(uid), Some(gid)).expect("chown the certificate to postgres");
                }
            }
            std::fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o600)).expect("chmod the key");
            ssl = vec![
                "-c".to_owned(),
                "ssl=on".to_owned(),
                "-c".to_owned(),
                format!("ssl_cert_file={}", crt.display()),
                "-c".to_owned(),
                format!("ssl_key_file={}", key.display()),
            ];
            cert = Some(d.join("ca.crt"));
        }
        let port = free_port();
        let sync = if durable { "on" } else { "off" };
        let log = std::fs::File::create(dir.path().join("postgres.log")).expect("a log file");
        if let Some((uid, gid)) = user {
            chown(dir.path().join("postgres.log"), Some(uid), Some(gid)).expect("chown the log");
        }
        let child = command(&bin.join("postgres"), user)
            .args(["-D", &data_arg, "-p", &port.to_string(), "-k", &sock])
            .args(["-c", "listen_addresses=127.0.0.1", "-c", &format!("fsync={sync}")])
            .args(["-c", &format!("synchronous_commit={sync}"), "-c", "max_connections=300"])
            // Benchmarks count what a turn costs the server (`work`).
            .args(if durable { &["-c", "shared_preload_libraries=pg_stat_statements"][..] } else { &[] })
            .args(&ssl)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("postgres starts");
        let pg = Self { child, port, cert, _dir: dir };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match tokio_postgres::connect(&pg.url("postgres"), tokio_postgres::NoTls).await {
                Ok(_) => break,
                Err(e) => {
                    assert!(Instant::now() < deadline, "PostgreSQL did not accept connections in 30 s: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
        pg
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The URL of database `db` on this server.
    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }

    /// Creates database `name`; its URL.
    pub async fn database(&self, name: &str) -> String {
        self.sql("postgres", &format!("CREATE DATABASE \"{name}\"")).await;
        self.url(name)
    }

    /// Runs `sql` in database `db`.
    pub async fn sql(&self, db: &str, sql: &str) {
        let (client, conn) = tokio_postgres::connect(&self.url(db), tokio_postgres::NoTls).await.expect("connect");
        let conn = tokio::spawn(conn);
        client.batch_execute(sql).await.unwrap_or_else(|e| panic!("{sql}: {e:?}"));
        drop(client);
        let _ = conn.await;
    }

    /// What the server has done so far for database `db` (a durable
    /// cluster's only: it needs `pg_stat_statements`): statements run,
    /// transactions committed, and (cluster-wide) WAL flushes and the CPU
    /// time of all its processes. PostgreSQL publishes commits and flushes
    /// about once a second, so a caller waits that long after the work it
    /// measures.
    pub async fn work(&self, db: &str) -> Work {
        self.sql(db, "CREATE EXTENSION IF NOT EXISTS pg_stat_statements").await;
        let count = |sql: String| async move { self.count(db, &sql).await };
        Work {
            statements: count(format!(
                "SELECT COALESCE(sum(s.calls), 0)::bigint FROM pg_stat_statements s
                   JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = '{db}'"
            ))
            .await,
            commits: count(format!("SELECT xact_commit FROM pg_stat_database WHERE datname = '{db}'")).await,
            wal_flushes: count("SELECT wal_sync FROM pg_stat_wal".into()).await,
            cpu: self.cpu(),
        }
    }

    /// CPU time (user + system) the server has used: the postmaster, its
    /// live children (backends, WAL writer, checkpointer…) and the exited
    /// children it has reaped.
    fn cpu(&self) -> Duration {
        let postmaster = self.child.id();
        let mut used = proc_stat(postmaster).map_or(Duration::ZERO, |p| p.cpu() + p.reaped());
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
            if let Some(child) = proc_stat(pid).filter(|p| p.ppid() == Some(postmaster)) {
                used += child.cpu();
            }
        }
        used
    }

    /// How often each statement ran in database `db` so far, and the
    /// milliseconds it took to run (normalized text, as
    /// `pg_stat_statements` keeps it); subtract two readings to see what a
    /// piece of work ran.
    pub async fn statement_calls(&self, db: &str) -> std::collections::HashMap<String, (i64, f64)> {
        self.sql(db, "CREATE EXTENSION IF NOT EXISTS pg_stat_statements").await;
        let sql = format!(
            "SELECT s.query, sum(s.calls)::bigint, sum(s.total_exec_time)::float8 FROM pg_stat_statements s
               JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = '{db}' GROUP BY s.query"
        );
        self.rows(db, &sql).await.iter().map(|r| (r.get(0), (r.get(1), r.get(2)))).collect()
    }

    /// The first column of the first row of `sql` in database `db`, as i64.
    pub async fn count(&self, db: &str, sql: &str) -> i64 {
        self.rows(db, sql).await.first().unwrap_or_else(|| panic!("{sql}: no row")).get(0)
    }

    /// The rows of `sql` in database `db`, on a connection of its own.
    async fn rows(&self, db: &str, sql: &str) -> Vec<tokio_postgres::Row> {
        let (client, conn) = tokio_postgres::connect(&self.url(db), tokio_postgres::NoTls).await.expect("connect");
        let conn = tokio::spawn(conn);
        let rows = client.query(sql, &[]).await.unwrap_or_else(|e| panic!("{sql}: {e:?}"));
        drop(client);
        let _ = conn.await;
        rows
    }
}

/// Counters of a server's work ([`Postgres::work`]); subtract two to get
/// what happened between them.
#[derive(Debug, Clone, Copy, Default)]
pub struct Work {
    pub statements: i64,
    pub commits: i64,
    pub wal_flushes: i64,
    pub cpu: Duration,
}

impl std::ops::Sub for Work {
    type Output = Self;
    fn sub(self, o: Self) -> Self {
        Self {
            statements: self.statements - o.statements,
            commits: self.commits - o.commits,
            wal_flushes: self.wal_flushes - o.wal_flushes,
            cpu: self.cpu.saturating_sub(o.cpu),
        }
    }
}

/// `store` settings for a test's PostgresStore: `pool` connections,
/// `ca` to trust for TLS.
pub fn pg_options(pool: usize, ca: Option<&Path>) -> ctxgate::config::StoreSection {
    ctxgate::config::StoreSection { pool_size: pool, ca_file: ca.map(Path::to_path_buf), ..Default::default() }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        // SIGINT: fast shutdown (no waiting for clients); then make sure.
        let _ = Command::new("kill").args(["-INT", &self.child.id().to_string()]).status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
