//! The `crash-matrix` binary, briefly: four rounds of SIGKILLs of the
//! gateway and the durable window engine at random turn stages lose,
//! duplicate and corrupt nothing (`crash-matrix --rounds 100` is the long
//! run).

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::process::Command;

#[test]
fn four_rounds_of_crashes_lose_duplicate_and_corrupt_nothing() {
    let out = Command::new(ctxgate_tests::bin("crash-matrix"))
        .args(["--rounds", "4"])
        // The gateway and the engine inherit these: only their warnings.
        .env("CTXGATE_LOG", "warn")
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "crash-matrix failed ({}):\n{stdout}\n{stderr}", out.status);
    let line = stdout.lines().rev().find(|l| l.starts_with("crash matrix: ")).unwrap_or_else(|| {
        panic!("no summary line:\n{stdout}\n{stderr}");
    });
    assert!(line.contains(", 0 duplicates, 0 lost, 0 corrupt"), "{line}\n{stderr}");
    let accepted: u64 =
        line.split(", ").find_map(|part| part.strip_suffix(" turns accepted")).unwrap().parse().unwrap();
    assert!(accepted >= 1, "no turn was accepted: {line}\n{stderr}");
}
