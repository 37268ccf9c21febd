//! The Go SDK (engine-sdk/go) as CI checks it: its script
//! `engine-sdk/go/check.sh` runs go vet, compares the committed generated
//! code with what generate.sh makes from proto/, runs go test (-race), then
//! builds the example engine (examples/recall) and runs the conformance kit
//! against it over TCP and over a unix socket. Go modules come from the Go
//! module proxy on the first run; later runs are served from Go's caches.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::process::Stdio;
use std::time::Duration;

use ctxgate_engine_sdk::conformance::CASES;
use ctxgate_tests::{bin, repo_root, within};

/// The kit's cases the Go example cannot run: it keeps no durable turns
/// and prepares no subagents.
const EXPECTED_SKIPS: [&str; 2] = ["commit_turn.committed_then_duplicate", "subagent.prepare_then_rollback_twice"];

#[tokio::test]
async fn the_go_sdk_passes_its_own_tests_and_its_example_engine_passes_the_kit() {
    let script = repo_root().join("engine-sdk/go/check.sh");
    let run = tokio::process::Command::new(&script)
        .arg(bin("ctxgate-conformance"))
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output();
    // The first run downloads modules and builds with the race detector.
    let out = within(Duration::from_secs(540), "engine-sdk/go/check.sh", run).await.unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let report = format!("stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(out.status.success(), "check.sh failed ({}):\n{report}", out.status);

    for package in ["", "/contract", "/examples/recall", "/examples/minimal"] {
        let ok = format!("ok  \tgithub.com/ctxgate/ctxgate/engine-sdk/go{package}\t");
        assert!(stdout.lines().any(|l| l.starts_with(&ok)), "go test did not pass {ok:?}:\n{report}");
    }
    assert!(stdout.contains("pb/ is what generate.sh makes from proto/"), "{report}");

    // Each judged engine's kit run: its closing line, and its skips.
    let mut runs: Vec<(String, String, Vec<String>)> = Vec::new();
    for line in stdout.lines() {
        if let Some(section) = line.strip_prefix("-- ") {
            runs.push((section.split(':').next().unwrap().to_owned(), String::new(), Vec::new()));
        } else if let Some((_, closing, skips)) = runs.last_mut() {
            if line.contains(" passed, ") && line.ends_with(" skipped") {
                *closing = line.to_owned();
            } else if let Some(skip) = line.strip_prefix("skip  ") {
                skips.push(skip.split(':').next().unwrap().to_owned());
            }
        }
    }
    let names: Vec<&str> = runs.iter().map(|(n, _, _)| n.as_str()).collect();
    assert_eq!(names, ["./examples/recall", "./examples/recall (unix socket)", "./examples/minimal"], "{report}");
    // The example engine, over TCP and a unix socket: every case passes but
    // those its feature set explains.
    let want = format!("{} passed, 0 failed, {} skipped", CASES.len() - EXPECTED_SKIPS.len(), EXPECTED_SKIPS.len());
    for (name, closing, skips) in &runs[..2] {
        assert_eq!(closing, &want, "{name}:\n{report}");
        assert_eq!(skips, &EXPECTED_SKIPS, "{name}:\n{report}");
    }
    // The docs' minimal engine: no case fails.
    assert!(runs[2].1.contains(" passed, 0 failed, "), "{report}");
    assert!(stdout.contains("check.sh: the Go SDK passes"), "{report}");
}
