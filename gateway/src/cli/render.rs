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

fn quarantine_json(q: &api::Quarantine) -> serde_json::Value {
    json!({"operation": q.operation, "reason": q.reason, "since_unix_ms": q.since_unix_ms})
}

pub(super) fn engine_json(e: &api::EngineStatus) -> serde_json::Value {
    json!({"id": e.id, "name": e.name, "endpoint": e.endpoint, "health": e.health, "affinity": e.affinity,
        "quarantine": e.quarantine.as_ref().map(quarantine_json),
        "replicas": e.replicas.iter().map(|r| json!({"address": r.address, "health": r.health, "in_flight": r.in_flight, "calls": r.calls,
            "quarantine": r.quarantine.as_ref().map(quarantine_json)})).collect::<Vec<_>>(),
        "methods": e.methods.iter().map(|m| json!({"method": m.method, "calls": m.calls, "failures": m.failures, "timeouts": m.timeouts, "fallbacks": m.fallbacks, "shed": m.shed})).collect::<Vec<_>>()})
}

pub(super) fn print_engine(e: &api::EngineStatus) {
    let q =
        e.quarantine.as_ref().map_or(String::new(), |q| format!(", quarantined during {}: {}", q.operation, q.reason));
    println!("  - {} ({}) at {}: {}{q}", e.id, e.name, e.endpoint, e.health);
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
