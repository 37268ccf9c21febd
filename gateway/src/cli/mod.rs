//! The `ctxgate` command line: `serve`, and the client commands that talk
//! to a running gateway (`chat`, `compact`, `sessions`, `status`).

use std::error::Error as _;
use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use ctxgate_proto::gateway::{self as api, gateway_client::GatewayClient};
use ctxgate_proto::pb::transcript_entry::Entry;
use serde_json::json;
use tokio_stream::StreamExt;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::{Code, Request, Status};

use crate::config::Config;
use crate::provider::message_text;
use crate::summarize::role_name;

pub mod doctor;

#[derive(Parser, Debug)]
#[command(name = "ctxgate", version, about = "A gateway that hosts context engines for AI agents")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run the gateway (works with no config file: state in ./ctxgate-state).
    Serve {
        /// A JSON5 config file.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Overrides gateway.listen.
        #[arg(long)]
        listen: Option<String>,
        /// Overrides stateDir.
        #[arg(long)]
        state_dir: Option<PathBuf>,
    },
    /// Talk to an agent: interactive, or one message with -m.
    Chat {
        #[command(flatten)]
        conn: Conn,
        #[command(flatten)]
        session: SessionArg,
        /// Send one message, print the reply, exit.
        #[arg(short, long)]
        message: Option<String>,
    },
    /// Compact a session's history now (/compact).
    Compact {
        #[command(flatten)]
        conn: Conn,
        #[command(flatten)]
        session: SessionArg,
        /// What the summary should focus on.
        #[arg(long)]
        instructions: Option<String>,
    },
    /// List or show sessions.
    Sessions {
        #[command(subcommand)]
        command: SessionsCommand,
    },
    /// Context engines: list them, or lift a quarantine.
    Engines {
        #[command(subcommand)]
        command: EnginesCommand,
    },
    /// Durable-turn commits waiting for their engine: list, retry, drop.
    Outbox {
        #[command(subcommand)]
        command: OutboxCommand,
    },
    /// Check the configured context engine before running: reachable,
    /// contract valid, host requirements met. --fix resets the slot when
    /// no configured host can run the engine.
    Doctor {
        /// The JSON5 config file to check (and, with --fix, to edit).
        #[arg(long)]
        config: Option<PathBuf>,
        #[arg(long)]
        fix: bool,
    },
    /// The gateway's model, engines and sessions.
    Status {
        #[command(flatten)]
        conn: Conn,
        #[arg(long)]
        json: bool,
    },
    /// A grpc.health.v1 check of the gateway: exit 0 when it is SERVING,
    /// 1 otherwise (container health checks: the images have no shell).
    Health {
        #[command(flatten)]
        conn: Conn,
    },
}

#[derive(Subcommand, Debug)]
pub enum SessionsCommand {
    Ls {
        #[command(flatten)]
        conn: Conn,
        /// Include archived sessions.
        #[arg(long)]
        all: bool,
        #[arg(long)]
        json: bool,
    },
    /// A session's visible history, summaries included.
    Show {
        #[command(flatten)]
        conn: Conn,
        /// The session key.
        key: String,
        #[arg(long, default_value = "main")]
        agent: String,
        /// The whole branch, not just the visible history.
        #[arg(long)]
        full: bool,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand, Debug)]
pub enum EnginesCommand {
    /// Engines with health, quarantine and per-method counters.
    Ls {
        #[command(flatten)]
        conn: Conn,
        #[arg(long)]
        json: bool,
    },
    /// Lift an engine's quarantine now; its next call is a trial.
    Readmit {
        #[command(flatten)]
        conn: Conn,
        /// The engine id (its plugins.entries key).
        id: String,
    },
}

