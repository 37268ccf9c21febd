use std::process::ExitCode;

use clap::Parser;
use ctxgate::cli::Cli;

// mimalloc: a turn decodes and drops many small strings, and glibc's
// malloc was ~45 % of a tail-cache miss (see gateway/Cargo.toml).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> ExitCode {
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let filter = tracing_subscriber::EnvFilter::try_from_env("CTXGATE_LOG").unwrap_or_else(|_| "info".into());
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi).init();
    match Cli::parse().command.run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ctxgate: {e}");
            ExitCode::FAILURE
        }
    }
}
