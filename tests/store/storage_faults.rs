//! Storage faults read like sentences: a corrupt database, one from a newer
//! ctxgate, a second gateway on the same state dir and a read-only state
//! dir each stop `ctxgate serve` before it binds a port, with the exact
//! message an operator sees; a full disk fails the call that hit it and
//! leaves every stored turn whole. The read-only and full filesystems are
//! tmpfs mounts in a private mount namespace (`unshare -m`): they vanish
//! with the process.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::path::Path;
use std::time::Duration;

use ctxgate_proto::gateway::{self as api, gateway_client::GatewayClient, turn_event::Event};
use ctxgate_proto::pb::Role;
use ctxgate_tests::hosting::{message_roles, transcript, turn_request};
use ctxgate_tests::{EngineProcess, bin};
use tokio::process::Command;
use tokio_stream::StreamExt;

/// `ctxgate serve` on `state`, expected to exit: its code, stdout, stderr.
async fn serve_exits(program: &str, args: &[&str]) -> (Option<i32>, String, String) {
    let out = tokio::time::timeout(Duration::from_secs(30), Command::new(program).args(args).output())
        .await
        .expect("ctxgate serve exits by itself")
        .unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code(), text(&out.stdout), text(&out.stderr))
}

fn serve_args(state: &Path) -> Vec<String> {
    ["serve", "--listen", "127.0.0.1:0", "--state-dir", state.to_str().unwrap()].map(str::to_owned).to_vec()
}

async fn refused(state: &Path) -> String {
    let gateway = bin("ctxgate");
    let args = serve_args(state);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (code, out, err) = serve_exits(gateway.to_str().unwrap(), &args).await;
    assert_eq!(code, Some(1), "{out}\n{err}");
    assert!(!out.contains("listening on"), "refused before any port is bound: {out}");
    err
}

/// `unshare -m sh -c 'mount -t tmpfs -o OPTS tmpfs DIR && exec ctxgate serve …'`.
fn in_tmpfs(dir: &Path, opts: &str) -> (String, Vec<String>) {
    let script = format!("mount -t tmpfs -o {opts} tmpfs \"$1\" && shift && exec \"$@\"");
    let mut args = vec!["-m".to_owned(), "sh".into(), "-c".into(), script, "sh".into()];
    args.push(dir.to_str().unwrap().into());
    args.push(bin("ctxgate").to_str().unwrap().into());
    args.extend(serve_args(dir));
    ("unshare".into(), args)
}

#[tokio::test]
async fn a_corrupt_database_is_refused_with_a_sentence() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("ctxgate.sqlite");
    std::fs::write(&file, "this is a text file, not a database\n".repeat(200)).unwrap();
    let err = refused(dir.path()).await;
    let want = format!("ctxgate: {} is not a ctxgate database or is corrupt (", file.display());
    assert!(err.contains(&want), "{err}");
    assert!(err.contains("); restore it from a backup or move it away"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[tokio::test]
async fn a_database_from_a_newer_ctxgate_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("ctxgate.sqlite");
    rusqlite::Connection::open(&file).unwrap().pragma_update(None, "user_version", 99).unwrap();
    let err = refused(dir.path()).await;
    let want = format!(
        "ctxgate: {} was written by a newer ctxgate (schema version 99; this build knows up to {}); upgrade ctxgate",
        file.display(),
        ctxgate::store::SCHEMA_VERSION
    );
    assert!(err.contains(&want), "{err}");
}

#[tokio::test]
async fn a_second_gateway_on_one_state_dir_is_refused_until_the_first_is_gone() {
    let dir = tempfile::tempdir().unwrap();
    let args = serve_args(dir.path());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let first = EngineProcess::start(bin("ctxgate"), &args).await.unwrap();
    let err = refused(dir.path()).await;
    let want = format!(
        "ctxgate: another ctxgate gateway is already using the state directory {} (lock {}); only a PostgreSQL store can be shared by several gateways",
        dir.path().display(),
        dir.path().join("ctxgate.lock").display()
    );
    assert!(err.contains(&want), "{err}");
    // The first gateway is untouched; once it dies (however), the dir is free.
    let mut c = GatewayClient::connect(first.endpoint.clone()).await.unwrap();
    c.get_status(api::StatusRequest {}).await.unwrap();
    first.signal_and_wait("KILL").await.unwrap();
    let again = EngineProcess::start(bin("ctxgate"), &args).await.unwrap();
    GatewayClient::connect(again.endpoint.clone()).await.unwrap().get_status(api::StatusRequest {}).await.unwrap();
}

#[tokio::test]
async fn a_read_only_state_dir_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (program, args) = in_tmpfs(dir.path(), "ro,size=1m");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (code, out, err) = serve_exits(&program, &args).await;
    assert_eq!(code, Some(1), "{out}\n{err}");
    let want = format!(
        "ctxgate: the state directory {} is read-only: ctxgate needs to write its database there",
        dir.path().display()
    );
    assert!(err.contains(&want), "{err}");
}

/// One turn; `Err` with the status that ended it (at the call or in the stream).
async fn turn(c: &mut GatewayClient<tonic::transport::Channel>, text: String) -> Result<Vec<Event>, tonic::Status> {
    let mut stream = c.run_turn(turn_request("full", text)).await?.into_inner();
    let mut events = Vec::new();
    while let Some(e) = stream.next().await {
        events.push(e?.event.unwrap());
    }
    Ok(events)
}

#[tokio::test]
async fn a_full_disk_fails_the_call_with_a_sentence_and_every_stored_turn_stays_whole() {
    let dir = tempfile::tempdir().unwrap();
    let (program, args) = in_tmpfs(dir.path(), "size=1m");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let gw = EngineProcess::start(&program, &args).await.unwrap();
    let mut c = GatewayClient::connect(gw.endpoint.clone()).await.unwrap();

    let mut completed = 0;
    let status = loop {
        assert!(completed < 400, "a 1 MiB disk never filled up");
        let text = format!("turn {completed}: {}", "filling the disk ".repeat(250));
        match turn(&mut c, text).await {
            Ok(events) => {
                assert!(matches!(events.last(), Some(Event::Completed(_))), "{events:?}");
                completed += 1;
            }
            Err(status) => break status,
        }
    };
    assert!(completed > 0, "some turns fit before the disk filled");
    eprintln!("{completed} turns fit before the disk filled: {status:?}");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert_eq!(status.message(), "the gateway's state storage is full; nothing of this call was stored");

    // Reads still work, and every stored turn is whole: user, then reply.
    let roles: Vec<Role> = message_roles(&transcript(&c, "full").await);
    let pairs: Vec<&[Role]> = roles.chunks(2).collect();
    assert!(pairs.len() >= completed, "{roles:?}");
    for (i, p) in pairs.iter().enumerate().take(completed) {
        assert_eq!(*p, [Role::User, Role::Assistant], "turn {i}: {roles:?}");
    }
    // At most the failed turn's own user message follows (an abort's shape).
    assert!(roles.len() <= completed * 2 + 1, "{roles:?}");
    c.get_status(api::StatusRequest {}).await.unwrap();
}
