//! The Python engine SDK (engine-sdk/python) from `cargo test`: its own
//! checks (`engine-sdk/python/test.sh`: a venv from PyPI on first use, mypy
//! --strict over the SDK and its tests, pytest — the shared validation
//! vectors, cancellation, deadlines, drain, the host allow-list and read cap,
//! TLS reload, tracing, the wheel) and the conformance kit against the SDK's
//! example engine as a process.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use ctxgate_tests::{EngineProcess, bin, repo_root};

#[tokio::test]
async fn the_python_sdk_passes_mypy_strict_and_its_pytest_suite() {
    let out = tokio::process::Command::new(repo_root().join("engine-sdk/python/test.sh")).output().await.unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    eprintln!("{stdout}");
    assert!(out.status.success(), "engine-sdk/python/test.sh failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("Success: no issues found"), "mypy --strict: {stdout}");
    // pytest's closing line: "N passed in S s", no failures, no errors.
    let closing = stdout.lines().rev().find(|l| l.contains(" passed")).expect("a pytest closing line");
    let passed: usize = closing.trim().split(' ').next().unwrap().parse().unwrap();
    assert!(passed >= 25 && !closing.contains("failed") && !closing.contains("error"), "{closing}");
}

#[tokio::test]
async fn the_python_sdk_example_engine_passes_the_conformance_kit() {
    let state = tempfile::tempdir().unwrap();
    let args = ["--listen", "127.0.0.1:0", "--state-dir", state.path().to_str().unwrap()];
    let engine = EngineProcess::start(repo_root().join("engine-sdk/python/run.sh"), &args).await.unwrap();
    let out = tokio::process::Command::new(bin("ctxgate-conformance"))
        .args(["--endpoint", &engine.endpoint, "--case-timeout-ms", "20000"])
        .output()
        .await
        .unwrap();
    let report = String::from_utf8_lossy(&out.stdout);
    eprintln!("{report}");
    assert_eq!(out.status.code(), Some(0), "{report}");
    let closing = report.lines().last().unwrap();
    assert!(closing.contains(" passed, 0 failed"), "{closing}");
    // The example keeps no commit keys and spawns no subagents: those cases
    // cannot run. Everything else, tools and DELTA history included, passes.
    let skipped: Vec<&str> = report.lines().filter_map(|l| l.strip_prefix("skip  ")).collect();
    for s in &skipped {
        assert!(
            s.starts_with("commit_turn.committed_then_duplicate")
                || s.starts_with("subagent.prepare_then_rollback_twice"),
            "unexpected skip: {s}"
        );
    }
    assert!(report.lines().any(|l| l == "pass  tools.each_declared_tool_answers"), "{report}");
    assert!(report.lines().any(|l| l == "pass  delta.unknown_cursor_is_a_history_gap"), "{report}");
}

/// docs/engines-in-python.md's minimal engine, copied out of the page and
/// run with the page's command, passes the kit (what it does not declare —
/// DELTA, CommitTurn, subagents, tools — is skipped).
#[tokio::test]
async fn the_minimal_python_engine_in_the_docs_passes_the_conformance_kit() {
    let page = std::fs::read_to_string(repo_root().join("docs/engines-in-python.md")).unwrap();
    let code = page.split_once("```python\n").unwrap().1.split_once("```").unwrap().0;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("my_engine.py");
    std::fs::write(&file, code).unwrap();
    let args = ["python", file.to_str().unwrap(), "--listen", "127.0.0.1:0"];
    let engine = EngineProcess::start(repo_root().join("engine-sdk/python/run.sh"), &args).await.unwrap();
    let out = tokio::process::Command::new(bin("ctxgate-conformance"))
        .args(["--endpoint", &engine.endpoint, "--case-timeout-ms", "20000"])
        .output()
        .await
        .unwrap();
    let report = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{report}");
    assert_eq!(report.lines().last(), Some("19 passed, 0 failed, 9 skipped"), "the page says so:\n{report}");
}