#[derive(Subcommand, Debug)]
pub enum OutboxCommand {
    /// Queued commits, oldest first, with attempts and the engine's last refusal.
    Ls {
        #[command(flatten)]
        conn: Conn,
        /// Only this agent's sessions.
        #[arg(long)]
        agent: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Deliver a session's queued commits now, ignoring their backoff.
    Retry {
        #[command(flatten)]
        conn: Conn,
        /// The session key.
        key: String,
        #[arg(long, default_value = "main")]
        agent: String,
    },
    /// Drop a session's queued commits: the engine never receives those
    /// turns; the transcript is untouched (audited in the gateway's log and store).
    Drop {
        #[command(flatten)]
        conn: Conn,
        /// The session key.
        key: String,
        #[arg(long, default_value = "main")]
        agent: String,
    },
}

#[derive(Args, Debug, Clone)]
pub struct Conn {
    /// The gateway to talk to.
    #[arg(long, env = "CTXGATE_GATEWAY", default_value = "http://127.0.0.1:7300")]
    pub gateway: String,
    /// Bearer token, when the gateway requires one.
    #[arg(long, env = "CTXGATE_AUTH_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// For an https:// gateway: the CA (PEM) its certificate must chain to
    /// (default: the public web roots).
    #[arg(long, env = "CTXGATE_TLS_CA")]
    pub tls_ca: Option<std::path::PathBuf>,
    /// A client certificate (PEM) for a gateway that requires one (mTLS),
    /// with `--tls-key`.
    #[arg(long, env = "CTXGATE_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<std::path::PathBuf>,
    #[arg(long, env = "CTXGATE_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<std::path::PathBuf>,
}

impl Conn {
    /// The client TLS settings for an https:// gateway.
    fn tls(&self) -> Result<tonic::transport::ClientTlsConfig, CliError> {
        use ctxgate_engine_sdk::tls;
        let ca = self.tls_ca.as_deref().map(|p| tls::Pem::new("--tls-ca", p));
        let identity = tls::pair(self.tls_cert.as_ref(), self.tls_key.as_ref(), ("--tls-cert", "--tls-key"));
        tls::client(ca, identity).map_err(CliError)
    }
}

/// What a failed connection means, when TLS is why (from the error text:
/// rustls' certificate errors and alerts; the rest is a guess, said so).
fn tls_hint(detail: &str, https: bool) -> Option<&'static str> {
    let hints: &[(&[&str], &str)] = &[
        (&["UnknownIssuer"], "its certificate is not signed by a CA you trust (--tls-ca)"),
        (&["certificate expired", "Expired"], "its certificate has expired"),
        (&["not valid for name", "NotValidForName"], "its certificate is not for that host name"),
        (&["CertificateRequired"], "it requires a client certificate (--tls-cert and --tls-key)"),
        (&["UnknownCA", "BadCertificate", "DecryptError"], "it refused your client certificate"),
        (&["InvalidContentType", "CorruptMessage"], "it does not speak TLS at that address (use http://)"),
    ];
    if let Some((_, hint)) = hints.iter().find(|(keys, _)| keys.iter().any(|k| detail.contains(k))) {
        return Some(hint);
    }
    // Connected, then dropped at once (or TLS bytes read as HTTP/2): a guess.
    let dropped = ["frame with invalid size", "connection closed", "broken pipe", "reset by peer"]
        .iter()
        .any(|k| detail.contains(k));
    match (dropped, https) {
        (true, false) => Some(
            "it dropped the connection at once: it may expect TLS (use https:// and --tls-ca), or not be a ctxgate gateway",
        ),
        // With TLS 1.3 a refused client certificate shows only as the
        // gateway closing the connection right after the handshake.
        (true, true) => Some(
            "it closed the connection after the TLS handshake: it may require a client certificate its CA signed (--tls-cert and --tls-key)",
        ),
        (false, _) => None,
    }
}

#[derive(Args, Debug, Clone)]
pub struct SessionArg {
    /// The session key.
    #[arg(long, default_value = "default")]
    pub session: String,
    #[arg(long, default_value = "main")]
    pub agent: String,
}

impl SessionArg {
    fn as_ref(&self) -> api::SessionRef {
        api::SessionRef { agent_id: self.agent.clone(), session_key: self.session.clone() }
    }
}

/// A failure of a client command, already worded for the user.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct CliError(pub String);

type Client = GatewayClient<InterceptedService<Channel, Bearer>>;

#[derive(Clone)]
pub struct Bearer(Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>);

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

async fn connect(conn: &Conn) -> Result<Client, CliError> {
    let channel = channel(conn).await?;
    let token = match &conn.token {
        Some(t) => Some(
            format!("Bearer {t}")
                .parse()
                .map_err(|_| CliError("the token has characters a header cannot carry".into()))?,
        ),
        None => None,
    };
    Ok(GatewayClient::with_interceptor(channel, Bearer(token))
        .max_decoding_message_size(ctxgate_proto::limits::MAX_GRPC_MESSAGE_BYTES))
}

