use std::process::ExitCode;

use clap::Parser;
use ctxgate::cli::{self, Cli, Command};

#[tokio::main]
async fn main() -> ExitCode {
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let filter = tracing_subscriber::EnvFilter::try_from_env("CTXGATE_LOG").unwrap_or_else(|_| "info".into());
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi).init();
    let result = match Cli::parse().command {
        Command::Serve { config, listen, state_dir } => cli::serve(config, listen, state_dir).await,
        Command::Chat { conn, session, message } => cli::chat(&conn, &session, message).await,
        Command::Compact { conn, session, instructions } => cli::compact(&conn, &session, instructions).await,
        Command::Sessions { command } => cli::sessions(command).await,
        Command::Status { conn, json } => cli::status(&conn, json).await,
        Command::Health { conn } => cli::health(&conn).await,
        Command::Engines { command } => cli::engines(command).await,
        Command::Outbox { command } => cli::outbox(command).await,
        Command::Doctor { config, fix } => cli::doctor::run(config.as_deref(), fix).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ctxgate: {e}");
            ExitCode::FAILURE
        }
    }
}
