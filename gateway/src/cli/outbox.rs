//! `ctxgate outbox ls|retry|drop`: durable-turn commits waiting for their engine.

use clap::Subcommand;
use ctxgate_proto::gateway as api;
use serde_json::json;

use super::render::{drop_json, forget_json, outbox_json, print_drop, print_forget, print_outbox_row};
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
    /// Drop the ForgetSession calls owed to an engine that is no longer in
    /// the config (audited like a drop).
    DropForgets {
        #[command(flatten)]
        conn: Conn,
        /// The engine id.
        engine: String,
    },
    /// The audited drops, newest first (kept store.auditRetentionDays).
    Drops {
        #[command(flatten)]
        conn: Conn,
        #[arg(long)]
        json: bool,
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
                let forgets: Vec<_> = r.forgets.iter().map(forget_json).collect();
                let all = json!({"rows": rows, "more": r.more, "forgets": forgets, "more_forgets": r.more_forgets});
                println!("{}", serde_json::to_string_pretty(&all).unwrap_or_default());
                return Ok(());
            }
            if r.rows.is_empty() {
                println!("The outbox is empty: every accepted durable turn reached its engine.");
            } else {
                println!("{:<12} {:<24} {:<34} {:<16} STATE", "AGENT", "KEY", "TURN", "ENGINE");
                r.rows.iter().for_each(print_outbox_row);
                if r.more > 0 {
                    println!("… and {} more", r.more);
                }
            }
            if !r.forgets.is_empty() {
                println!("\nForgetSession calls owed for deleted sessions:");
                println!("{:<12} {:<24} {:<34} {:<16} STATE", "AGENT", "KEY", "SESSION", "ENGINE");
                r.forgets.iter().for_each(print_forget);
                if r.more_forgets > 0 {
                    println!("… and {} more", r.more_forgets);
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
        OutboxCommand::DropForgets { conn, engine } => {
            let r = connect(&conn)
                .await?
                .drop_forgets(api::DropForgetsRequest { engine_id: engine.clone() })
                .await?
                .into_inner();
            println!("{} owed ForgetSession call(s) to {engine:?} dropped.", r.done);
        }
        OutboxCommand::Drops { conn, json } => {
            let r =
                connect(&conn).await?.list_outbox_drops(api::ListOutboxDropsRequest { limit: 0 }).await?.into_inner();
            if json {
                let drops: Vec<_> = r.drops.iter().map(drop_json).collect();
                let all = json!({"drops": drops, "more": r.more});
                println!("{}", serde_json::to_string_pretty(&all).unwrap_or_default());
            } else if r.drops.is_empty() {
                println!("Nothing was dropped (within store.auditRetentionDays).");
            } else {
                println!("{:<17} {:<12} {:<24} {:<34} ENGINE", "DROPPED (UTC)", "AGENT", "KEY", "TURN");
                r.drops.iter().for_each(print_drop);
                if r.more > 0 {
                    println!("… and {} more", r.more);
                }
            }
        }
    }
    Ok(())
}