/// A checked connection to the gateway (TLS when https://).
async fn channel(conn: &Conn) -> Result<Channel, CliError> {
    let mut endpoint = Channel::from_shared(conn.gateway.clone())
        .map_err(|_| CliError(format!("{:?} is not a gateway URL (expected http://HOST:PORT)", conn.gateway)))?
        .connect_timeout(Duration::from_secs(5));
    let https = conn.gateway.starts_with("https://");
    if !https && (conn.tls_ca.is_some() || conn.tls_cert.is_some()) {
        // Never plaintext (with the bearer token) when TLS was asked for.
        return Err(CliError(format!(
            "--tls-ca/--tls-cert are for an https:// gateway; {} is plaintext (use https://)",
            conn.gateway
        )));
    }
    if https {
        endpoint = endpoint.tls_config(conn.tls()?).map_err(|e| CliError(format!("TLS: {}", crate::causes(&e))))?;
    }
    let unreachable = |detail: String| match tls_hint(&detail, https) {
        Some(hint) => CliError(format!("The connection to the gateway at {} failed: {hint}.", conn.gateway)),
        None => CliError(format!(
            "Cannot reach the gateway at {} ({detail}). Is `ctxgate serve` running? (--gateway or CTXGATE_GATEWAY picks another)",
            conn.gateway
        )),
    };
    let channel = endpoint.connect().await.map_err(|e| unreachable(crate::causes(&e)))?;
    // One health check (not behind the bearer token): a TLS mismatch shows
    // on the first call, and is worded here where the connection is known.
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
    let check = health.check(tonic_health::pb::HealthCheckRequest { service: String::new() });
    match tokio::time::timeout(Duration::from_secs(5), check).await {
        Err(_) => return Err(CliError(format!("The gateway at {} did not answer within 5 s.", conn.gateway))),
        Ok(Err(s)) if s.source().is_some() => return Err(unreachable(crate::causes(&s))),
        Ok(_) => {}
    }
    Ok(channel)
}

/// `ctxgate health`: SERVING, or a sentence and exit code 1.
pub async fn health(conn: &Conn) -> Result<(), CliError> {
    let channel = channel(conn).await?;
    let req = tonic_health::pb::HealthCheckRequest { service: crate::server::GATEWAY_SERVICE.into() };
    let mut client = tonic_health::pb::health_client::HealthClient::new(channel);
    let status = match tokio::time::timeout(Duration::from_secs(3), client.check(req)).await {
        Err(_) => return Err(CliError(format!("The gateway at {} did not answer within 3 s.", conn.gateway))),
        Ok(r) => r.map_err(explain)?.into_inner().status(),
    };
    match status {
        tonic_health::pb::health_check_response::ServingStatus::Serving => {
            println!("SERVING");
            Ok(())
        }
        other => Err(CliError(format!("The gateway at {} reports {}.", conn.gateway, other.as_str_name()))),
    }
}

/// Words a status for the user.
fn explain(s: Status) -> CliError {
    CliError(match s.code() {
        Code::Unavailable if s.message().is_empty() => {
            "The gateway went away. Is `ctxgate serve` still running?".into()
        }
        Code::Unauthenticated => format!("The gateway refused the call: {}.", s.message()),
        _ => format!("{}.", s.message().trim_end_matches('.')),
    })
}

pub async fn chat(conn: &Conn, session: &SessionArg, one: Option<String>) -> Result<(), CliError> {
    let mut client = connect(conn).await?;
    if let Some(m) = one {
        return turn(&mut client, session, m).await;
    }
    eprintln!(
        "Chatting in session {:?} (agent {}). Commands: /compact [instructions], /new, /reset, /quit.",
        session.session, session.agent
    );
    let stdin = std::io::stdin();
    loop {
        eprint!("> ");
        let _ = std::io::stderr().flush();
        let mut line = String::new();
        if stdin.lock().read_line(&mut line).map_err(|e| CliError(e.to_string()))? == 0 {
            return Ok(());
        }
        let line = line.trim();
        let result = match line.split_once(' ').map_or((line, ""), |(a, b)| (a, b.trim())) {
            ("", _) => continue,
            ("/quit" | "/exit", _) => return Ok(()),
            ("/compact", rest) => compact_with(&mut client, session, (!rest.is_empty()).then(|| rest.to_owned())).await,
            ("/new", _) => client
                .new_session(session.as_ref())
                .await
                .map(|r| eprintln!("New session {}.", r.into_inner().session_id))
                .map_err(explain),
            ("/reset", _) => client
                .reset_session(session.as_ref())
                .await
                .map(|r| eprintln!("Session reset; new session {}.", r.into_inner().session_id))
                .map_err(explain),
            _ => turn(&mut client, session, line.to_owned()).await,
        };
        if let Err(e) = result {
            eprintln!("{e}");
        }
    }
}

