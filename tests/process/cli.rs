//! The `ctxgate` binary as a user runs it: serve, chat, compact, sessions,
//! status, health; clear errors for bad config and an unreachable gateway.
//! Its small-window config serves crash_recovery.rs too.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use ctxgate_tests::{bin, serve, write_file};
use tokio::process::Command;

/// A config that compacts often: a small window and a short kept tail.
pub(crate) const SMALL_WINDOW: &str = "{
  models: { contextWindow: 3000, maxOutputTokens: 200 },
  agents: { defaults: { compaction: { keepRecentTokens: 300, reserveTokens: 300 } } },
}";

async fn ctxgate(args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(bin("ctxgate")).args(args).output().await.unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn the_cli_chats_compacts_and_shows_sessions() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_file(dir.path(), "ctxgate.json5", SMALL_WINDOW);
    let gw = serve(&dir.path().join("state"), Some(&config)).await;
    let url = gw.endpoint.as_str();

    for i in 0..12 {
        let msg = format!("Message {i}: remember ticket OPS-{i}0 and keep it. {}", "words ".repeat(60));
        let (code, out, err) = ctxgate(&["chat", "--gateway", url, "--session", "demo", "-m", &msg]).await;
        assert_eq!(code, Some(0), "{err}");
        assert!(out.starts_with("(offline model)"), "{out}");
    }
    let (code, out, _) = ctxgate(&["compact", "--gateway", url, "--session", "demo"]).await;
    assert_eq!(code, Some(0));
    assert!(out.contains("compacted"), "{out}");

    let (code, out, _) = ctxgate(&["sessions", "show", "demo", "--gateway", url]).await;
    assert_eq!(code, Some(0));
    assert!(out.contains("── compaction summary"), "{out}");
    assert!(out.contains("## Exact identifiers") && out.contains("OPS-10"), "{out}");

    let (_, out, _) = ctxgate(&["sessions", "show", "demo", "--gateway", url, "--json"]).await;
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["entries"][0]["kind"], "compaction");
    assert_eq!(v["session"]["session_key"], "demo");

    let (_, out, _) = ctxgate(&["sessions", "ls", "--gateway", url, "--json"]).await;
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(v[0]["compactions"].as_u64().unwrap() >= 1);

    // Interactive chat reads lines from stdin and understands its commands.
    let mut child = Command::new(bin("ctxgate"))
        .args(["chat", "--gateway", url, "--session", "interactive"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use tokio::io::AsyncWriteExt;
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"first line\n/new\nsecond line\n/quit\n").await.unwrap();
    drop(stdin);
    let out = child.wait_with_output().await.unwrap();
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(stdout.matches("(offline model)").count(), 2, "{stdout}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("New session"), "/new was understood");
    let (_, out, _) = ctxgate(&["sessions", "show", "interactive", "--gateway", url, "--json"]).await;
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["entries"].as_array().unwrap().len(), 2, "/new started a fresh session: only the second exchange");

    let (_, out, _) = ctxgate(&["status", "--gateway", url, "--json"]).await;
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["selected_engine"], "legacy");
    assert_eq!(v["context_window"], 3000);
}

#[tokio::test]
async fn bad_config_and_an_unreachable_gateway_read_like_sentences() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.json5");
    std::fs::write(&bad, "{ agents: { defaults: { compaction: { timeoutSecs: 5 } } } }").unwrap();
    let (code, out, err) = ctxgate(&["serve", "--config", bad.to_str().unwrap(), "--listen", "127.0.0.1:0"]).await;
    assert_eq!(code, Some(1));
    assert!(out.is_empty(), "nothing was bound: {out}");
    assert!(err.contains("agents.defaults.compaction") && err.contains("timeoutSecs"), "{err}");

    let (code, _, err) = ctxgate(&["status", "--gateway", "http://127.0.0.1:1"]).await;
    assert_eq!(code, Some(1));
    assert!(err.contains("Cannot reach the gateway at http://127.0.0.1:1"), "{err}");
    let (code, _, err) = ctxgate(&["chat", "--gateway", "http://127.0.0.1:1", "-m", "hi"]).await;
    assert_eq!(code, Some(1));
    assert!(err.contains("ctxgate serve"), "{err}");
}

#[tokio::test]
async fn an_open_client_api_without_authentication_does_not_start() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let serve_on = |listen: &'static str, extra: Vec<(&'static str, &'static str)>| {
        let mut cmd = Command::new(bin("ctxgate"));
        cmd.args(["serve", "--listen", listen, "--state-dir", state.to_str().unwrap()]);
        cmd.env_remove("CTXGATE_AUTH_TOKEN").envs(extra).kill_on_drop(true);
        cmd
    };
    // Bounded: a gateway that did start would serve for ever.
    let out = tokio::time::timeout(ctxgate_tests::PATIENCE, serve_on("0.0.0.0:0", vec![]).output())
        .await
        .expect("the gateway started on 0.0.0.0 without authentication")
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(out.stdout.is_empty(), "nothing was bound: {}", String::from_utf8_lossy(&out.stdout));
    for key in ["gateway.auth.token", "gateway.tls.clientCa", "gateway.allowUnauthenticated"] {
        assert!(err.contains(key), "the refusal names {key}: {err}");
    }
    // With a token it serves.
    let g = ctxgate_tests::EngineProcess::spawn(serve_on(
        "0.0.0.0:0",
        vec![("CTXGATE_AUTH_TOKEN", "a-secret-of-16-chars")],
    ))
    .await;
    assert!(g.is_ok(), "a token lets it listen on 0.0.0.0: {:?}", g.err());
}

