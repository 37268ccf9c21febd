//! Turns through a gateway running in the test's process: managed and
//! harness turns, compaction, busy policies, durable turns and the outbox,
//! the client API's limits. One module a feature (tests/README.md maps
//! them). Run this area alone with `cargo test -p ctxgate-tests --test turns`.

use ctxgate::config::{Config, LimitsSection};
use ctxgate_tests::TestGateway;

mod busy_policies;
mod compaction;
mod compaction_by_engine;
mod durable_turns;
mod harness_turns;
mod limits;
mod managed_turns;

/// A gateway on the default config with `limits` applied to its client
/// API limits (`gateway.limits`).
async fn limited_gateway(limits: impl FnOnce(&mut LimitsSection)) -> TestGateway {
    let mut config = Config::default();
    limits(&mut config.gateway.limits);
    TestGateway::start(config).await
}
