//! `ctxgate outbox ls|retry|drop`: durable-turn commits waiting for their engine.

use clap::Subcommand;
use ctxgate_proto::gateway as api;
use serde_json::json;

use super::render::{outbox_json, print_outbox_row};
use super::{CliError, Conn, connect};

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

pub async fn run(cmd: OutboxCommand) -> Result<(), CliError> {
    match cmd {
        OutboxCommand::Ls { conn, agent, json } => {
            let r = connect(&conn)
                .await?
                .list_outbox(api::ListOutboxRequest { agent_id: agent, limit: 0 })
                .await?
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
                .await?
                .into_inner();
            println!("{} queued commit(s) of {key:?} delivered, {} still waiting.", r.done, r.remaining.len());
            r.remaining.iter().for_each(print_outbox_row);
        }
        OutboxCommand::Drop { conn, key, agent } => {
            let r = connect(&conn)
                .await?
                .drop_outbox(api::SessionRef { agent_id: agent, session_key: key.clone() })
                .await?
                .into_inner();
            println!("{} queued commit(s) of {key:?} dropped; the engine will not receive those turns.", r.done);
        }
    }
    Ok(())
}
