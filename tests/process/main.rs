//! The binaries as a user runs them: the `ctxgate` CLI, crash recovery after
//! a SIGKILL, TLS and the compose certificates, and the Python harness
//! client's example agent. One module a feature (tests/README.md maps
//! them). Run this area alone with `cargo test -p ctxgate-tests --test
//! process`.

mod cli;
mod crash_recovery;
mod error_sweep;
mod harness_python;
mod tls;
