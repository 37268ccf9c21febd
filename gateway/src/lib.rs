//! The ctxgate gateway as a library: `main.rs` only parses the command
//! line, so tests run the same [`api::server::run`] as the binary.
//!
//! The map, outside in:
//!
//! - [`cli`] — the `ctxgate` commands, one file each (`serve` among them).
//! - [`api`] — the adapters: the client API, the harness API, the Host
//!   callbacks engines make, client event streams, and the listeners. Client
//!   protos stop here.
//! - [`core`] — the domain: one turn lifecycle with two drivers,
//!   compaction, subagents, durable turns, admission. Speaks its own types
//!   and the engine contract.
//! - [`engines`] — the engines a turn runs with: the in-process legacy
//!   engine and remote ones behind quarantine, replicas and health.
//! - [`store`] — sessions, the transcript tree, the outbox, cursors:
//!   SQLite (one gateway) or PostgreSQL (several).
//! - Domain services the core uses: [`compaction`] (built-in),
//!   [`summarize`], [`transcript`] (what is visible), [`provider`] (the
//!   model), [`grants`] (what an engine's callbacks may do).
//! - Cross-cutting: [`config`] (read and validated before any port is
//!   bound), [`metrics`], and [`peer_text`] (what a peer says, made safe
//!   to log and to pass on).

pub mod api;
pub mod cli;
pub mod compaction;
pub mod config;
pub mod core;
pub mod engines;
pub mod grants;
pub mod metrics;
pub mod model_spend;
pub mod peer_text;
pub mod provider;
pub mod store;
pub mod summarize;
pub mod transcript;

#[cfg(test)]
mod untrusted_input_tests;

/// An error with its sources, `: `-joined: transport and driver errors
/// (tonic, hyper, rustls, tokio-postgres) say what went wrong only there.
pub fn causes(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        s = format!("{s}: {inner}");
        src = inner.source();
    }
    s
}
