//! `history-bench`: per-turn latency against a session's age, legacy and
//! the window engine (a real process, DELTA history delivery) side by side
//! in one run, plus the window engine's Assemble alone on a 10,000-message
//! session with a cursor (a delta) and without one (the whole history).
//!
//! Sessions are seeded straight into the gateway's store (and, for the
//! window engine, into the engine with IngestBatch and a cursor), then a few
//! warm-up turns let compaction catch up, then `--turns` turns are timed.
//!
//!     cargo build --release --workspace && target/release/history-bench

use std::time::{Duration, Instant};

use clap::Parser;
use ctxgate::config::{Config, EngineEntry};
use ctxgate::store::{Cursors, NewEntry, Sessions, SqliteStore, Transcript};
use ctxgate_proto::gateway::{self as api, gateway_client::GatewayClient, turn_event::Event};
use ctxgate_proto::pb::{self, transcript_entry::Entry};
use ctxgate_tests::{EngineProcess, bin};
use tokio_stream::StreamExt;

#[derive(Parser)]
struct Args {
    /// Session ages to measure, in messages.
    #[arg(long, value_delimiter = ',', default_value = "100,1000,10000,50000")]
    ages: Vec<usize>,
    /// Timed turns per (engine, age).
    #[arg(long, default_value_t = 40)]
    turns: usize,
    #[arg(long, default_value_t = 3)]
    warmup: usize,
}

type R<T> = Result<T, Box<dyn std::error::Error>>;

fn text(i: usize) -> String {
    format!("message {i}: ticket OPS-{i} touches src/part_{}.rs; {}", i % 97, "words of context ".repeat(20))
}

fn message(i: usize) -> pb::AgentMessage {
    let role = if i.is_multiple_of(2) { pb::Role::User } else { pb::Role::Assistant };
    pb::AgentMessage {
        role: role as i32,
        content: vec![pb::ContentPart { part: Some(pb::content_part::Part::Text(text(i))) }],
        ..Default::default()
    }
}

/// Seeds `age` messages into a fresh gateway store; returns the stored ones.
async fn seed_gateway(dir: &std::path::Path, age: usize) -> R<(String, Vec<pb::AgentMessage>)> {
    let store = SqliteStore::open(dir)?;
    let s = store.session("main", "bench", true).await?.ok_or("no session")?;
    let mut stored = Vec::with_capacity(age);
    for chunk in (0..age).collect::<Vec<_>>().chunks(1_000) {
        let entries =
            chunk.iter().map(|&i| NewEntry { turn_id: format!("seed-{}", i / 2), entry: Entry::Message(message(i)) });
        for e in store.append(&s.session_id, entries.collect()).await? {
            if let Some(Entry::Message(m)) = e.entry {
                stored.push((m, e.seq));
            }
        }
    }
    if let Some((last, seq)) = stored.last() {
        let all: Vec<pb::AgentMessage> = stored.iter().map(|(m, _)| m.clone()).collect();
        let cursor = pb::HistoryCursor {
            message_id: last.id.clone(),
            seq: *seq,
            message_count: all.len() as u64,
            tokens: ctxgate_proto::estimate::messages_tokens(&all),
        };
        store.set_cursor(&s.session_id, "window", Some(cursor)).await?;
    }
    Ok((s.session_id, stored.into_iter().map(|(m, _)| m).collect()))
}

async fn seed_engine(endpoint: &str, session_id: &str, messages: &[pb::AgentMessage]) -> R<()> {
    let mut c = pb::context_engine_client::ContextEngineClient::connect(endpoint.to_owned()).await?;
    for chunk in messages.chunks(1_000) {
        let r = pb::IngestBatchRequest {
            session_id: session_id.into(),
            session_key: Some("bench".into()),
            messages: chunk.to_vec(),
            is_heartbeat: false,
        };
        c.ingest_batch(r).await?;
    }
    Ok(())
}

async fn turn(c: &mut GatewayClient<tonic::transport::Channel>, i: usize) -> R<Duration> {
    let started = Instant::now();
    let req = api::RunTurnRequest {
        session: Some(api::SessionRef { agent_id: String::new(), session_key: "bench".into() }),
        message: format!("new turn {i}: {}", text(i)),
        system_prompt: None,
        ..Default::default()
    };
    let mut stream = c.run_turn(req).await?.into_inner();
    let mut last = None;
    while let Some(e) = stream.next().await {
        last = e?.event;
    }
    match last {
        Some(Event::Completed(_)) => Ok(started.elapsed()),
        other => Err(format!("turn {i} did not complete: {other:?}").into()),
    }
}

fn quantile(sorted: &[Duration], q: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i].as_secs_f64() * 1e3
}