async fn turn(client: &mut Client, session: &SessionArg, message: String) -> Result<(), CliError> {
    use api::turn_event::Event;
    let req =
        api::RunTurnRequest { session: Some(session.as_ref()), message, system_prompt: None, ..Default::default() };
    let mut stream = client.run_turn(req).await.map_err(explain)?.into_inner();
    let mut out = std::io::stdout();
    while let Some(e) = stream.next().await {
        match e.map_err(explain)?.event {
            Some(Event::ModelDelta(d)) => {
                let _ = write!(out, "{}", d.text);
                let _ = out.flush();
            }
            Some(Event::CompactionStarted(c)) => eprintln!("[compacting ({}), {} tokens]", c.trigger, c.tokens_before),
            Some(Event::CompactionDone(d)) => eprintln!("{}", done_line(&d)),
            Some(Event::Warning(w)) => eprintln!("[warning] {}", w.message),
            Some(Event::Completed(_)) => {
                let _ = writeln!(out);
                return Ok(());
            }
            Some(Event::Failed(f)) => {
                let _ = writeln!(out);
                return Err(CliError(f.message));
            }
            _ => {}
        }
    }
    Err(CliError("The gateway ended the turn without an answer.".into()))
}

fn done_line(d: &api::CompactionDone) -> String {
    if d.compacted {
        format!("[compacted: {} → {} tokens]", d.tokens_before, d.tokens_after)
    } else {
        format!("[not compacted: {}]", d.reason.as_deref().unwrap_or("no reason given"))
    }
}

pub async fn compact(conn: &Conn, session: &SessionArg, instructions: Option<String>) -> Result<(), CliError> {
    compact_with(&mut connect(conn).await?, session, instructions).await
}

async fn compact_with(client: &mut Client, session: &SessionArg, instructions: Option<String>) -> Result<(), CliError> {
    use api::compaction_event::Event;
    let req = api::CompactSessionRequest { session: Some(session.as_ref()), custom_instructions: instructions };
    let mut stream = client.compact(req).await.map_err(explain)?.into_inner();
    while let Some(e) = stream.next().await {
        match e.map_err(explain)?.event {
            Some(Event::Started(s)) => {
                eprintln!("Compacting session {:?} ({} tokens)…", session.session, s.tokens_before)
            }
            Some(Event::Progress(p)) => {
                let width = 30;
                let filled = (p.done.min(p.total) * width).checked_div(p.total).unwrap_or(0) as usize;
                eprint!(
                    "\r[{}{}] {}/{} {:<40}",
                    "#".repeat(filled),
                    ".".repeat(width as usize - filled),
                    p.done,
                    p.total,
                    p.message
                );
            }
            Some(Event::Done(d)) => {
                eprintln!();
                println!("{}", done_line(&d));
                return Ok(());
            }
            None => {}
        }
    }
    Err(CliError("The gateway ended the compaction without a result.".into()))
}

