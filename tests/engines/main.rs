//! The gateway hosting engine processes, and the engines themselves: one
//! module a feature (tests/README.md maps them). Run this area alone with
//! `cargo test -p ctxgate-tests --test engines`.

mod conformance;
mod delta_history;
mod hostile_engines;
mod overload;
mod quarantine;
mod replicas;
mod sdk_server;
mod tracing;
mod window_engine;
