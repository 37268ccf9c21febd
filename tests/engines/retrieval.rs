//! Retrieval of what compaction took away: the window engine keeps every
//! message and offers `history_search` and `history_read`; the model finds
//! a fact from long ago although the assembled context holds only the
//! recent turns — through a managed turn (the offline model searches when
//! asked) and through a harness turn.

use ctxgate_proto::gateway::{self as api, turn_event::Event};
use ctxgate_proto::pb::{Role, content_part::Part, transcript_entry::Entry};
use ctxgate_tests::harness::{Drive, begin, client, text, tool_call};
use ctxgate_tests::hosting::{attached_gateway, run_turn, transcript};
use ctxgate_tests::{compact_to_end, start_window};

/// The facts planted in turn `i`: an identifier every turn, a decision
/// every 3rd, a TODO every 4th.
fn planted(i: usize) -> Vec<String> {
    let mut facts = vec![format!("ID-{i:04}-XQ")];
    if i.is_multiple_of(3) {
        facts.push(format!("DEC-{i:04}"));
    }
    if i.is_multiple_of(4) {
        facts.push(format!("TODO-{i:04}"));
    }
    facts
}

fn turn_text(i: usize) -> String {
    let mut t = format!("Turn {i}: the build artefact is ID-{i:04}-XQ.");
    if i.is_multiple_of(3) {
        t.push_str(&format!(" Decision DEC-{i:04}: we keep the cache per tenant."));
    }
    if i.is_multiple_of(4) {
        t.push_str(&format!(" TODO-{i:04}: write the migration for it."));
    }
    t
}

#[tokio::test]
async fn every_fact_of_400_turns_is_found_by_history_search_though_the_context_holds_only_recent_ones() {
    let state = tempfile::tempdir().unwrap();
    let engine = start_window(state.path(), &[]).await;
    let g = attached_gateway("window", &engine.endpoint, &[]).await;
    const ROUNDS: usize = 10;
    const TURNS: usize = 40;
    for i in 0..ROUNDS * TURNS {
        let events = run_turn(&g, "probe", &turn_text(i)).await;
        assert!(matches!(events.last(), Some(Event::Completed(_))), "turn {i}: {events:?}");
        if i % TURNS == TURNS - 1 {
            let (_, failed) = compact_to_end(&g.client, "probe").await;
            assert!(failed.is_none(), "round {}: {failed:?}", i / TURNS);
        }
    }
    let all: Vec<String> = (0..ROUNDS * TURNS).flat_map(planted).collect();
    // What the model is shown holds only the recent facts ...
    let preview = g.client.clone().preview_context(ctxgate_tests::hosting::sref("probe")).await.unwrap().into_inner();
    let shown: String = preview
        .messages
        .iter()
        .filter_map(|m| m.message.as_ref())
        .map(ctxgate::provider::message_text)
        .collect::<Vec<_>>()
        .join("\n");
    let visible = all.iter().filter(|f| shown.contains(f.as_str())).count();
    assert!(visible * 4 < all.len(), "the context holds {visible} of {} facts: not the point of the test", all.len());
    assert!(preview.messages.iter().any(|m| m.kind == "summary"), "the window engine's summary is marked");
    // ... and the model finds every one of them by asking.
    let mut missed = Vec::new();
    for fact in &all {
        let events = run_turn(&g, "probe", &format!("Search history for {fact}")).await;
        let found = events.iter().any(|e| {
            matches!(e, Event::ToolAnswered(a) if a.name == "history_search" && !a.is_error && a.text.contains(fact.as_str()))
        });
        if !found {
            missed.push(fact.clone());
        }
    }
    eprintln!(
        "history_search found {} of {} planted facts; the context showed {visible}",
        all.len() - missed.len(),
        all.len()
    );
    assert!(missed.is_empty(), "not found: {missed:?}");
    g.stop().await;
}

#[tokio::test]
async fn a_harness_finds_a_fact_from_turn_one_after_thirty_turns_in_a_small_window() {
    let state = tempfile::tempdir().unwrap();
    let engine = start_window(state.path(), &[]).await;
    let g = attached_gateway("window", &engine.endpoint, &[]).await;
    let hc = client(&g.endpoint);
    let small = |key: &str, user: &str| {
        let mut b = begin(key, user);
        b.model.as_mut().unwrap().context_window = 4_000;
        b.model.as_mut().unwrap().max_output_tokens = 500;
        b
    };
    let mut first = String::new();
    for i in 0..30 {
        let user = if i == 0 {
            "Remember this: the launch code is ORCHID-7731.".to_owned()
        } else {
            format!("Turn {i}: {}", "more talk about the schedule. ".repeat(20))
        };
        let mut d = Drive::open(&hc, small("small", &user)).await.unwrap();
        d.context().await.unwrap();
        if i == 0 {
            first = d
                .seen
                .iter()
                .find_map(|e| match e {
                    ctxgate_proto::gateway::harness_event::Event::Admitted(a) => Some(a.entry_id.clone()),
                    _ => None,
                })
                .unwrap();
        }
        d.append(vec![text(Role::Assistant, &format!("noted {i}"))]).await.unwrap();
        d.end(api::TurnOutcome::Accepted).await.unwrap();
    }
    let mut d = Drive::open(&hc, small("small", "What was the launch code?")).await.unwrap();
    let ctx = d.context().await.unwrap();
    // Turn 1's message was compacted away (its summary may keep a trace).
    assert!(!ctx.messages.iter().any(|m| m.id == first), "turn 1's message is no longer in the context");
    assert!(ctx.engine_tools.iter().any(|t| t.name == "history_search"), "{:?}", ctx.engine_tools);
    assert!(ctx.system_prompt_addition.as_deref().is_some_and(|a| a.contains("history_search")));
    d.append(vec![tool_call("s1", "history_search", r#"{"query":"launch code"}"#)]).await.unwrap();
    let r = d.call_tool("s1").await.unwrap();
    let answer = match r.message.as_ref().and_then(|m| m.content.first()).and_then(|p| p.part.as_ref()) {
        Some(Part::ToolResult(t)) => t.text.clone(),
        other => panic!("{other:?}"),
    };
    assert!(answer.contains("ORCHID-7731") && answer.contains("#1 user"), "the message itself: {answer}");
    d.append(vec![text(Role::Assistant, "The launch code is ORCHID-7731.")]).await.unwrap();
    d.end(api::TurnOutcome::Accepted).await.unwrap();
    // The call and its result are in the transcript, in order, once.
    let entries = transcript(&g.client, "small").await;
    let tool_parts: Vec<(Role, String)> = entries
        .iter()
        .filter_map(|e| match &e.entry {
            Some(Entry::Message(m)) => m.content.iter().find_map(|p| match &p.part {
                Some(Part::ToolCall(c)) => Some((Role::Assistant, c.id.clone())),
                Some(Part::ToolResult(r)) => Some((Role::Tool, r.tool_call_id.clone())),
                _ => None,
            }),
            _ => None,
        })
        .collect();
    assert_eq!(tool_parts, [(Role::Assistant, "s1".to_owned()), (Role::Tool, "s1".to_owned())]);
    g.stop().await;
}