pub async fn sessions(cmd: SessionsCommand) -> Result<(), CliError> {
    match cmd {
        SessionsCommand::Ls { conn, all, json } => {
            let mut client = connect(&conn).await?;
            let mut sessions = Vec::new();
            let mut page_token = String::new();
            // Every page (each is bounded by the gateway).
            loop {
                let req = api::ListSessionsRequest { agent_id: None, include_archived: all, page_size: 0, page_token };
                let page = client.list_sessions(req).await.map_err(explain)?.into_inner();
                sessions.extend(page.sessions);
                if page.next_page_token.is_empty() {
                    break;
                }
                page_token = page.next_page_token;
            }
            if json {
                let rows: Vec<_> = sessions.iter().map(session_json).collect();
                println!("{}", serde_json::to_string_pretty(&rows).unwrap_or_default());
            } else if sessions.is_empty() {
                println!("No sessions yet. Start one with `ctxgate chat`.");
            } else {
                println!(
                    "{:<12} {:<24} {:<9} {:>7} {:>11}  SESSION ID",
                    "AGENT", "KEY", "STATE", "ENTRIES", "COMPACTIONS"
                );
                for s in sessions {
                    println!(
                        "{:<12} {:<24} {:<9} {:>7} {:>11}  {}",
                        s.agent_id, s.session_key, s.state, s.entries, s.compactions, s.session_id
                    );
                }
            }
        }
        SessionsCommand::Show { conn, key, agent, full, json } => {
            let mut client = connect(&conn).await?;
            let mut req = api::GetTranscriptRequest {
                session: Some(api::SessionRef { agent_id: agent, session_key: key }),
                visible_only: !full,
                ..Default::default()
            };
            let mut t = client.get_transcript(req.clone()).await.map_err(explain)?.into_inner();
            while !t.next_page_token.is_empty() {
                req.page_token = std::mem::take(&mut t.next_page_token);
                let page = client.get_transcript(req.clone()).await.map_err(explain)?.into_inner();
                t.entries.extend(page.entries);
                t.next_page_token = page.next_page_token;
            }
            if json {
                let entries: Vec<_> = t.entries.iter().map(entry_json).collect();
                println!(
                    "{}",
                    serde_json::to_string_pretty(
                        &json!({"session": t.session.as_ref().map(session_json), "entries": entries})
                    )
                    .unwrap_or_default()
                );
                return Ok(());
            }
            if let Some(s) = &t.session {
                println!(
                    "Session {} ({}/{}, {}): {} entries, {} compactions, ~{} visible tokens\n",
                    s.session_id, s.agent_id, s.session_key, s.state, s.entries, s.compactions, s.visible_tokens
                );
            }
            for e in &t.entries {
                match &e.entry {
                    Some(Entry::Message(m)) => println!("{}: {}\n", role_name(m.role), message_text(m)),
                    Some(Entry::Compaction(c)) => println!(
                        "── compaction summary ({} → {} tokens, kept from {}) ──\n{}\n──\n",
                        c.tokens_before,
                        c.tokens_after.unwrap_or_default(),
                        c.first_kept_entry_id,
                        c.summary.trim_end()
                    ),
                    None => {}
                }
            }
        }
    }
    Ok(())
}

fn session_json(s: &api::SessionInfo) -> serde_json::Value {
    json!({"agent_id": s.agent_id, "session_key": s.session_key, "session_id": s.session_id, "state": s.state,
           "created_at_unix_ms": s.created_at_unix_ms, "entries": s.entries, "compactions": s.compactions, "visible_tokens": s.visible_tokens})
}

fn entry_json(e: &ctxgate_proto::pb::TranscriptEntry) -> serde_json::Value {
    match &e.entry {
        Some(Entry::Message(m)) => {
            json!({"id": e.id, "seq": e.seq, "kind": "message", "role": role_name(m.role), "text": message_text(m)})
        }
        Some(Entry::Compaction(c)) => json!({"id": e.id, "seq": e.seq, "kind": "compaction", "summary": c.summary,
            "first_kept_entry_id": c.first_kept_entry_id, "tokens_before": c.tokens_before, "tokens_after": c.tokens_after}),
        None => json!({"id": e.id, "seq": e.seq, "kind": "unknown"}),
    }
}

fn outbox_json(r: &api::OutboxRow) -> serde_json::Value {
    json!({"agent_id": r.agent_id, "session_key": r.session_key, "session_id": r.session_id,
        "advancement_key": r.advancement_key, "engine_id": r.engine_id, "engine_state": r.engine_state,
        "attempts": r.attempts, "blocked": r.blocked, "last_error": r.last_error,
        "next_attempt_unix_ms": r.next_attempt_unix_ms, "created_at_unix_ms": r.created_at_unix_ms})
}

fn print_outbox_row(r: &api::OutboxRow) {
    let state = if r.blocked { format!("BLOCKED after {} attempt(s)", r.attempts) } else { "queued".into() };
    println!(
        "{:<12} {:<24} {:<34} {:<16} {state} (engine {})",
        r.agent_id, r.session_key, r.advancement_key, r.engine_id, r.engine_state
    );
    if let Some(e) = &r.last_error {
        println!("{:<12} last error: {e}", "");
    }
}

