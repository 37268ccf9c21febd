//! `cargo bench -p ctxgate-engine-window --bench search`: `history_search`
//! over one session of 100,000 stored messages, through the engine's gRPC
//! service (the SDK's server on loopback), p50 and p99 of 500 searches for
//! identifiers planted across the whole history, and `history_read` of a
//! 20-message range. Set `CTXGATE_BENCH_QUICK=1` for 10,000 messages.

#![allow(clippy::unwrap_used)] // a benchmark fails loudly

use std::time::{Duration, Instant};

use ctxgate_engine_sdk::pb;
use ctxgate_engine_sdk::testkit::{TestEngine, msg};
use ctxgate_engine_window::{Config, WindowEngine};

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn call(name: &str, arguments: String) -> pb::CallToolRequest {
    pb::CallToolRequest {
        session_id: "bench".into(),
        tool_call_id: "c".into(),
        name: name.into(),
        arguments_json: arguments,
        ..Default::default()
    }
}

#[tokio::main]
async fn main() {
    let n: usize = if std::env::var_os("CTXGATE_BENCH_QUICK").is_some() { 10_000 } else { 100_000 };
    let dir = tempfile::tempdir().unwrap();
    let engine = TestEngine::start(WindowEngine::open(dir.path(), Config::default()).unwrap()).await.unwrap();
    let mut c = engine.client.clone();
    let started = Instant::now();
    for chunk in (0..n).collect::<Vec<_>>().chunks(1_000) {
        let messages = chunk
            .iter()
            .map(|i| {
                let text = format!("message {i}: the build ID-{i:06}-XQ passed; {}", "notes on the rollout ".repeat(6));
                if i % 2 == 0 { msg::user(&format!("m{i}"), &text) } else { msg::assistant(&format!("m{i}"), &text) }
            })
            .collect();
        let r = pb::IngestBatchRequest { session_id: "bench".into(), messages, ..Default::default() };
        c.ingest_batch(r).await.unwrap();
    }
    println!("stored {n} messages in {:.1} s (indexed as they arrive)", started.elapsed().as_secs_f64());
    let mut took = Vec::new();
    for k in 0..500usize {
        let i = (k * 7919) % n;
        let started = Instant::now();
        let r = c.call_tool(call("history_search", format!(r#"{{"query":"ID-{i:06}-XQ"}}"#))).await.unwrap();
        took.push(started.elapsed());
        let r = r.into_inner();
        let text = match r.content.first().and_then(|p| p.part.as_ref()) {
            Some(pb::content_part::Part::Text(t)) => t.clone(),
            _ => String::new(),
        };
        assert!(!r.is_error && text.contains(&format!("#{} ", i + 1)), "{text}");
    }
    took.sort();
    println!(
        "history_search over {n} messages: p50 {:.2} ms, p99 {:.2} ms (500 searches)",
        percentile(&took, 0.5).as_secs_f64() * 1e3,
        percentile(&took, 0.99).as_secs_f64() * 1e3
    );
    let mut took = Vec::new();
    for k in 0..200usize {
        let from = (k * 131) % (n - 20) + 1;
        let started = Instant::now();
        c.call_tool(call("history_read", format!(r#"{{"from_seq":{from},"to_seq":{}}}"#, from + 19))).await.unwrap();
        took.push(started.elapsed());
    }
    took.sort();
    println!(
        "history_read of 20 messages: p50 {:.2} ms, p99 {:.2} ms (200 reads)",
        percentile(&took, 0.5).as_secs_f64() * 1e3,
        percentile(&took, 0.99).as_secs_f64() * 1e3
    );
    engine.stop().await;
}
