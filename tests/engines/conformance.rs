//! The conformance kit against real engine processes: the Rust window
//! engine and the Python engine pass it, the broken fixture fails it.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::time::Duration;

use ctxgate_engine_sdk::conformance::{Options, Outcome, Report, run};
use ctxgate_tests::hosting::broken_engine;
use ctxgate_tests::{EngineProcess, bin, start_window};

async fn kit(endpoint: &str, case_timeout: Duration) -> Report {
    let report =
        run(&Options { endpoint: endpoint.to_owned(), case_timeout, tls: None }).await.expect("valid endpoint");
    eprintln!("{}", report.to_text());
    report
}

fn assert_all_pass(report: &Report, allowed_skips: &[&str]) {
    assert_eq!(report.failed, 0, "{}", report.to_text());
    for c in &report.cases {
        if let Outcome::Skip(_) = c.outcome {
            assert!(allowed_skips.contains(&c.name), "unexpected skip of {}", c.name);
        }
    }
}

#[tokio::test]
async fn window_engine_passes_the_kit() {
    let dir = tempfile::tempdir().unwrap();
    let engine = start_window(dir.path(), &[]).await;
    let report = kit(&engine.endpoint, Duration::from_secs(10)).await;
    assert_all_pass(&report, &[]);
    assert_eq!(report.passed, ctxgate_engine_sdk::conformance::CASES.len());
}

#[tokio::test]
async fn window_engine_passes_the_kit_over_a_unix_socket() {
    let dir = tempfile::tempdir().unwrap();
    let socket = format!("unix://{}", dir.path().join("engine.sock").display());
    let state = dir.path().join("state");
    let args = ["--listen", socket.as_str(), "--state-dir", state.to_str().unwrap()];
    let engine = EngineProcess::start(bin("ctxgate-engine-window"), &args).await.unwrap();
    assert_eq!(engine.endpoint, socket);
    assert_all_pass(&kit(&engine.endpoint, Duration::from_secs(10)).await, &[]);
}

#[tokio::test]
async fn python_engine_passes_the_kit() {
    let state = tempfile::tempdir().unwrap();
    let engine = ctxgate_tests::start_python(state.path()).await;
    let report = kit(&engine.endpoint, Duration::from_secs(10)).await;
    // The Python engine has no subagent support, so that case cannot run.
    assert_all_pass(&report, &["subagent.prepare_then_rollback_twice"]);
}

#[tokio::test]
async fn broken_fixture_fails_the_kit_where_it_is_broken() {
    let engine = broken_engine(&[]).await;
    let report = kit(&engine.endpoint, Duration::from_secs(3)).await;
    let failed = |name: &str| matches!(report.outcome_of(name), Some(Outcome::Fail(_)));
    for name in [
        "health.check",
        "health.watch",
        "reflection.lists_services",
        "info.valid",
        "info.implemented_methods_match_behaviour",
        "ingest.idempotent_by_message_id",
        "assemble.answers_with_estimate",
        "assemble.keeps_message_order",
        "assemble.keeps_tool_pairs_under_budget",
        "compact.stream_ends_with_one_terminal_event",
        "commit_turn.committed_then_duplicate",
        "malformed.missing_session_id",
        "malformed.unknown_role",
        "malformed.oversized_content",
        "delta.assembles_from_the_cursor",
        "delta.unknown_cursor_is_a_history_gap",
        "delta.resend_after_a_gap_is_accepted",
    ] {
        assert!(failed(name), "{name} should fail against the broken fixture:\n{}", report.to_text());
    }
    // The hang is reported as one, not waited out.
    let Some(Outcome::Fail(reason)) = report.outcome_of("malformed.oversized_content") else { unreachable!() };
    assert!(reason.contains("hung"), "{reason}");
    // Its one honest answer passes.
    assert_eq!(report.outcome_of("info.id_not_reserved"), Some(&Outcome::Pass));
}

#[tokio::test]
async fn conformance_binary_prints_a_line_per_case_and_sets_its_exit_code() {
    let broken = broken_engine(&[]).await;
    let out = tokio::process::Command::new(bin("ctxgate-conformance"))
        .args(["--endpoint", &broken.endpoint, "--case-timeout-ms", "2000"])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), ctxgate_engine_sdk::conformance::CASES.len() + 1, "{text}");
    let last = lines.last().unwrap();
    let (passed, rest) = last.split_once(" passed, ").unwrap();
    let failed: usize = rest.split_once(" failed").unwrap().0.parse().unwrap();
    assert!(passed.parse::<usize>().is_ok() && failed > 0, "{last}");
    assert!(lines.iter().any(|l| l.starts_with("FAIL  info.valid: info.name")), "{text}");

    let dir = tempfile::tempdir().unwrap();
    let window = start_window(dir.path(), &[]).await;
    let out = tokio::process::Command::new(bin("ctxgate-conformance"))
        .args(["--endpoint", &window.endpoint, "--json"])
        .output()
        .await
        .unwrap();
    assert!(out.status.success());
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["failed"], 0);
    assert_eq!(json["cases"][0]["name"], "health.check");
    assert_eq!(json["cases"][0]["outcome"], "pass");

    let bad = tokio::process::Command::new(bin("ctxgate-conformance"))
        .args(["--endpoint", "ftp://nowhere"])
        .output()
        .await
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("invalid endpoint"));
}
