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
    assert_eq!(texts[0], "rewritten", "the active branch has the replacement");
    let info = g.client.clone().get_session(sref("m")).await.unwrap().into_inner();
    let stored = g.client.clone().list_sessions(api::ListSessionsRequest::default()).await.unwrap().into_inner();
    assert_eq!(info.entries, 2, "the active branch");
    assert_eq!(stored.sessions[0].entries, 4, "the old branch is kept for audit");
    g.stop().await;
}
