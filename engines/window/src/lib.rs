//! `ctxgate-engine-window`: keeps the last N turns verbatim plus a rolling
//! summary of everything older, with its state in its own SQLite file.

mod engine;
mod retrieval;
mod store;
mod summary;
mod turns;

pub use engine::{Config, WindowEngine};
pub use summary::MAX_SUMMARY_CHARS;
