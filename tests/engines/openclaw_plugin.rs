//! OpenClaw as a client of ctxgate: the plugin (engines/openclaw-plugin) in
//! the real openclaw@2026.9.6 (`openclaw agent --local`, a local fake model)
//! against `ctxgate serve` with the window engine — turns answered, the
//! gateway's copy equal to OpenClaw's transcript, CommitTurn once a turn,
//! the engine killed between turns (answered by legacy, said on OpenClaw's
//! console) and restarted (re-admitted, used again, holding every turn).
//! The script (tests/openclaw-plugin/run.sh) installs what it needs and
//! bounds itself in time.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::time::Duration;

use crate::sdk_typescript::run_script;

#[tokio::test]
async fn openclaw_runs_its_turns_on_a_ctxgate_engine_through_the_plugin_and_rides_out_the_engines_death() {
    // ~2.5 min with OpenClaw installed (five OpenClaw turns are most of it).
    let (ok, out) = run_script("tests/openclaw-plugin/run.sh", Duration::from_secs(1200)).await;
    eprintln!("{out}");
    assert!(ok, "tests/openclaw-plugin/run.sh failed");
    assert!(out.lines().any(|l| l.starts_with("openclaw-plugin: ok (5 turns")), "no closing line:\n{out}");
    assert!(out.lines().any(|l| l.trim() == "ℹ fail 0"), "the plugin's own tests:\n{out}");
}
