//! `ctxgate sessions ls|show|context`: the gateway's sessions, one
//! session's history (every page of either), and what its engine would
//! assemble now.

use clap::Subcommand;
use ctxgate_proto::gateway as api;
use ctxgate_proto::pb::transcript_entry::Entry;
use serde_json::json;

use super::{CliError, Conn, connect};
use crate::provider::message_text;
use crate::summarize::role_name;

#[derive(Subcommand, Debug)]
pub enum SessionsCommand {
    Ls {
        #[command(flatten)]
        conn: Conn,
        /// Include archived sessions.
        #[arg(long)]
        all: bool,
        #[arg(long)]
        json: bool,
    },
    /// A session's visible history, summaries included.
    Show {
        #[command(flatten)]
        conn: Conn,
        /// The session key.
        key: String,
        #[arg(long, default_value = "main")]
        agent: String,
        /// The whole branch, not just the visible history.
        #[arg(long)]
        full: bool,
        #[arg(long)]
        json: bool,
    },
    /// What the session's engine would assemble now — each message raw or
    /// summary with its tokens, the system prompt addition, the engine's
    /// tools — changing nothing.
    Context {
        #[command(flatten)]
        conn: Conn,
        /// The session key.
        key: String,
        #[arg(long, default_value = "main")]
        agent: String,
        #[arg(long)]
        json: bool,
    },
}

pub async fn run(cmd: SessionsCommand) -> Result<(), CliError> {
    match cmd {
        SessionsCommand::Context { conn, key, agent, json } => {
            let r = api::SessionRef { agent_id: agent, session_key: key };
            let p = connect(&conn).await?.preview_context(r).await?.into_inner();
            if json {
                println!("{}", serde_json::to_string_pretty(&preview_json(&p)).unwrap_or_default());
                return Ok(());
            }
            println!(
                "engine {}: {} messages, about {} of {} tokens",
                p.engine_id,
                p.messages.len(),
                p.estimated_tokens,
                p.token_budget
            );
            if let Some(addition) = &p.system_prompt_addition {
                println!("system prompt addition: {}", addition.trim());
            }
            for m in &p.messages {
                let Some(msg) = &m.message else { continue };
                let role = role_name(msg.role);
                let text: String = message_text(msg).chars().take(200).collect();
                println!("[{:<7}] {:>6} tok  {role}: {}", m.kind, m.tokens, text.replace('\n', " "));
            }
            for t in &p.engine_tools {
                println!("tool {}: {}", t.name, t.description.lines().next().unwrap_or_default());
            }
        }
        SessionsCommand::Ls { conn, all, json } => {
            let mut client = connect(&conn).await?;
            let mut sessions = Vec::new();
            let mut page_token = String::new();
            // Every page (each is bounded by the gateway).
            loop {
                let req = api::ListSessionsRequest { agent_id: None, include_archived: all, page_size: 0, page_token };
                let page = client.list_sessions(req).await?.into_inner();
                sessions.extend(page.sessions);
                if page.next_page_token.is_empty() {
                    break;
                }
                page_token = page.next_page_token;
            }
            if json {
                let rows: Vec<_> = sessions.iter().map(session_json).collect();
                println!("{}", serde_json::to_string_pretty(&rows).unwrap_or_default());
            } else if sessions.is_empty() {
                println!("No sessions yet. Start one with `ctxgate chat`.");
            } else {
                println!(
                    "{:<12} {:<24} {:<9} {:>7} {:>11}  SESSION ID",
                    "AGENT", "KEY", "STATE", "ENTRIES", "COMPACTIONS"
                );
                for s in sessions {
                    println!(
                        "{:<12} {:<24} {:<9} {:>7} {:>11}  {}",
                        s.agent_id, s.session_key, s.state, s.entries, s.compactions, s.session_id
                    );
                }
            }
        }
        SessionsCommand::Show { conn, key, agent, full, json } => {
            let mut client = connect(&conn).await?;
            let mut req = api::GetTranscriptRequest {
                session: Some(api::SessionRef { agent_id: agent, session_key: key }),
                visible_only: !full,
                ..Default::default()
            };
            let mut t = client.get_transcript(req.clone()).await?.into_inner();
            while !t.next_page_token.is_empty() {
                req.page_token = std::mem::take(&mut t.next_page_token);
                let page = client.get_transcript(req.clone()).await?.into_inner();
                t.entries.extend(page.entries);
                t.next_page_token = page.next_page_token;
            }
            if json {
                let entries: Vec<_> = t.entries.iter().map(entry_json).collect();
                println!(
                    "{}",
                    serde_json::to_string_pretty(
                        &json!({"session": t.session.as_ref().map(session_json), "entries": entries})
                    )
                    .unwrap_or_default()
                );
                return Ok(());
            }
            if let Some(s) = &t.session {
                println!(
                    "Session {} ({}/{}, {}): {} entries, {} compactions, ~{} visible tokens\n",
                    s.session_id, s.agent_id, s.session_key, s.state, s.entries, s.compactions, s.visible_tokens
                );
            }
            for e in &t.entries {
                match &e.entry {
                    Some(Entry::Message(m)) => println!("{}: {}\n", role_name(m.role), message_text(m)),
                    Some(Entry::Compaction(c)) => println!(
                        "── compaction summary ({} → {} tokens, kept from {}) ──\n{}\n──\n",
                        c.tokens_before,
                        c.tokens_after.unwrap_or_default(),
                        c.first_kept_entry_id,
                        c.summary.trim_end()
                    ),
                    None => {}
                }
            }
        }
    }
    Ok(())
}

fn preview_json(p: &api::ContextPreview) -> serde_json::Value {
    json!({
        "engine_id": p.engine_id,
        "estimated_tokens": p.estimated_tokens,
        "token_budget": p.token_budget,
        "system_prompt_addition": p.system_prompt_addition,
        "messages": p.messages.iter().map(|m| json!({
            "kind": m.kind,
            "tokens": m.tokens,
            "message": m.message.as_ref().map(|m| serde_json::to_value(m).unwrap_or_default()),
        })).collect::<Vec<_>>(),
        "engine_tools": p.engine_tools.iter().map(|t| serde_json::to_value(t).unwrap_or_default()).collect::<Vec<_>>(),
    })
}

fn session_json(s: &api::SessionInfo) -> serde_json::Value {
    json!({"agent_id": s.agent_id, "session_key": s.session_key, "session_id": s.session_id, "state": s.state,
           "created_at_unix_ms": s.created_at_unix_ms, "entries": s.entries, "compactions": s.compactions, "visible_tokens": s.visible_tokens})
}

fn entry_json(e: &ctxgate_proto::pb::TranscriptEntry) -> serde_json::Value {
    match &e.entry {
        Some(Entry::Message(m)) => {
            json!({"id": e.id, "seq": e.seq, "kind": "message", "role": role_name(m.role), "text": message_text(m)})
        }
        Some(Entry::Compaction(c)) => json!({"id": e.id, "seq": e.seq, "kind": "compaction", "summary": c.summary,
            "first_kept_entry_id": c.first_kept_entry_id, "tokens_before": c.tokens_before, "tokens_after": c.tokens_after}),
        None => json!({"id": e.id, "seq": e.seq, "kind": "unknown"}),
    }
}
