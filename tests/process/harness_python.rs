//! The Python harness client's example agent, as a user runs it: the
//! `ctxgate` binary and the window engine as processes, a local
//! OpenAI-compatible model that calls tools, and
//! `gateway/clients/python/run.sh example` driving 20 turns.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::time::Duration;

use ctxgate_proto::pb::{Role, content_part::Part, transcript_entry::Entry};
use ctxgate_tests::fake_openai::{FakeOpenAi, Kind, Reply};
use ctxgate_tests::hosting::{hosting_json5, transcript};
use ctxgate_tests::{gateway_client, repo_root, serve, start_window, write_file};

const TURNS: usize = 20;

#[tokio::test]
async fn the_python_example_agent_drives_twenty_tool_turns_through_the_window_engine() {
    let dir = tempfile::tempdir().unwrap();
    let window_state = dir.path().join("window");
    let engine = start_window(&window_state, &[]).await;
    let config = write_file(dir.path(), "ctxgate.json5", &hosting_json5("window", &engine.endpoint));
    let gw = serve(&dir.path().join("gateway"), Some(&config)).await;
    let model = FakeOpenAi::start().await;
    model.turn_default(Reply::ToolLoop);
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    std::fs::write(work.join("notes.txt"), "the launch code is 7731").unwrap();

    let run = tokio::process::Command::new(repo_root().join("gateway/clients/python/run.sh"))
        .args(["example", "--gateway", &gw.endpoint, "--model-url", &model.base_url, "--model", "fake"])
        .args(["--session", "py", "--turns", &TURNS.to_string(), "--workdir", work.to_str().unwrap()])
        .kill_on_drop(true)
        .output();
    // The first run creates the client's venv from PyPI.
    let out = tokio::time::timeout(Duration::from_secs(600), run).await.expect("the example finishes").unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));

    // Each turn: two model calls, each right after a context; two tool calls.
    let reports: Vec<serde_json::Value> = stdout.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(reports.len(), TURNS, "{stdout}");
    for (n, r) in reports.iter().enumerate() {
        assert_eq!(r["turn"], n, "{r}");
        assert_eq!(r["model_calls"], 2, "{r}");
        assert_eq!(r["contexts"], r["model_calls"], "a context before every model call: {r}");
        assert_eq!(r["tool_calls"], 2, "{r}");
        assert_eq!(r["engine"], "window", "{r}");
        assert_eq!(r["engine_committed"], true, "{r}");
        let reply = r["reply"].as_str().unwrap();
        assert!(reply.contains("7731") && reply.contains(&(n * 7 + 1).to_string()), "the tools ran: {r}");
    }
    assert_eq!(model.count(Kind::Turn), 2 * TURNS);

    // The transcript: per turn user, tool calls, their results, the answer.
    let entries = transcript(&gateway_client(&gw.endpoint), "py").await;
    let messages: Vec<_> =
        entries.iter().filter_map(|e| if let Some(Entry::Message(m)) = &e.entry { Some(m) } else { None }).collect();
    assert_eq!(messages.len(), TURNS * 5);
    for turn in messages.chunks(5) {
        let roles: Vec<Role> = turn.iter().map(|m| Role::try_from(m.role).unwrap()).collect();
        assert_eq!(roles, [Role::User, Role::Assistant, Role::Tool, Role::Tool, Role::Assistant]);
        let calls: Vec<&str> = turn[1]
            .content
            .iter()
            .filter_map(|p| if let Some(Part::ToolCall(c)) = &p.part { Some(c.id.as_str()) } else { None })
            .collect();
        let answered: Vec<&str> = turn[2..4]
            .iter()
            .flat_map(|m| &m.content)
            .filter_map(|p| if let Some(Part::ToolResult(r)) = &p.part { Some(r.tool_call_id.as_str()) } else { None })
            .collect();
        assert_eq!(calls.len(), 2);
        assert_eq!(calls, answered, "every tool call is followed by its result, in order");
    }

    // The window engine's own record: each turn once, every message once.
    let db = rusqlite::Connection::open(window_state.join("window.sqlite")).unwrap();
    let commits: i64 = db.query_row("SELECT COUNT(*) FROM commits", [], |r| r.get(0)).unwrap();
    assert_eq!(commits, TURNS as i64);
    let mut stmt = db.prepare("SELECT id FROM messages ORDER BY seq").unwrap();
    let held: Vec<String> = stmt.query_map([], |r| r.get(0)).unwrap().map(Result::unwrap).collect();
    let ids: Vec<String> = messages.iter().map(|m| m.id.clone()).collect();
    assert_eq!(held, ids);
    drop(engine);
}