pub async fn outbox(cmd: OutboxCommand) -> Result<(), CliError> {
    match cmd {
        OutboxCommand::Ls { conn, agent, json } => {
            let r = connect(&conn)
                .await?
                .list_outbox(api::ListOutboxRequest { agent_id: agent, limit: 0 })
                .await
                .map_err(explain)?
                .into_inner();
            if json {
                let rows: Vec<_> = r.rows.iter().map(outbox_json).collect();
                println!(
                    "{}",
                    serde_json::to_string_pretty(&json!({"rows": rows, "more": r.more})).unwrap_or_default()
                );
            } else if r.rows.is_empty() {
                println!("The outbox is empty: every accepted durable turn reached its engine.");
            } else {
                println!("{:<12} {:<24} {:<34} {:<16} STATE", "AGENT", "KEY", "TURN", "ENGINE");
                r.rows.iter().for_each(print_outbox_row);
                if r.more > 0 {
                    println!("… and {} more", r.more);
                }
            }
        }
        OutboxCommand::Retry { conn, key, agent } => {
            let r = connect(&conn)
                .await?
                .retry_outbox(api::SessionRef { agent_id: agent, session_key: key.clone() })
                .await
                .map_err(explain)?
                .into_inner();
            println!("{} queued commit(s) of {key:?} delivered, {} still waiting.", r.done, r.remaining.len());
            r.remaining.iter().for_each(print_outbox_row);
        }
        OutboxCommand::Drop { conn, key, agent } => {
            let r = connect(&conn)
                .await?
                .drop_outbox(api::SessionRef { agent_id: agent, session_key: key.clone() })
                .await
                .map_err(explain)?
                .into_inner();
            println!("{} queued commit(s) of {key:?} dropped; the engine will not receive those turns.", r.done);
        }
    }
    Ok(())
}

fn quarantine_json(q: &api::Quarantine) -> serde_json::Value {
    json!({"operation": q.operation, "reason": q.reason, "since_unix_ms": q.since_unix_ms})
}

fn engine_json(e: &api::EngineStatus) -> serde_json::Value {
    json!({"id": e.id, "name": e.name, "endpoint": e.endpoint, "health": e.health, "affinity": e.affinity,
        "quarantine": e.quarantine.as_ref().map(quarantine_json),
        "replicas": e.replicas.iter().map(|r| json!({"address": r.address, "health": r.health, "in_flight": r.in_flight, "calls": r.calls,
            "quarantine": r.quarantine.as_ref().map(quarantine_json)})).collect::<Vec<_>>(),
        "methods": e.methods.iter().map(|m| json!({"method": m.method, "calls": m.calls, "failures": m.failures, "timeouts": m.timeouts, "fallbacks": m.fallbacks, "shed": m.shed})).collect::<Vec<_>>()})
}

fn print_engine(e: &api::EngineStatus) {
    let q =
        e.quarantine.as_ref().map_or(String::new(), |q| format!(", quarantined during {}: {}", q.operation, q.reason));
    println!("  - {} ({}) at {}: {}{q}", e.id, e.name, e.endpoint, e.health);
    // One replica is the endpoint itself; several are worth a line each.
    if e.replicas.len() > 1 || e.endpoint.starts_with("dns:///") {
        let affinity = if e.affinity.is_empty() { String::new() } else { format!(" (affinity: {})", e.affinity) };
        println!("      {} replica(s){affinity}:", e.replicas.len());
        for r in &e.replicas {
            let q = r.quarantine.as_ref().map_or(String::new(), |q| format!(", quarantined: {}", q.reason));
            println!("        {:<24} {}{q}, {} in flight, {} calls", r.address, r.health, r.in_flight, r.calls);
        }
    }
    for m in &e.methods {
        println!(
            "      {:<22} {:>6} calls {:>4} failed {:>4} timed out {:>4} fell back {:>4} shed",
            m.method, m.calls, m.failures, m.timeouts, m.fallbacks, m.shed
        );
    }
}

