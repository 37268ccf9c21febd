//! Built-in compaction through the real gateway (`server::run` in-process,
//! real gRPC, real SQLite) against a local OpenAI-compatible server:
//! overflow recovery (three compactions, then truncation, then a clear
//! error), the compaction safety timeout, a cancel mid-compaction, a long
//! offline conversation and its summary, a model timeout that compacts only
//! a large prompt. Compaction an engine owns is in compaction_by_engine.rs.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::time::{Duration, Instant};

use ctxgate::config::Config;
use ctxgate_proto::gateway::{self as api, compaction_event, turn_event::Event};
use ctxgate_proto::pb::transcript_entry::Entry;
use ctxgate_tests::fake_openai::{FakeOpenAi, Kind, Reply};
use ctxgate_tests::hosting::{compaction_stream, session};
use ctxgate_tests::{TestGateway, compact_to_end};
use tokio_stream::StreamExt;
use tonic::Code;

use crate::managed_turns::{branch, openai_config, run_turn, seeded};

fn compactions_started(events: &[Event], trigger: &str) -> usize {
    events.iter().filter(|e| matches!(e, Event::CompactionStarted(c) if c.trigger == trigger)).count()
}

#[tokio::test]
async fn overflow_three_times_then_success() {
    let fake = FakeOpenAi::start().await;
    let g = seeded(openai_config(&fake), 6).await;
    fake.turns([Reply::Overflow, Reply::Overflow, Reply::Overflow, Reply::Text("finally an answer".into())]);

    let events = run_turn(&g, "s", "one more question about file_9.rs").await.unwrap();
    let Some(Event::Completed(done)) = events.last() else { panic!("{events:?}") };
    assert_eq!(done.text, "finally an answer");
    assert_eq!(compactions_started(&events, "overflow"), 3);
    assert!(
        events.iter().any(|e| matches!(e, Event::CompactionDone(d) if d.compacted)),
        "the first overflow compaction compacts"
    );
    let attempts: Vec<u32> =
        events.iter().filter_map(|e| if let Event::Assembled(a) = e { Some(a.attempt) } else { None }).collect();
    assert_eq!(attempts, [1, 2, 3, 4]);
    assert!(fake.count(Kind::Summary) >= 1, "summaries come from the model");

    // Nothing was lost: every message is still on the branch, plus summaries.
    let b = branch(&g, "s").await;
    let messages = b.iter().filter(|e| matches!(e.entry, Some(Entry::Message(_)))).count();
    assert_eq!(messages, 6 * 2 + 2);
    g.stop().await;
}

#[tokio::test]
async fn overflow_forever_ends_in_a_clear_error_after_three_compactions() {
    let fake = FakeOpenAi::start().await;
    let g = seeded(openai_config(&fake), 6).await;
    fake.turn_default(Reply::Overflow);
    let before = fake.count(Kind::Turn);

    let events = run_turn(&g, "s", "this will never fit").await.unwrap();
    let Some(Event::Failed(f)) = events.last() else { panic!("{events:?}") };
    assert_eq!(f.reason, "context_overflow");
    assert!(f.message.contains("/compact") && f.message.contains("/new"), "{}", f.message);
    assert_eq!(compactions_started(&events, "overflow"), 3);
    assert!(events.iter().any(|e| matches!(e, Event::Warning(w) if w.message.contains("truncating"))));
    assert_eq!(fake.count(Kind::Turn) - before, 5, "first try, 3 after compactions, 1 after truncation");

    // The user's message is kept; no reply was invented.
    let b = branch(&g, "s").await;
    let last =
        b.iter().rev().find_map(|e| if let Some(Entry::Message(m)) = &e.entry { Some(m) } else { None }).unwrap();
    assert_eq!(ctxgate::provider::message_text(last), "this will never fit");
    assert!(b.iter().any(|e| matches!(e.entry, Some(Entry::Compaction(_)))), "the compactions are recorded");
    g.stop().await;
}

#[tokio::test]
async fn a_hanging_summary_call_is_cut_at_the_safety_timeout() {
    let fake = FakeOpenAi::start().await;
    let mut config = openai_config(&fake);
    config.agents.defaults.compaction.timeout_seconds = 2;
    let g = seeded(config, 6).await;
    fake.summary_default(Reply::Hang("## Decisions".into()));
    let entries_before = branch(&g, "s").await.len();

    let started = Instant::now();
    let (_, status) = compact_to_end(&g.client, "s").await;
    let elapsed = started.elapsed();
    // Cut at the 2 s safety timeout: not before it, and well before a
    // timeout twice as long would have ended it.
    assert!(
        (Duration::from_millis(1_900)..Duration::from_millis(3_800)).contains(&elapsed),
        "the compaction returned after {elapsed:?} (timeout 2 s)"
    );
    let status = status.expect("the compaction fails");
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert!(status.message().contains("history kept"), "{}", status.message());
    assert!(fake.wait_disconnect(Duration::from_secs(10)).await, "the hanging summary request was dropped");
    assert_eq!(branch(&g, "s").await.len(), entries_before, "history unchanged");
    g.stop().await;
}

