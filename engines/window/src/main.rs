use std::path::PathBuf;

use clap::Parser;
use ctxgate_engine_sdk::{ServeArgs, serve_main};
use ctxgate_engine_window::{Config, WindowEngine};

// See the gateway's main.rs: decoding and dropping messages is most of
// an engine's allocation, and glibc's malloc was ~15 % of its samples.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The window context engine: last N turns verbatim plus a rolling summary.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    #[command(flatten)]
    serve: ServeArgs,
    /// Where the engine keeps its SQLite state.
    #[arg(long, default_value = "./window-state")]
    state_dir: PathBuf,
    /// Turns kept verbatim after compaction.
    #[arg(long, default_value_t = 4)]
    keep_turns: usize,
    /// A turn's end compacts once this many turns beyond the kept ones are
    /// not summarised yet.
    #[arg(long, default_value_t = 4)]
    auto_compact_after: usize,
    /// Older tool results larger than this are elided by Maintain.
    #[arg(long, default_value_t = 4096)]
    max_tool_result_bytes: usize,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    // `ctxgate-engine-window health --endpoint ADDR`: the container health check.
    if let Some(code) = ctxgate_engine_sdk::health::subcommand("ctxgate-engine-window").await {
        return code;
    }
    match run(Args::parse()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ctxgate-engine-window: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let config = Config {
        keep_turns: args.keep_turns,
        auto_compact_after: args.auto_compact_after,
        max_tool_result_bytes: args.max_tool_result_bytes,
        ..Config::default()
    };
    let engine = WindowEngine::open(&args.state_dir, config)?;
    serve_main(engine, args.serve).await
}