pub async fn status(conn: &Conn, as_json: bool) -> Result<(), CliError> {
    let s = connect(conn).await?.get_status(api::StatusRequest {}).await.map_err(explain)?.into_inner();
    if as_json {
        let engines: Vec<_> = s.engines.iter().map(engine_json).collect();
        let v = json!({"version": s.version, "model_provider": s.model_provider, "model": s.model, "context_window": s.context_window,
            "selected_engine": s.selected_engine, "engines": engines, "sessions": s.sessions, "turns_in_flight": s.turns_in_flight, "turns_queued": s.turns_queued,
            "outbox_queued": s.outbox_queued, "outbox_blocked": s.outbox_blocked,
            "blocked_commits": s.blocked_commits.iter().map(outbox_json).collect::<Vec<_>>()});
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
        return Ok(());
    }
    println!("ctxgate {}", s.version);
    println!("model:    {} ({}), {}-token window", s.model, s.model_provider, s.context_window);
    println!("engine:   {}", s.selected_engine);
    for e in &s.engines {
        print_engine(e);
    }
    println!("sessions: {} active, {} turns running, {} queued", s.sessions, s.turns_in_flight, s.turns_queued);
    println!("outbox:   {} commit(s) queued, {} blocked by an engine's refusal", s.outbox_queued, s.outbox_blocked);
    s.blocked_commits.iter().for_each(print_outbox_row);
    Ok(())
}

pub async fn engines(cmd: EnginesCommand) -> Result<(), CliError> {
    match cmd {
        EnginesCommand::Ls { conn, json } => {
            let s = connect(&conn).await?.get_status(api::StatusRequest {}).await.map_err(explain)?.into_inner();
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&s.engines.iter().map(engine_json).collect::<Vec<_>>())
                        .unwrap_or_default()
                );
            } else {
                println!("selected: {}", s.selected_engine);
                s.engines.iter().for_each(print_engine);
            }
        }
        EnginesCommand::Readmit { conn, id } => {
            let r = connect(&conn)
                .await?
                .readmit_engine(api::ReadmitEngineRequest { engine_id: id.clone() })
                .await
                .map_err(explain)?;
            if r.into_inner().readmitted {
                println!("Engine {id:?} re-admitted; its next call is a trial.");
            } else {
                println!("Engine {id:?} was not quarantined.");
            }
        }
    }
    Ok(())
}

/// `ctxgate serve`: config, then bind, then run until Ctrl-C or SIGTERM.
pub async fn serve(
    config: Option<PathBuf>,
    listen: Option<String>,
    state_dir: Option<PathBuf>,
) -> Result<(), CliError> {
    let mut cfg = Config::load(config.as_deref(), |k| std::env::var(k).ok()).map_err(|e| CliError(e.to_string()))?;
    if let Some(l) = listen {
        cfg.gateway.listen = l;
        cfg.listen_addr().map_err(|e| CliError(e.to_string()))?;
    }
    if let Some(d) = state_dir {
        cfg.state_dir = d;
    }
    let store = crate::server::open_store(&cfg).await.map_err(|e| CliError(e.to_string()))?;
    let listeners = crate::server::Listeners::bind(&cfg).await.map_err(|e| CliError(e.to_string()))?;
    let addr = listeners.api.local_addr().map_err(|e| CliError(e.to_string()))?;
    let metrics = listeners.metrics.as_ref().and_then(|l| l.local_addr().ok());
    let store_at = match &cfg.store.url {
        Some(url) => crate::store::postgres::redacted(url),
        None => cfg.state_dir.display().to_string(),
    };
    tracing::info!(%addr, ?metrics, store = %store_at, provider = ?cfg.models.provider, "ctxgate serving");
    println!("listening on {addr}");
    let _ = std::io::stdout().flush();
    // SIGHUP re-reads the config file and applies its engine settings.
    let (reload_tx, reloads) = tokio::sync::mpsc::channel(1);
    let (path, overrides) = (config.clone(), cfg.clone());
    tokio::spawn(async move {
        let Ok(mut hup) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) else { return };
        while hup.recv().await.is_some() {
            match Config::load(path.as_deref(), |k| std::env::var(k).ok()) {
                Ok(mut next) => {
                    // Listen address and state dir cannot change without a restart.
                    next.gateway.listen.clone_from(&overrides.gateway.listen);
                    next.state_dir.clone_from(&overrides.state_dir);
                    let _ = reload_tx.send(next).await;
                }
                Err(e) => tracing::error!(error = %e, "config reload failed; keeping the running configuration"),
            }
        }
    });
    crate::server::run_with_reloads(cfg, store, listeners, shutdown_signal(), reloads)
        .await
        .map_err(|e| CliError(e.to_string()))
}

async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! { _ = tokio::signal::ctrl_c() => {}, () = term => {} }
}
