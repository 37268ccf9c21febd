//! Engine maintenance (`Maintain`): the transcript replacements an engine
//! returns become a new branch; the old branch stays for audit.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::time::Duration;

use ctxgate_proto::gateway as api;
use ctxgate_tests::hosting::*;

#[tokio::test]
async fn maintenance_rewrites_become_a_new_branch_and_the_old_one_stays() {
    let (engine, g) = fault_gateway("maintain-rewrite").await;
    assert!(completed(&run_turn(&g, "m", "please rewrite me").await));
    engine.wait_line("event maintain", Duration::from_secs(5)).await.unwrap();
    let texts = messages(&g, "m").await;
    assert_eq!(texts.len(), 2);
    assert_eq!(texts[1], "rewritten", "the active branch has the replacement");
    let info = g.client.clone().get_session(sref("m")).await.unwrap().into_inner();
    let stored = g.client.clone().list_sessions(api::ListSessionsRequest::default()).await.unwrap().into_inner();
    assert_eq!(info.entries, 2, "the active branch");
    assert_eq!(stored.sessions[0].entries, 3, "the old branch is kept for audit");
    g.stop().await;
}

#[tokio::test]
async fn a_maintenance_rewrite_of_a_users_words_is_refused_and_changes_nothing() {
    let (engine, g) = fault_gateway("maintain-rewrite,rewrite-user").await;
    assert!(completed(&run_turn(&g, "u", "my own words").await));
    engine.wait_line("event maintain", Duration::from_secs(5)).await.unwrap();
    let texts = messages(&g, "u").await;
    assert_eq!(texts[0], "my own words", "the user's message stands");
    let stored = g.client.clone().list_sessions(api::ListSessionsRequest::default()).await.unwrap().into_inner();
    assert_eq!(stored.sessions[0].entries, 2, "no branch was written");
    g.stop().await;
}

#[tokio::test]
async fn a_commit_that_says_no_maintenance_is_due_skips_the_turns_maintain() {
    // The same durable engine, with and without the hint: unset asks after
    // every turn, false skips the round trip (and so the rewrite).
    for (faults, asked) in [("durable,maintain-rewrite", true), ("durable,maintain-rewrite,maintenance-not-due", false)]
    {
        let (engine, g) = fault_gateway(faults).await;
        for i in 0..2 {
            assert!(completed(&run_turn(&g, "h", &format!("turn {i}")).await), "{faults}");
        }
        engine.wait_lines("event commit", 2, Duration::from_secs(5)).await.expect(faults);
        // The fixture's Maintain runs in the foreground: before the turn ends.
        let texts = messages(&g, "h").await;
        if asked {
            let upkeep = engine.wait_lines("event upkeep", 2, Duration::from_secs(2)).await;
            let upkeep = upkeep.expect("Maintain(TURN) after each turn");
            assert!(upkeep.iter().all(|l| l.contains("MAINTAIN_REASON_TURN")), "{upkeep:?}");
            assert_eq!(texts[1], "rewritten", "{faults}");
        } else {
            assert_eq!(engine.lines_starting("event upkeep"), Vec::<String>::new(), "no Maintain was asked for");
            assert_eq!((texts.len(), texts[0].as_str()), (4, "turn 0"), "nothing rewritten: {texts:?}");
        }
        g.stop().await;
    }
}

/// Each rewrite copies the branch: a session takes
/// `maintainRewritesPerSessionPerHour` of them, and the next is refused
/// with the transcript unchanged.
#[tokio::test]
async fn maintenance_rewrites_past_the_sessions_hourly_allowance_are_refused() {
    let engine = fault_engine("maintain-rewrite").await;
    let mut config = hosting("fault", &engine.endpoint, &[]);
    config.gateway.limits.maintain_rewrites_per_session_per_hour = 1;
    let g = ctxgate_tests::TestGateway::start(config).await;
    attached(&g, "fault").await;
    // The third turn runs after the second's maintenance (the session's
    // turns and its upkeep take turns), so what it reads is settled.
    for (i, text) in ["first", "second", "third"].into_iter().enumerate() {
        assert!(completed(&run_turn(&g, "r", text).await));
        let asked = engine.wait_lines("event maintain", i + 1, Duration::from_secs(5)).await;
        assert!(asked.is_some(), "turn {}: the engine asked for a rewrite", i + 1);
    }
    let texts = messages(&g, "r").await;
    assert_eq!(texts.len(), 6, "{texts:?}");
    assert_eq!(texts[1], "rewritten", "the first rewrite was applied");
    assert_ne!(texts[3], "rewritten", "the second, over the allowance, was not: {texts:?}");
    g.stop().await;
}