#[tokio::test]
async fn health_subcommands_exit_zero_when_serving_and_one_with_a_sentence_otherwise() {
    let dir = tempfile::tempdir().unwrap();
    let gw = serve(&dir.path().join("state"), None).await;
    let (code, out, err) = ctxgate(&["health", "--gateway", &gw.endpoint]).await;
    assert_eq!((code, out.trim()), (Some(0), "SERVING"), "{err}");
    let (code, _, err) = ctxgate(&["health", "--gateway", "http://127.0.0.1:1"]).await;
    assert_eq!(code, Some(1));
    assert!(err.contains("Cannot reach the gateway at http://127.0.0.1:1"), "{err}");

    let engine = ctxgate_tests::start_window(&dir.path().join("window"), &[]).await;
    let check = async |endpoint: &str| {
        let out = Command::new(bin("ctxgate-engine-window")).args(["health", "--endpoint", endpoint]).output().await;
        let out = out.unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, out, err) = check(&engine.endpoint).await;
    assert_eq!((code, out.trim()), (Some(0), "SERVING"), "{err}");
    let (code, _, err) = check("127.0.0.1:1").await;
    assert_eq!(code, Some(1));
    assert!(err.starts_with("ctxgate-engine-window: the engine at 127.0.0.1:1 cannot be checked"), "{err}");
}

#[tokio::test]
async fn chat_shows_engine_tool_calls_and_the_cli_lists_tools_and_the_context() {
    let dir = tempfile::tempdir().unwrap();
    let engine = ctxgate_tests::start_window(&dir.path().join("window"), &[]).await;
    let config =
        write_file(dir.path(), "ctxgate.json5", &ctxgate_tests::hosting::hosting_json5("window", &engine.endpoint));
    let gw = serve(&dir.path().join("state"), Some(&config)).await;
    let url = gw.endpoint.as_str();
    let chat = async |msg: &str| ctxgate(&["chat", "--gateway", url, "--session", "tools", "-m", msg]).await;
    // The engine attaches in the background: the first turns may run on legacy.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    loop {
        let (_, out, _) = ctxgate(&["engines", "tools", "window", "--gateway", url]).await;
        if out.contains("history_search") {
            assert!(out.contains("window: history_read"), "{out}");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the window engine never offered its tools: {out}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let (code, _, err) = chat("The invoice number is INV-90210.").await;
    assert_eq!(code, Some(0), "{err}");
    let (code, out, err) = chat("search history for INV-90210").await;
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("[tool] history_search {\"query\":\"INV-90210\"}"), "{err}");
    assert!(err.contains("[tool result] history_search:") && err.contains("INV-90210"), "{err}");
    assert!(out.contains("(offline model) The tool answered:"), "{out}");

    let (code, out, err) = ctxgate(&["sessions", "context", "tools", "--gateway", url]).await;
    assert_eq!(code, Some(0), "{err}");
    assert!(out.starts_with("engine window:"), "{out}");
    assert!(out.contains("system prompt addition:") && out.contains("tool history_search:"), "{out}");
    assert!(out.contains("[raw    ]") && out.contains("INV-90210"), "{out}");
    let (_, json, _) = ctxgate(&["sessions", "context", "tools", "--gateway", url, "--json"]).await;
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["engine_id"], "window");
    assert_eq!(v["engine_tools"][0]["name"], "history_search");
    // Looking changed nothing: the same context again.
    let (_, again, _) = ctxgate(&["sessions", "context", "tools", "--gateway", url, "--json"]).await;
    assert_eq!(json, again);
    let (code, _, err) = ctxgate(&["sessions", "context", "nobody", "--gateway", url]).await;
    assert_eq!(code, Some(1));
    assert!(err.contains("no session"), "{err}");
}

/// The token from a file, so it never shows in `ps`; a file that cannot
/// be read is named.
#[tokio::test]
async fn the_cli_reads_its_token_from_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let config = ctxgate_tests::write_file(d, "c.json5", "{ gateway: { auth: { token: 'a-secret-of-16-chars' } } }");
    let gw = serve(&d.join("state"), Some(&config)).await;
    let token = ctxgate_tests::write_file(d, "token", "a-secret-of-16-chars\n");
    let (code, _, err) = ctxgate(&["status", "--gateway", &gw.endpoint, "--token-file", token.to_str().unwrap()]).await;
    assert_eq!(code, Some(0), "{err}");
    let (code, _, err) = ctxgate(&["status", "--gateway", &gw.endpoint]).await;
    assert_eq!(code, Some(1), "no token: {err}");
    let missing = d.join("nowhere");
    let (code, _, err) =
        ctxgate(&["status", "--gateway", &gw.endpoint, "--token-file", missing.to_str().unwrap()]).await;
    assert_eq!(code, Some(1));
    assert!(err.contains("--token-file") && err.contains("nowhere"), "{err}");
    let empty = ctxgate_tests::write_file(d, "empty", "\n");
    let (code, _, err) = ctxgate(&["status", "--gateway", &gw.endpoint, "--token-file", empty.to_str().unwrap()]).await;
    assert_eq!(code, Some(1));
    assert!(err.contains("it is empty"), "{err}");
    // The file wins over a token in the environment (a stale one, say).
    let out = tokio::process::Command::new(bin("ctxgate"))
        .args(["status", "--gateway", &gw.endpoint, "--token-file", token.to_str().unwrap()])
        .env("CTXGATE_AUTH_TOKEN", "a-stale-token-of-16-chars")
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
}
