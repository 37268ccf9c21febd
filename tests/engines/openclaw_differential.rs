//! The OpenClaw host checked against OpenClaw itself: a recording probe
//! plugin (tests/openclaw-probe) is loaded by the real openclaw@2026.9.6
//! (`openclaw agent --local`, a local fake model) and by
//! engines/openclaw-host behind `ctxgate serve`, for the same two user
//! turns; every difference in the calls made and in their parameters'
//! shapes must be listed, with its reason, in
//! tests/openclaw-probe/KNOWN-DIFFERENCES.md. The script installs what it
//! needs (Node >= 24.16 from PyPI, OpenClaw from npm: ~650 MB under
//! target/openclaw-probe/ the first time) and bounds itself in time.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::time::Duration;

use ctxgate_tests::run_script;

/// The script's closing line: (calls compared, differences) when every
/// difference is listed.
fn closing_line(output: &str) -> Option<(usize, usize)> {
    let line = output.lines().rev().find(|l| l.starts_with("differential: "))?;
    let rest = line.strip_prefix("differential: ")?.strip_suffix(", all listed")?;
    let (calls, differences) = rest.split_once(" calls compared, ")?;
    let differences = differences.strip_suffix(" differences")?;
    Some((calls.parse().ok()?, differences.parse().ok()?))
}

#[tokio::test]
async fn the_host_calls_a_plugin_as_openclaw_does_but_for_the_listed_differences() {
    // ~1 min with OpenClaw installed (two OpenClaw turns are most of it);
    // the first run also installs OpenClaw and Node.
    let (ok, out) = run_script("tests/openclaw-probe/run.sh", Duration::from_secs(1200)).await;
    eprintln!("{out}");
    assert!(ok, "tests/openclaw-probe/run.sh failed");
    let (calls, _differences) =
        closing_line(&out).unwrap_or_else(|| panic!("no closing line `differential: … all listed`:\n{out}"));
    // Both sides ran both turns on the probe (the script refuses a run where
    // either assembled nothing), so there is something to compare.
    assert!(calls >= 8, "only {calls} calls compared:\n{out}");
}

#[test]
fn the_closing_line_is_read() {
    assert_eq!(closing_line("x\ndifferential: 24 calls compared, 83 differences, all listed\n"), Some((24, 83)));
    assert_eq!(closing_line("differential: 24 calls compared, 83 differences, 2 not listed in K.md"), None);
}
