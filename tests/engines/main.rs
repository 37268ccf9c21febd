//! The gateway hosting engine processes, and the engines themselves: one
//! module a feature (tests/README.md maps them). Run this area alone with
//! `cargo test -p ctxgate-tests --test engines`.

mod conformance;
mod deadlines_and_cancellation;
mod delta_history;
mod doctor;
mod engine_selection;
mod grants;
mod host_requirements;
mod hostile_engines;
mod lanes;
mod maintenance;
mod openclaw_differential;
mod openclaw_host;
mod overload;
mod python_engine;
mod quarantine;
mod replicas;
mod retrieval;
mod sdk_go;
mod sdk_python;
mod sdk_server;
mod sdk_typescript;
mod subagents;
mod tools;
mod tracing;
mod window_engine;
