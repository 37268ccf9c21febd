//! The ctxgate gateway as a library: `main.rs` only parses the command
//! line, so tests run the same `server::run` as the binary.

pub mod api;
pub mod cli;
pub mod compaction;
pub mod config;
pub mod core;
pub mod engines;
pub mod grants;
pub mod harness;
pub mod host;
pub mod metrics;
pub mod outbound;
pub mod provider;
pub mod server;
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
