//! The engine and outbox renderings `status` shares with `engines` and
//! `outbox`: one JSON shape and one text line for each.

use ctxgate_proto::gateway as api;
use serde_json::json;

pub(super) fn outbox_json(r: &api::OutboxRow) -> serde_json::Value {
    json!({"agent_id": r.agent_id, "session_key": r.session_key, "session_id": r.session_id,
        "advancement_key": r.advancement_key, "engine_id": r.engine_id, "engine_state": r.engine_state,
        "attempts": r.attempts, "blocked": r.blocked, "last_error": r.last_error,
        "next_attempt_unix_ms": r.next_attempt_unix_ms, "created_at_unix_ms": r.created_at_unix_ms})
}

pub(super) fn print_outbox_row(r: &api::OutboxRow) {
    let state = match (r.blocked, r.next_attempt_unix_ms == crate::core::HELD) {
        // The engine failed on it again and again: only an operator sends it.
        (true, true) => format!("HELD after {} attempt(s): retry or drop it", r.attempts),
        (true, false) => format!("BLOCKED after {} attempt(s)", r.attempts),
        _ => "queued".into(),
    };
    println!(
        "{:<12} {:<24} {:<34} {:<16} {state} (engine {})",
        r.agent_id, r.session_key, r.advancement_key, r.engine_id, r.engine_state
    );
    if let Some(e) = &r.last_error {
        println!("{:<12} last error: {e}", "");
    }
}

pub(super) fn forget_json(f: &api::OwedForget) -> serde_json::Value {
    json!({"agent_id": f.agent_id, "session_key": f.session_key, "session_id": f.session_id,
        "engine_id": f.engine_id, "engine_state": f.engine_state, "attempts": f.attempts,
        "last_error": f.last_error, "next_attempt_unix_ms": f.next_attempt_unix_ms})
}

pub(super) fn print_forget(f: &api::OwedForget) {
    let state = if f.attempts > 0 { format!("failed {} time(s)", f.attempts) } else { "queued".into() };
    println!(
        "{:<12} {:<24} {:<34} {:<16} {state} (engine {})",
        f.agent_id, f.session_key, f.session_id, f.engine_id, f.engine_state
    );
    if let Some(e) = &f.last_error {
        println!("{:<12} last error: {e}", "");
    }
}

pub(super) fn drop_json(d: &api::OutboxDrop) -> serde_json::Value {
    let kind = if d.advancement_key.is_empty() { "forget" } else { "commit" };
    json!({"kind": kind, "agent_id": d.agent_id, "session_key": d.session_key, "session_id": d.session_id,
        "advancement_key": d.advancement_key, "engine_id": d.engine_id, "attempts": d.attempts,
        "last_error": d.last_error, "dropped_at_unix_ms": d.dropped_at_unix_ms})
}

pub(super) fn print_drop(d: &api::OutboxDrop) {
    let what = if d.advancement_key.is_empty() { "(ForgetSession)" } else { d.advancement_key.as_str() };
    println!(
        "{:<17} {:<12} {:<24} {:<34} {}",
        utc_minute(d.dropped_at_unix_ms),
        d.agent_id,
        d.session_key,
        what,
        d.engine_id
    );
}

/// `YYYY-MM-DD HH:MM` (UTC) of a unix time in ms: the civil date from the
/// day count (H. Hinnant's `civil_from_days`), no time-zone crate for one column.
fn utc_minute(unix_ms: i64) -> String {
    let secs = unix_ms.div_euclid(1000);
    let (days, rest) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02} {:02}:{:02}", rest / 3600, rest % 3600 / 60)
}

#[cfg(test)]
#[test]
fn utc_minutes_are_civil_dates() {
    assert_eq!(utc_minute(0), "1970-01-01 00:00");
    assert_eq!(utc_minute(951_782_400_000), "2000-02-29 00:00");
    assert_eq!(utc_minute(1_796_180_520_000), "2026-12-02 03:02");
}

fn quarantine_json(q: &api::Quarantine) -> serde_json::Value {
    json!({"operation": q.operation, "reason": q.reason, "since_unix_ms": q.since_unix_ms})
}

pub(super) fn engine_json(e: &api::EngineStatus) -> serde_json::Value {
    json!({"id": e.id, "declared_id": e.declared_id, "name": e.name, "endpoint": e.endpoint, "health": e.health, "affinity": e.affinity,
        "quarantine": e.quarantine.as_ref().map(quarantine_json),
        "replicas": e.replicas.iter().map(|r| json!({"address": r.address, "health": r.health, "in_flight": r.in_flight, "calls": r.calls,
            "quarantine": r.quarantine.as_ref().map(quarantine_json)})).collect::<Vec<_>>(),
        "methods": e.methods.iter().map(|m| json!({"method": m.method, "calls": m.calls, "failures": m.failures, "timeouts": m.timeouts, "fallbacks": m.fallbacks, "shed": m.shed})).collect::<Vec<_>>()})
}

pub(super) fn print_engine(e: &api::EngineStatus) {
    let q =
        e.quarantine.as_ref().map_or(String::new(), |q| format!(", quarantined during {}: {}", q.operation, q.reason));
    // The entry id names the engine; the id it declares, when another, beside it.
    let declared = if e.declared_id.is_empty() || e.declared_id == e.id {
        String::new()
    } else {
        format!(", declares id {:?}", e.declared_id)
    };
    println!("  - {} ({}{declared}) at {}: {}{q}", e.id, e.name, e.endpoint, e.health);
    // One replica is the endpoint itself; several are worth a line each.
    if e.replicas.len() > 1 || e.endpoint.starts_with("dns:///") {
        let affinity = if e.affinity.is_empty() { String::new() } else { format!(" (affinity: {})", e.affinity) };
        println!("      {} replica(s){affinity}:", e.replicas.len());
        for r in &e.replicas {
            let q = r.quarantine.as_ref().map_or(String::new(), |q| format!(", quarantined: {}", q.reason));
            println!("        {:<24} {}{q}, {} in flight, {} calls", r.address, r.health, r.in_flight, r.calls);
        }
    }
    for m in &e.methods {
        println!(
            "      {:<22} {:>6} calls {:>4} failed {:>4} timed out {:>4} fell back {:>4} shed",
            m.method, m.calls, m.failures, m.timeouts, m.fallbacks, m.shed
        );
    }
}

/// A tool declaration as proto3 JSON (the contract's own mapping).
pub(super) fn tool_json(t: &ctxgate_proto::pb::ToolDefinition) -> serde_json::Value {
    serde_json::to_value(t).unwrap_or_default()
}
