//! The store: one suite on SQLite and PostgreSQL, storage faults, and
//! several gateways sharing one PostgreSQL. One module a feature
//! (tests/README.md maps them). Run this area alone with
//! `cargo test -p ctxgate-tests --test store`.

mod backends;
mod shared_store;
mod storage_faults;
