//! The TypeScript engine SDK (engine-sdk/typescript): its own test suite
//! (node's test runner: every guarantee, the shared validation vectors, the
//! hostile host stream) and the conformance kit against its example engine,
//! both run by the SDK's script, which installs what it needs (Node from
//! PyPI when the machine's is older than 20, npm ci, the build).

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::time::Duration;

use ctxgate_tests::run_script;

/// The conformance kit's closing line, `N passed, N failed, N skipped`.
pub(crate) fn kit_closing_line(output: &str) -> (usize, usize, usize) {
    let line = output
        .lines()
        .rev()
        .find(|l| l.contains(" passed, ") && l.contains(" skipped"))
        .unwrap_or_else(|| panic!("no closing line from the kit:\n{output}"));
    let n: Vec<usize> =
        line.split(|c: char| !c.is_ascii_digit()).filter(|w| !w.is_empty()).map(|w| w.parse().unwrap()).collect();
    (n[0], n[1], n[2])
}

#[tokio::test]
async fn the_typescript_sdk_passes_its_tests_and_its_example_engine_passes_the_kit() {
    let (ok, out) = run_script("engine-sdk/typescript/run-tests.sh", Duration::from_secs(900)).await;
    eprintln!("{out}");
    assert!(ok, "engine-sdk/typescript/run-tests.sh failed");
    // node's test runner: every test passed.
    assert!(out.lines().any(|l| l.trim() == "ℹ fail 0"), "the SDK's tests: {out}");
    for name in [
        "every request vector is accepted or refused as it says",
        "every result vector is accepted or refused as it says",
        "a client cancel reaches the method's AbortSignal within 50 ms",
        "a hostile host streaming transcript chunks for ever",
        "SIGTERM drains",
    ] {
        assert!(out.lines().any(|l| l.contains('✔') && l.contains(name)), "test {name:?} did not pass: {out}");
    }
    // Each engine the script runs the kit against passes it.
    let cases = ctxgate_engine_sdk::conformance::CASES.len();
    for (section, expected_skips) in [
        ("the conformance kit against the docs' minimal engine", None),
        ("the conformance kit against the example engine", Some(1)),
        ("the packed SDK in a project of its own", None),
    ] {
        let (passed, failed, skipped) = kit_closing_line(section_of(&out, section));
        assert_eq!((failed, passed + skipped), (0, cases), "{section}: {out}");
        // The example implements everything but subagent hooks.
        if let Some(expected) = expected_skips {
            assert_eq!(skipped, expected, "{section}: {out}");
        }
    }
}

/// The output under the script's `== HEADING` line that starts with
/// `heading`, up to the next `== ` line.
pub(crate) fn section_of<'a>(output: &'a str, heading: &str) -> &'a str {
    let start = output.find(&format!("== {heading}")).unwrap_or_else(|| panic!("no section {heading:?} in:\n{output}"));
    let body = &output[start + 3..];
    let body = &body[body.find('\n').map_or(body.len(), |i| i + 1)..];
    body.find("\n== ").map_or(body, |end| &body[..end + 1])
}
