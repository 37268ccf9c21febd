//! The shared store: PostgreSQL, for several gateways on one state
//! (`store.url: postgres://…`). Same trait and semantics as SQLite; what
//! differs is that no gateway owns the data:
//!
//! - **Session leases** (`session_leases`): a turn claims its session
//!   (owner, expiry on the server's clock, a fencing token that grows with
//!   every claim) and renews it while it runs. Every write of a session
//!   this gateway holds checks, in its own transaction and under a share
//!   lock on the lease row, that the token is still the current one and
//!   this gateway its owner: a gateway that lost its lease (paused,
//!   partitioned, slow) gets [`StoreError::Fenced`] and writes nothing.
//!   Lease statements are not flushed (see `open`); the owner is what
//!   tells two holders apart if a server crash lost a claim and its token
//!   came again (the schema's comment that tokens only grow predates this).
//! - **Abandoned turns**: a gateway that dies leaves its open turn and its
//!   lease; once the lease has expired, the next claim of the session (or
//!   the recovery pass, through a claim) rewinds the turn as an abort, in a
//!   transaction fenced by the new claim's token. Nothing is rewound at
//!   start: other gateways are running.
//! - **Locks never outlive a lease**: connections carry `lock_timeout` and
//!   `idle_in_transaction_session_timeout` of one lease, so a gateway
//!   paused inside a write cannot hold the lease row past its expiry.
//! - **The outbox**: a pass claims the due heads of queues with `FOR
//!   UPDATE SKIP LOCKED` (picked for a few seconds), so gateways' passes
//!   split them; a delivery runs under the session's lease and the engine
//!   deduplicates by advancement key, so each turn reaches the engine's
//!   record once.
//! - **The visible-tail cache** (`store/tails.rs`) is this gateway's; a
//!   read walks from the leaf to the cached tail's leaf, so another
//!   gateway's appends are read, and only they.
//!
//! Each write is one transaction (a claim that finds a turn left open is
//! two: the claim, then the fenced rewind); the schema is versioned
//! (`ctxgate_schema`) and migrated at start under an advisory lock, so
//! gateways starting together migrate once.
//!
//! Here: the store, its connection pools (TLS, timeouts) and statement
//! helpers. `schema.rs` holds the migrations, `claims.rs` the session
//! leases and the fencing check every write runs; the roles are
//! implemented by what they touch: `sessions.rs` (sessions, subagents),
//! `transcript.rs` (the transcript tree, turns, cursors) and `outbox.rs`
//! (the outbox, engine records).

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use deadpool_postgres::{GenericClient, Manager, ManagerConfig, Pool, RecyclingMethod, Transaction};
use tokio_postgres::Row;
use tokio_postgres::config::SslMode;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;

use super::tails::Tails;
use super::{OpenError, StoreError};

mod claims;
mod outbox;
mod schema;
mod sessions;
mod transcript;

pub use schema::SCHEMA_VERSION;
pub use transcript::WALKS;

impl From<tokio_postgres::Error> for StoreError {
    fn from(e: tokio_postgres::Error) -> Self {
        let detail = match e.as_db_error() {
            Some(db) => format!("PostgreSQL: {} ({})", db.message(), db.code().code()),
            None => format!("PostgreSQL: {}", crate::causes(&e)),
        };
        let transient = [
            SqlState::T_R_SERIALIZATION_FAILURE,
            SqlState::T_R_DEADLOCK_DETECTED,
            SqlState::LOCK_NOT_AVAILABLE,
            SqlState::QUERY_CANCELED,
            SqlState::TOO_MANY_CONNECTIONS,
            SqlState::ADMIN_SHUTDOWN,
            SqlState::CRASH_SHUTDOWN,
            SqlState::CANNOT_CONNECT_NOW,
            SqlState::IDLE_IN_TRANSACTION_SESSION_TIMEOUT,
        ];
        match e.code() {
            Some(c) if *c == SqlState::DISK_FULL => Self::Full(detail),
            Some(c) if *c == SqlState::FOREIGN_KEY_VIOLATION => Self::NoSession(detail),
            Some(c) if transient.contains(c) => Self::Unavailable(detail),
            // No SQLSTATE: the connection broke, or never came up.
            None => Self::Unavailable(detail),
            _ => Self::Backend(detail),
        }
    }
}

