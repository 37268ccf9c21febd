//! `ctxgate-engine-sdk`: write a ctxgate context engine in Rust.
//!
//! Implement [`ContextEngine`] (the four required methods; the optional ones
//! answer UNIMPLEMENTED by default) and hand it to [`serve_main`] or
//! [`Server`]. The server validates every request against the contract before
//! your code runs, runs each call in its own task (a panic becomes INTERNAL,
//! never a dropped connection), gives each call a [`CallContext`] with its
//! deadline, a cancellation token and a [`HostClient`], and serves
//! `grpc.health.v1` and reflection next to the engine.
//!
//! [`testkit`] runs an engine in-process for tests; [`conformance`] is the
//! black-box suite behind the `ctxgate-conformance` binary.

pub mod conformance;
mod context;
mod engine;
mod error;
pub mod health;
mod host;
mod server;
mod service;
pub mod testkit;

pub use context::CallContext;
pub use ctxgate_proto::{self as proto, estimate, limits, pb, validate};
pub use ctxgate_runtime::Endpoint;
pub use engine::{CompactOutcome, ContextEngine, Progress, tool, tool_error, tool_text};
pub use error::EngineError;
pub use host::{HostClient, HostPolicy, LLM_COMPLETE, Peer, READ_TRANSCRIPT, Refused};
pub use server::{Bound, ServeArgs, Server, serve_main, shutdown_signal};
pub use service::parse_grpc_timeout;