#[tokio::test]
async fn a_client_cancel_mid_compaction_stops_it_and_changes_nothing() {
    let fake = FakeOpenAi::start().await;
    let g = seeded(openai_config(&fake), 6).await;
    fake.summary_default(Reply::Hang("## Decisions".into()));
    let entries_before = branch(&g, "s").await.len();
    let mut stream = compaction_stream(&g, "s").await;
    let first = stream.next().await.unwrap().unwrap();
    assert!(matches!(first.event, Some(compaction_event::Event::Started(_))));
    // Wait until the summary request is in flight, then leave.
    while fake.count(Kind::Summary) == 0 {
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    drop(stream);
    assert!(fake.wait_disconnect(Duration::from_secs(10)).await, "the summary request was cancelled");
    let after = branch(&g, "s").await;
    assert_eq!(after.len(), entries_before);
    assert!(after.iter().all(|e| matches!(e.entry, Some(Entry::Message(_)))));
    g.stop().await;
}

#[tokio::test]
async fn a_long_offline_conversation_is_compacted_and_shows_its_summary() {
    let mut config = Config::default();
    config.models.context_window = 3_000;
    config.models.max_output_tokens = 200;
    config.agents.defaults.compaction.reserve_tokens = Some(300);
    config.agents.defaults.compaction.keep_recent_tokens = 400;
    let g = TestGateway::start(config).await;
    let mut compacted = 0;
    for i in 0..25 {
        let events =
            run_turn(&g, "long", &format!("Step {i}: we must keep module_{i} stable. {}", "detail ".repeat(40)))
                .await
                .unwrap();
        assert!(matches!(events.last(), Some(Event::Completed(_))), "turn {i}: {events:?}");
        compacted += events.iter().filter(|e| matches!(e, Event::CompactionDone(d) if d.compacted)).count();
    }
    assert!(compacted >= 1, "a long conversation gets compacted");

    let req = api::GetTranscriptRequest { session: session("long"), visible_only: true, ..Default::default() };
    let visible = g.client.clone().get_transcript(req).await.unwrap().into_inner();
    let Some(Entry::Compaction(c)) = &visible.entries[0].entry else {
        panic!("the visible history starts with the summary")
    };
    for h in ctxgate::summarize::HEADINGS {
        assert!(c.summary.contains(h), "{h}");
    }
    // Visible = summary + the kept entries from first_kept onwards (+ later ones).
    let full = branch(&g, "long").await;
    let from = full.iter().position(|e| e.id == c.first_kept_entry_id).unwrap();
    let expected: Vec<&str> =
        full[from..].iter().filter(|e| matches!(e.entry, Some(Entry::Message(_)))).map(|e| e.id.as_str()).collect();
    let shown: Vec<&str> = visible.entries[1..].iter().map(|e| e.id.as_str()).collect();
    assert_eq!(shown, expected);
    assert!(visible.session.unwrap().compactions >= 1);
    g.stop().await;
}

#[tokio::test]
async fn a_model_timeout_compacts_only_a_large_prompt_and_retries() {
    let fake = FakeOpenAi::start().await;
    let mut config = openai_config(&fake);
    config.models.context_window = 8_000;
    config.models.request_timeout_seconds = 1;
    let g = TestGateway::start(config).await;

    // A small prompt (far below 65 % of the budget): no compaction, a clear error.
    fake.turns([Reply::Hang("…".into())]);
    let events = run_turn(&g, "small", "quick question").await.unwrap();
    let Some(Event::Failed(f)) = events.last() else { panic!("{events:?}") };
    assert_eq!(f.reason, "model_timeout");
    assert_eq!(compactions_started(&events, "timeout"), 0);

    // A prompt above 65 % of the 7500-token budget: compact, then retry.
    fake.turns([Reply::Hang("…".into()), Reply::Text("recovered".into())]);
    let big = format!("Please summarise this log: {}", "entry ".repeat(4_000));
    let events = run_turn(&g, "big", &big).await.unwrap();
    assert_eq!(compactions_started(&events, "timeout"), 1, "{events:?}");
    assert!(matches!(events.last(), Some(Event::Completed(c)) if c.text == "recovered"), "{events:?}");
    g.stop().await;
}
