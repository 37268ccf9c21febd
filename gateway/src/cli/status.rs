//! `ctxgate status`: the gateway's model, engines, sessions and outbox.

use ctxgate_proto::gateway as api;
use serde_json::json;

use super::render::{engine_json, outbox_json, print_engine, print_outbox_row};
use super::{CliError, Conn, connect};

pub async fn run(conn: &Conn, as_json: bool) -> Result<(), CliError> {
    let s = connect(conn).await?.get_status(api::StatusRequest {}).await?.into_inner();
    if as_json {
        let engines: Vec<_> = s.engines.iter().map(engine_json).collect();
        let v = json!({"version": s.version, "model_provider": s.model_provider, "model": s.model, "context_window": s.context_window,
            "selected_engine": s.selected_engine, "engines": engines, "sessions": s.sessions, "turns_in_flight": s.turns_in_flight, "turns_queued": s.turns_queued,
            "outbox_queued": s.outbox_queued, "outbox_blocked": s.outbox_blocked,
            "blocked_commits": s.blocked_commits.iter().map(outbox_json).collect::<Vec<_>>()});
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
        return Ok(());
    }
    println!("ctxgate {}", s.version);
    println!("model:    {} ({}), {}-token window", s.model, s.model_provider, s.context_window);
    println!("engine:   {}", s.selected_engine);
    for e in &s.engines {
        print_engine(e);
    }
    println!("sessions: {} active, {} turns running, {} queued", s.sessions, s.turns_in_flight, s.turns_queued);
    println!("outbox:   {} commit(s) queued, {} blocked by an engine's refusal", s.outbox_queued, s.outbox_blocked);
    s.blocked_commits.iter().for_each(print_outbox_row);
    Ok(())
}
