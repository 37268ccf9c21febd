//! The ctxgate gateway as a library: `main.rs` only parses the command line.

pub mod compaction;
pub mod config;
pub mod provider;
pub mod store;
pub mod summarize;
pub mod transcript;
