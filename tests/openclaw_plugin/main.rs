//! OpenClaw as a client of ctxgate (a test binary of its own: minutes of
//! OpenClaw's start per turn): the plugin (engines/openclaw-plugin) in
//! the real openclaw@2026.9.6 (`openclaw agent --local`, a local fake model)
//! against `ctxgate serve` — with the window engine, turns answered, the
//! gateway's copy equal to OpenClaw's transcript, CommitTurn once a turn,
//! the engine killed between turns (answered by legacy, said on OpenClaw's
//! console) and restarted (re-admitted, used again, holding every turn; its
//! history_search offered to OpenClaw's model, called and answered), its
//! summary written by the gateway's model (LlmComplete), the gateway killed
//! (OpenClaw's own messages answer, the commit waits in OpenClaw's outbox)
//! and back (the waiting commit delivered once); with the Python engine
//! (its first turn run before the plugin, imported) and lossless-claw 1.x
//! under the plugin host, two turns and the same checks. The script (tests/openclaw-plugin/run.sh)
//! installs what it needs, runs one engine at a time (a lock) and bounds
//! itself in time.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::time::Duration;

use ctxgate_tests::run_script;

/// Runs the script for `engine`; its output, once it closed with `ok`.
async fn plugin_run(engine: &str) -> String {
    // Up to ~3.5 min a run with OpenClaw installed, and the runs queue on
    // one lock; the first also installs OpenClaw and Node.
    let (ok, out) = run_script(&format!("tests/openclaw-plugin/run.sh {engine}"), Duration::from_secs(1800)).await;
    eprintln!("{out}");
    assert!(ok, "tests/openclaw-plugin/run.sh {engine} failed");
    assert!(out.lines().any(|l| l.trim() == "ℹ fail 0"), "the plugin's own tests:\n{out}");
    out
}

#[tokio::test]
async fn openclaw_runs_its_turns_on_the_window_engine_through_the_plugin_and_rides_out_its_death() {
    let out = plugin_run("window").await;
    assert!(out.lines().any(|l| l.starts_with("openclaw-plugin: ok (7 turns on the window engine")), "{out}");
}

#[tokio::test]
async fn openclaw_runs_its_turns_on_the_python_engine_through_the_plugin() {
    let out = plugin_run("python").await;
    assert!(out.lines().any(|l| l.starts_with("openclaw-plugin: ok (2 turns on the python engine")), "{out}");
}

#[tokio::test]
async fn openclaw_runs_its_turns_on_lossless_claw_under_the_plugin_host_through_the_plugin() {
    let out = plugin_run("lossless").await;
    assert!(out.lines().any(|l| l.starts_with("openclaw-plugin: ok (2 turns on the lossless engine")), "{out}");
}
