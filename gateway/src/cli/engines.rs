//! `ctxgate engines ls|tools|readmit`: the engines with their health and
//! counters, the tools they offer, and lifting a quarantine by hand.

use clap::Subcommand;
use ctxgate_proto::gateway as api;

use super::render::{engine_json, print_engine, tool_json};
use super::{CliError, Conn, connect};

#[derive(Subcommand, Debug)]
pub enum EnginesCommand {
    /// Engines with health, quarantine and per-method counters.
    Ls {
        #[command(flatten)]
        conn: Conn,
        #[arg(long)]
        json: bool,
    },
    /// The tools engines offer the model (all engines, or one).
    Tools {
        #[command(flatten)]
        conn: Conn,
        /// Only this engine's (its plugins.entries key).
        engine: Option<String>,
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

pub async fn run(cmd: EnginesCommand) -> Result<(), CliError> {
    match cmd {
        EnginesCommand::Ls { conn, json } => {
            let s = connect(&conn).await?.get_status(api::StatusRequest {}).await?.into_inner();
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
        EnginesCommand::Tools { conn, engine, json } => {
            let s = connect(&conn).await?.get_status(api::StatusRequest {}).await?.into_inner();
            let engines: Vec<&api::EngineStatus> =
                s.engines.iter().filter(|e| engine.as_deref().is_none_or(|id| e.id == id)).collect();
            if let Some(id) = &engine
                && engines.is_empty()
            {
                return Err(CliError::NoSuchEngine(id.clone()));
            }
            if json {
                let list: Vec<_> = engines
                    .iter()
                    .map(|e| serde_json::json!({"engine": e.id, "tools": e.tools.iter().map(tool_json).collect::<Vec<_>>()}))
                    .collect();
                println!("{}", serde_json::to_string_pretty(&list).unwrap_or_default());
            } else {
                for e in engines {
                    if e.tools.is_empty() {
                        println!("{}: no tools", e.id);
                    }
                    for t in &e.tools {
                        println!("{}: {} — {}", e.id, t.name, t.description.lines().next().unwrap_or_default());
                    }
                }
            }
        }
        EnginesCommand::Readmit { conn, id } => {
            let r = connect(&conn).await?.readmit_engine(api::ReadmitEngineRequest { engine_id: id.clone() }).await?;
            if r.into_inner().readmitted {
                println!("Engine {id:?} re-admitted; its next call is a trial.");
            } else {
                println!("Engine {id:?} was not quarantined.");
            }
        }
    }
    Ok(())
}