impl From<deadpool_postgres::PoolError> for StoreError {
    fn from(e: deadpool_postgres::PoolError) -> Self {
        match e {
            deadpool_postgres::PoolError::Backend(e) => e.into(),
            // Every connection busy for the pool's whole wait, or none can be made.
            other => Self::Unavailable(format!("PostgreSQL connection pool: {other}")),
        }
    }
}

/// The PostgreSQL store.
pub struct PostgresStore {
    pool: Pool,
    /// Lease claims only (commits not flushed: see `open`).
    claims: Pool,
    /// Lease renewals and releases only (commits not flushed).
    renewals: Pool,
    /// This gateway's name in lease rows (host, process, a random part).
    owner: String,
    /// Sessions this gateway holds, with their fencing tokens.
    held: Mutex<HashMap<String, i64>>,
    /// The last visible tail this gateway read per session
    /// (`store.tailCacheMiB`).
    tails: Mutex<Tails>,
    counts: crate::metrics::StoreCounters,
}

/// `store.url` without its password (or user), for messages and logs.
pub fn redacted(url: &str) -> String {
    match url.parse::<tokio_postgres::Config>() {
        Ok(c) => {
            let hosts: Vec<String> = c
                .get_hosts()
                .iter()
                .map(|h| match h {
                    tokio_postgres::config::Host::Tcp(h) => h.clone(),
                    tokio_postgres::config::Host::Unix(p) => p.display().to_string(),
                })
                .collect();
            let port = c.get_ports().first().copied().unwrap_or(5432);
            format!("postgres://{}:{port}/{}", hosts.join(","), c.get_dbname().unwrap_or(""))
        }
        Err(_) => "the configured store.url".into(),
    }
}

/// rustls (ring) trusting `ca_file`'s certificates, or the public roots.
fn tls_connector(ca_file: Option<&Path>) -> Result<tokio_postgres_rustls::MakeRustlsConnect, String> {
    use rustls::pki_types::{CertificateDer, pem::PemObject};
    let mut roots = rustls::RootCertStore::empty();
    match ca_file {
        None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
        Some(path) => {
            let shown = path.display();
            let certs = CertificateDer::pem_file_iter(path)
                .map_err(|e| format!("store.caFile {shown} cannot be read: {e}"))?
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("store.caFile {shown} is not PEM certificates: {e}"))?;
            let (added, _) = roots.add_parsable_certificates(certs);
            if added == 0 {
                return Err(format!("store.caFile {shown} holds no usable certificate"));
            }
        }
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(tokio_postgres_rustls::MakeRustlsConnect::new(config))
}

/// A connection error as the operator needs it.
fn connect_error(url: &str, e: &tokio_postgres::Error) -> OpenError {
    let at = redacted(url);
    let detail = match e.as_db_error() {
        Some(db) => db.message().to_owned(),
        None => crate::causes(e),
    };
    OpenError::Other { file: at, detail: format!("cannot connect to PostgreSQL: {detail}") }
}

/// Whether every host of `config` is this machine (loopback or a unix
/// socket): plaintext there crosses no network.
fn local_only(config: &tokio_postgres::Config) -> bool {
    use tokio_postgres::config::Host;
    // `hostaddr` is where the driver connects when given, whatever `host` says.
    config.get_hostaddrs().iter().all(std::net::IpAddr::is_loopback)
        && config.get_hosts().iter().all(|h| match h {
            Host::Tcp(name) => name == "localhost" || name.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback()),
            Host::Unix(_) => true,
        })
}