/// p50 and p99 of `turns` timed turns at `age` on `engine` ("legacy" or "window").
async fn measure(engine: &str, age: usize, args: &Args) -> R<(f64, f64)> {
    let dir = tempfile::tempdir()?;
    let gw_state = dir.path().join("gateway");
    let (session_id, messages) = seed_gateway(&gw_state, age).await?;
    let mut config = Config::default();
    let _window = if engine == "window" {
        let engine_state = dir.path().join("window");
        let state = engine_state.to_str().ok_or("utf-8")?;
        let p = EngineProcess::start(bin("ctxgate-engine-window"), &["--listen", "127.0.0.1:0", "--state-dir", state])
            .await?;
        seed_engine(&p.endpoint, &session_id, &messages).await?;
        config
            .plugins
            .entries
            .insert("window".into(), EngineEntry { endpoint: p.endpoint.as_str().into(), ..Default::default() });
        config.plugins.slots.context_engine = Some("window".into());
        Some(p)
    } else {
        None
    };
    config.state_dir = gw_state;
    config.gateway.listen = "127.0.0.1:0".into();
    let store = ctxgate::store::open(&config).await?;
    let listeners = ctxgate::api::server::Listeners::bind(&config).await?;
    let addr = listeners.api.local_addr()?;
    let stop = tokio_util::sync::CancellationToken::new();
    let s = stop.clone();
    let (_keep, reloads) = tokio::sync::mpsc::channel(1);
    let server = tokio::spawn(ctxgate::api::server::run_with_reloads(
        config,
        store,
        listeners,
        async move { s.cancelled().await },
        reloads,
    ));
    let mut c = GatewayClient::connect(format!("http://{addr}")).await?;
    // Wait until the engine is attached (legacy needs nothing).
    for _ in 0..500 {
        let st = c.get_status(api::StatusRequest {}).await?.into_inner();
        if engine == "legacy" || st.engines.iter().any(|e| e.id == engine && e.quarantine.is_none()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for i in 0..args.warmup {
        turn(&mut c, age + i).await?;
    }
    let mut times = Vec::with_capacity(args.turns);
    for i in 0..args.turns {
        times.push(turn(&mut c, age + args.warmup + i).await?);
    }
    stop.cancel();
    let _ = server.await;
    times.sort();
    Ok((quantile(&times, 0.5), quantile(&times, 0.99)))
}

/// The window engine's Assemble on a 10,000-message session: with a cursor
/// (one new message) and without (all of them), median of 20 calls.
async fn assemble_alone() -> R<(f64, f64)> {
    let dir = tempfile::tempdir()?;
    let state = dir.path().to_str().ok_or("utf-8")?;
    let p =
        EngineProcess::start(bin("ctxgate-engine-window"), &["--listen", "127.0.0.1:0", "--state-dir", state]).await?;
    let messages: Vec<pb::AgentMessage> =
        (0..10_000).map(|i| pb::AgentMessage { id: format!("m{i}"), ..message(i) }).collect();
    seed_engine(&p.endpoint, "s", &messages).await?;
    let mut c = pb::context_engine_client::ContextEngineClient::connect(p.endpoint.clone()).await?;
    // Let the engine summarise what it holds first (its own schedule).
    let compact =
        pb::CompactRequest { session_id: "s".into(), session_key: "bench".into(), force: true, ..Default::default() };
    let mut events = c.compact(compact).await?.into_inner();
    while events.next().await.transpose()?.is_some() {}
    let next = pb::AgentMessage { id: "new".into(), ..message(10_000) };
    let cursor = pb::HistoryCursor {
        message_id: "m9999".into(),
        seq: 10_000,
        message_count: 10_000,
        tokens: ctxgate_proto::estimate::messages_tokens(&messages),
    };
    let time = |r: pb::AssembleRequest| {
        let mut c = c.clone();
        async move {
            let mut t = Vec::new();
            for _ in 0..20 {
                let started = Instant::now();
                c.assemble(r.clone()).await?;
                t.push(started.elapsed());
            }
            t.sort();
            R::Ok(quantile(&t, 0.5))
        }
    };
    let base = pb::AssembleRequest { session_id: "s".into(), token_budget: Some(24_000), ..Default::default() };
    let delta =
        time(pb::AssembleRequest { messages: vec![next.clone()], cursor: Some(cursor), ..base.clone() }).await?;
    let mut all = messages;
    all.push(next);
    let full = time(pb::AssembleRequest { messages: all, ..base }).await?;
    Ok((delta, full))
}

#[tokio::main]
async fn main() -> R<()> {
    let args = Args::parse();
    println!("{:>8}  {:>22}  {:>22}", "messages", "legacy p50 / p99 (ms)", "window p50 / p99 (ms)");
    for &age in &args.ages {
        let (lp50, lp99) = measure("legacy", age, &args).await?;
        let (wp50, wp99) = measure("window", age, &args).await?;
        println!("{age:>8}  {lp50:>10.2} / {lp99:>9.2}  {wp50:>10.2} / {wp99:>9.2}");
    }
    let (delta, full) = assemble_alone().await?;
    println!(
        "window Assemble, 10,000-message session: {delta:.2} ms with a cursor, {full:.2} ms with the whole history"
    );
    Ok(())
}
