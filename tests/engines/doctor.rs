//! `ctxgate doctor` against real engine processes: an incompatible engine
//! is reported and `--fix` resets the slot; a compatible one passes; the
//! CLI lists engines and re-admits a quarantined one.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use ctxgate_tests::hosting::*;
use ctxgate_tests::write_file;

#[tokio::test]
async fn doctor_reports_an_incompatible_engine_and_fix_resets_the_slot() {
    let engine = fault_engine("needs-threads").await;
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "{{\n  // the fixture needs a host we are not\n  plugins: {{ slots: {{ contextEngine: 'fault' }}, entries: {{ fault: {{ endpoint: '{}' }} }} }},\n}}\n",
        engine.endpoint
    );
    let path = write_file(dir.path(), "ctxgate.json5", &text);
    let p = path.to_str().unwrap();

    let (code, out) = ctxgate(&["doctor", "--config", p]).await;
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("- plugins.slots.contextEngine: context engine \"fault\" is incompatible with ctxgate embedded runner (agents.defaults). Missing host capabilities: thread-bootstrap-projection."), "{out}");
    assert!(out.contains("Run \"ctxgate doctor --fix\" to remove the plugins.slots.contextEngine override"), "{out}");

    let (code, out) = ctxgate(&["doctor", "--config", p, "--fix"]).await;
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("Reset plugins.slots.contextEngine to the default \"legacy\""), "{out}");
    assert_eq!(std::fs::read_to_string(path.with_extension("json5.bak")).unwrap(), text, "the original is kept");
    let (code, out) = ctxgate(&["doctor", "--config", p]).await;
    assert_eq!(code, Some(0));
    assert!(out.contains("nothing to check"), "{out}");
}

#[tokio::test]
async fn doctor_passes_a_compatible_engine_and_the_cli_lists_and_readmits_engines() {
    let engine = fault_engine("garbage").await;
    let dir = tempfile::tempdir().unwrap();
    let path = write_file(dir.path(), "ctxgate.json5", &hosting_json5("fault", &engine.endpoint));
    let (code, out) = ctxgate(&["doctor", "--config", path.to_str().unwrap()]).await;
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("health: SERVING") && out.contains("host requirements: met"), "{out}");

    let g = attached_gateway("fault", &engine.endpoint, &[]).await;
    run_turn(&g, "cli", "make it fail").await;
    let (_, out) = ctxgate(&["engines", "ls", "--gateway", &g.endpoint, "--json"]).await;
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v[1]["id"], "fault");
    assert_eq!(v[1]["quarantine"]["operation"], "Assemble");
    assert!(v[1]["methods"].as_array().unwrap().iter().any(|m| m["method"] == "Assemble" && m["failures"] == 1));
    let (code, out) = ctxgate(&["engines", "readmit", "fault", "--gateway", &g.endpoint]).await;
    assert_eq!(code, Some(0));
    assert!(out.contains("re-admitted"), "{out}");
    g.stop().await;
}