impl PostgresStore {
    /// Connects to `url`, migrates the schema and checks it is not newer
    /// than this build; fails with a sentence (before any port is bound).
    /// TLS only when the URL says `sslmode=require`, and then verified (the
    /// server's name and chain, against `ca_file` or the public roots);
    /// otherwise plaintext (`prefer` does not mean an unverified TLS).
    pub async fn open(url: &str, opts: &crate::config::StoreSection) -> Result<Self, OpenError> {
        let mut config: tokio_postgres::Config = url.parse().map_err(|e| OpenError::Other {
            file: "store.url".into(),
            detail: format!("not a PostgreSQL URL ({e}); expected postgres://user[:password]@host[:port]/database"),
        })?;
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(Duration::from_secs(5));
        }
        // Unset reads as `prefer` (explicit `prefer` is refused with the
        // config): plaintext, said once unless the server is on this host.
        if config.get_ssl_mode() == SslMode::Prefer {
            config.ssl_mode(SslMode::Disable);
        }
        if config.get_ssl_mode() == SslMode::Disable && !local_only(&config) {
            tracing::warn!(
                store = %redacted(url),
                "the connection to PostgreSQL is plaintext (no sslmode=require in store.url): passwords and transcripts cross the network readable"
            );
        }
        // No lock or open transaction outlives a lease: a gateway paused
        // or cut off inside a write would otherwise hold the lease row (and
        // so every takeover) until the server noticed the dead connection.
        let lease_ms = opts.lease().as_millis();
        let mut options = config.get_options().unwrap_or("").to_owned();
        options.push_str(&format!(
            " -c lock_timeout={lease_ms} -c idle_in_transaction_session_timeout={lease_ms} -c statement_timeout={}",
            lease_ms.max(30_000)
        ));
        let options = options.trim().to_owned();
        config.options(&options);
        let tls = tls_connector(opts.ca_file.as_deref())
            .map_err(|detail| OpenError::Other { file: redacted(url), detail })?;
        let pool = |size: usize, unflushed: bool| {
            let mut config = config.clone();
            if unflushed {
                config.options(format!("{options} -c synchronous_commit=off").trim());
            }
            let manager =
                Manager::from_config(config, tls.clone(), ManagerConfig { recycling_method: RecyclingMethod::Fast });
            Pool::builder(manager)
                .max_size(size)
                .runtime(deadpool_postgres::Runtime::Tokio1)
                .wait_timeout(Some(Duration::from_secs(10)))
                .create_timeout(Some(Duration::from_secs(5)))
                .build()
                .map_err(|e| OpenError::Other { file: redacted(url), detail: e.to_string() })
        };
        // Lease statements get connections of their own, renewals and
        // releases apart from claims: neither a busy pool nor claims
        // waiting on another gateway's locked lease rows may let leases
        // lapse under the turns that hold them. Their commits skip the WAL
        // flush (two fewer per turn; other gateways see them at once). A
        // renewal or release lost in a server crash costs liveness only —
        // a lease that lapses early or lingers to its expiry. A claim lost
        // so hands its token out again, so the fencing check compares the
        // owner too: a gateway whose claim was lost can write nothing under
        // another's lease. Any flushed write after a claim (the turn's
        // open) flushes the claim with it: a turn left open always has its
        // claim on disk.
        let main = pool(opts.pool_size.max(1), false)?;
        let (claims, renewals) = (pool(8, true)?, pool(4, true)?);
        let mut client = main.get().await.map_err(|e| match e {
            deadpool_postgres::PoolError::Backend(e) => connect_error(url, &e),
            other => OpenError::Other { file: redacted(url), detail: format!("cannot connect to PostgreSQL: {other}") },
        })?;
        schema::migrate(&mut client, url).await?;
        drop(client);
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        // Random, not a time-ordered id: gateways started in the same
        // minute (pid 1 in containers) must not share an owner.
        let nonce = uuid::Uuid::new_v4().simple().to_string();
        let owner = format!("{}/{}/{}", host.trim(), std::process::id(), &nonce[..8]);
        Ok(Self {
            pool: main,
            claims,
            renewals,
            owner,
            held: Mutex::default(),
            tails: Mutex::new(Tails::with_mib(opts.tail_cache_mib)),
            counts: crate::metrics::StoreCounters::default(),
        })
    }

    /// Write transactions committed, for the metrics endpoint (a write
    /// transaction holds one write: the counts stay equal; single-statement
    /// writes outside a turn are not counted).
    pub fn counters(&self) -> crate::metrics::StoreCounters {
        self.counts.clone()
    }

    async fn client(&self) -> Result<deadpool_postgres::Object, StoreError> {
        Ok(self.pool.get().await?)
    }

    async fn commit(&self, tx: Transaction<'_>) -> Result<(), StoreError> {
        tx.commit().await?;
        self.counts.commits.inc();
        self.counts.writes.inc();
        Ok(())
    }
}

