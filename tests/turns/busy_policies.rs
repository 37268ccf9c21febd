//! Busy policies: what a turn does when its session is busy with another
//! (here a harness turn holding it). REJECT refuses at once, ENQUEUE waits
//! in a bounded queue (a waiter that leaves leaves no trace), INTERRUPT
//! aborts the running turn and then runs.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::time::Duration;

use ctxgate::config::Config;
use ctxgate_proto::gateway as api;
use ctxgate_proto::pb::Role;
use ctxgate_tests::harness::{Drive, begin, client, tool_call};
use ctxgate_tests::{TestGateway, within};
use tonic::Code;

use crate::harness_turns::{run_req, run_to_end, run_to_end_owned, shape, status_of};
use crate::limited_gateway;

/// How soon a refusal must come: it never waits for the session.
const AT_ONCE: Duration = Duration::from_secs(5);

/// A harness turn that holds session `key` open (begun, not ended).
async fn hold(hc: &api::harness_client::HarnessClient<tonic::transport::Channel>, key: &str) -> Drive {
    Drive::admitted(hc, begin(key, "holding")).await
}

#[tokio::test]
async fn busy_policy_reject_refuses_a_second_turn_at_once() {
    let g = TestGateway::start(Config::default()).await;
    let hc = client(&g.endpoint);
    let mut holder = hold(&hc, "busy").await;
    // At once: a refusal that waits for the holder is a broken policy.
    let refused = within(
        AT_ONCE,
        "a rejected managed turn's refusal",
        run_to_end(&g, run_req("busy", "me too", api::BusyPolicy::Reject)),
    );
    let s = status_of(refused.await);
    assert_eq!(s.code(), Code::FailedPrecondition);
    assert!(s.message().contains("session busy"), "{s:?}");
    let mut b = begin("busy", "me too");
    b.busy_policy = api::BusyPolicy::Reject as i32;
    let refused = async { Drive::open(&hc, b).await.unwrap().context().await };
    let s = status_of(within(AT_ONCE, "a rejected harness turn's refusal", refused).await);
    assert_eq!(s.code(), Code::FailedPrecondition);
    holder.end(api::TurnOutcome::Accepted).await.unwrap();
    assert_eq!(shape(&g, "busy").await, [(Role::User, "holding".into())], "rejected turns left nothing");
    g.stop().await;
}

/// Waits (bounded) until the gateway reports `n` queued turns.
async fn queued(g: &TestGateway, n: u32) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let s = g.client.clone().get_status(api::StatusRequest {}).await.unwrap().into_inner();
        if s.turns_queued == n {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "{} queued, never {n}", s.turns_queued);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn busy_policy_enqueue_waits_in_a_bounded_queue_and_a_cancelled_waiter_leaves_no_trace() {
    let g = limited_gateway(|l| l.queued_turns_per_session = 1).await;
    let hc = client(&g.endpoint);
    let mut holder = hold(&hc, "q").await;

    // One waits; a second is refused at once: the queue holds one.
    let waiting = g.client.clone().run_turn(run_req("q", "queued then cancelled", api::BusyPolicy::Enqueue)).await;
    let waiting = waiting.unwrap().into_inner();
    queued(&g, 1).await;
    let full = status_of(run_to_end(&g, run_req("q", "one too many", api::BusyPolicy::Enqueue)).await);
    assert_eq!(full.code(), Code::ResourceExhausted);
    assert!(full.message().contains("queuedTurnsPerSession"), "{full:?}");
    // The queued turn's client leaves before it starts: its place is free.
    drop(waiting);
    queued(&g, 0).await;
    let next =
        tokio::spawn(run_to_end_owned(g.client.clone(), run_req("q", "after the holder", api::BusyPolicy::Enqueue)));
    queued(&g, 1).await;
    holder.end(api::TurnOutcome::Accepted).await.unwrap();
    let events = next.await.unwrap().unwrap();
    assert!(matches!(events.last(), Some(api::turn_event::Event::Completed(_))), "{events:?}");
    let texts: Vec<String> = shape(&g, "q").await.into_iter().map(|(_, t)| t).collect();
    assert_eq!(texts[..2], ["holding".to_owned(), "after the holder".to_owned()], "{texts:?}");
    assert!(!texts.iter().any(|t| t.contains("cancelled") || t.contains("too many")), "{texts:?}");
    g.stop().await;
}

#[tokio::test]
async fn busy_policy_interrupt_aborts_the_running_turn_then_runs() {
    let g = TestGateway::start(Config::default()).await;
    let hc = client(&g.endpoint);
    let mut holder = hold(&hc, "int").await;
    holder.append(vec![tool_call("c", "calculator", "{}")]).await.unwrap();
    let events = run_to_end(&g, run_req("int", "stop that", api::BusyPolicy::Interrupt)).await.unwrap();
    assert!(matches!(events.last(), Some(api::turn_event::Event::Completed(_))), "{events:?}");
    let s = holder.status().await;
    assert_eq!(s.code(), Code::Cancelled, "{s:?}");
    let roles: Vec<(Role, String)> = shape(&g, "int").await;
    assert_eq!(roles[0], (Role::User, "holding".into()));
    assert_eq!(roles[1], (Role::User, "stop that".into()), "the interrupted turn's tool call left the branch");
    assert_eq!(roles.len(), 3);
    g.stop().await;
}