/// Statements by their text, prepared once per connection (deadpool keeps
/// them): one round trip per statement instead of two.
async fn q<C: GenericClient>(c: &C, sql: &str, p: &[&(dyn ToSql + Sync)]) -> Result<Vec<Row>, StoreError> {
    let st = c.prepare_cached(sql).await?;
    Ok(c.query(&st, p).await?)
}

async fn q_opt<C: GenericClient>(c: &C, sql: &str, p: &[&(dyn ToSql + Sync)]) -> Result<Option<Row>, StoreError> {
    let st = c.prepare_cached(sql).await?;
    Ok(c.query_opt(&st, p).await?)
}

async fn q_one<C: GenericClient>(c: &C, sql: &str, p: &[&(dyn ToSql + Sync)]) -> Result<Row, StoreError> {
    let st = c.prepare_cached(sql).await?;
    Ok(c.query_one(&st, p).await?)
}

/// Prepares a pipeline's statements (once per connection) before it is
/// sent. An unprepared statement sends its Parse and its execution only
/// once that is answered, behind the statements joined after it; the
/// first of a pipeline takes the locks the rest rely on (the fencing
/// check, the session's head), so it must go out first. And a Parse still
/// in flight when its pipeline failed would be dropped unanswered, its
/// statement left prepared on the server until the connection closed.
/// Every Parse is answered before this returns (`join_all`, not a
/// `try_join` that would drop the rest at the first error), unless the
/// caller's own future is dropped meanwhile (a cancelled request).
async fn prepare_pipeline<'a, C: GenericClient>(
    c: &C,
    statements: impl IntoIterator<Item = &'a str>,
) -> Result<(), StoreError> {
    for prepared in futures_util::future::join_all(statements.into_iter().map(|sql| c.prepare_cached(sql))).await {
        prepared?;
    }
    Ok(())
}

async fn exec<C: GenericClient>(c: &C, sql: &str, p: &[&(dyn ToSql + Sync)]) -> Result<u64, StoreError> {
    let st = c.prepare_cached(sql).await?;
    Ok(c.execute(&st, p).await?)
}

fn millis(d: Duration) -> f64 {
    d.as_millis() as f64
}

#[cfg(test)]
mod tests {
    use super::local_only;

    #[test]
    fn a_server_is_local_only_when_every_address_the_driver_may_use_is() {
        let local = |url: &str| local_only(&url.parse().unwrap());
        assert!(local("postgres://u@localhost/db"));
        assert!(local("postgres://u@127.0.0.1,[::1]/db"));
        assert!(local("postgres://u@localhost/db?hostaddr=127.0.0.1"));
        assert!(!local("postgres://u@db.example.com/db"));
        // `host` names the loopback, `hostaddr` sends the connection elsewhere.
        assert!(!local("postgres://u@localhost/db?hostaddr=203.0.113.5"));
    }
}
