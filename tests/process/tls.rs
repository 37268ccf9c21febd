//! TLS on the client API, through the `ctxgate` binary as a user runs it:
//! the CLI reaches an https:// gateway with the CA it trusts, mTLS admits a
//! client certificate the gateway's CA signed, and a wrong CA, an expired
//! certificate, a missing client certificate and a plaintext peer each
//! fail with a sentence that says which.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::path::{Path, PathBuf};

use ctxgate_tests::certs::Ca;
use ctxgate_tests::{EngineProcess, bin, write_file};

/// `ctxgate serve` with `tls` as its `gateway.tls` settings; its config
/// file and state dir are named `name` in `dir`.
async fn serve(dir: &Path, name: &str, tls: &str) -> EngineProcess {
    let config = write_file(dir, &format!("{name}.json5"), &format!("{{ gateway: {{ tls: {{ {tls} }} }} }}"));
    ctxgate_tests::serve(&dir.join(name), Some(&config)).await
}

/// `ctxgate status` against `url` with `flags`: exit code, stdout, stderr.
async fn status(url: &str, flags: &[&str]) -> (Option<i32>, String, String) {
    let out = tokio::process::Command::new(bin("ctxgate"))
        .args(["status", "--gateway", url])
        .args(flags)
        .output()
        .await
        .unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code(), text(&out.stdout), text(&out.stderr))
}

/// Polls `ctxgate status --json` (bounded: 15 s) until `ok` holds for
/// its engines; the engines as last seen.
async fn engines_until(
    url: &str,
    flags: &[&str],
    what: &str,
    ok: impl Fn(&[serde_json::Value]) -> bool,
) -> Vec<serde_json::Value> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    loop {
        let (code, out, err) = status(url, &[flags, &["--json"]].concat()).await;
        assert_eq!(code, Some(0), "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        let engines = v["engines"].as_array().unwrap().clone();
        if ok(&engines) {
            return engines;
        }
        assert!(std::time::Instant::now() < deadline, "{what}: not within 15 s: {out}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// Engine `id` is attached and in service.
fn attached(engines: &[serde_json::Value], id: &str) -> bool {
    engines.iter().any(|e| e["id"] == id && e["quarantine"].is_null() && e["name"] != "")
}

fn https(g: &EngineProcess) -> String {
    g.endpoint.replace("http://", "https://")
}

#[tokio::test]
async fn the_cli_reaches_an_https_gateway_and_each_tls_mistake_says_which() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (ca, other) = (Ca::new("ctxgate test CA"), Ca::new("someone else"));
    let ca_pem = write_file(d, "ca.pem", &ca.pem);
    let other_pem = write_file(d, "other.pem", &other.pem);
    let (crt, key) = ca.leaf_files(d, "server", &["localhost", "127.0.0.1"], true, false);
    let tls = format!("cert: {:?}, key: {:?}", crt.to_str().unwrap(), key.to_str().unwrap());
    let g = serve(d, "plain-tls", &tls).await;
    let ca_flag = ["--tls-ca", ca_pem.to_str().unwrap()];

    let (code, out, err) = status(&https(&g), &ca_flag).await;
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("model"), "{out}");

    let (code, _, err) = status(&https(&g), &["--tls-ca", other_pem.to_str().unwrap()]).await;
    assert_eq!(code, Some(1));
    assert!(err.contains("not signed by a CA you trust"), "wrong CA: {err}");

    let (code, _, err) = status(&g.endpoint, &[]).await;
    assert_eq!(code, Some(1));
    assert!(err.contains("TLS") && err.contains("https://"), "plaintext client, TLS gateway: {err}");
    let (code, _, err) = status(&g.endpoint, &ca_flag).await;
    assert_eq!(code, Some(1));
    assert!(err.contains("are for an https:// gateway"), "TLS flags never go plaintext: {err}");

    // An expired server certificate.
    let (old, old_key) = ca.leaf_files(d, "old", &["localhost", "127.0.0.1"], true, true);
    let expired =
        serve(d, "expired", &format!("cert: {:?}, key: {:?}", old.to_str().unwrap(), old_key.to_str().unwrap())).await;
    let (code, _, err) = status(&https(&expired), &ca_flag).await;
    assert_eq!(code, Some(1));
    assert!(err.contains("expired"), "expired certificate: {err}");

    // A TLS client against a plaintext gateway.
    let plain = ctxgate_tests::serve(&d.join("plain"), None).await;
    let (code, _, err) = status(&https(&plain), &ca_flag).await;
    assert_eq!(code, Some(1));
    assert!(err.contains("does not speak TLS"), "TLS client, plaintext gateway: {err}");
}

#[tokio::test]
async fn mtls_admits_a_client_the_gateways_ca_signed_and_refuses_others() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (ca, other) = (Ca::new("ctxgate test CA"), Ca::new("someone else"));
    let ca_pem = write_file(d, "ca.pem", &ca.pem);
    let (crt, key) = ca.leaf_files(d, "server", &["localhost", "127.0.0.1"], true, false);
    let tls = format!(
        "cert: {:?}, key: {:?}, clientCa: {:?}",
        crt.to_str().unwrap(),
        key.to_str().unwrap(),
        ca_pem.to_str().unwrap()
    );
    let g = serve(d, "mtls", &tls).await;
    let ca_flag = ["--tls-ca", ca_pem.to_str().unwrap()];
    let client = |ca: &Ca, name: &str| {
        let (c, k) = ca.leaf(&["client"], false, false);
        (write_file(d, &format!("{name}.crt"), &c), write_file(d, &format!("{name}.key"), &k))
    };
    let (good, good_key) = client(&ca, "good");
    let (bad, bad_key) = client(&other, "bad");

    let flags = |c: &Path, k: &Path| {
        let mut f: Vec<String> = ca_flag.iter().map(|s| (*s).to_owned()).collect();
        f.extend(["--tls-cert".into(), c.display().to_string(), "--tls-key".into(), k.display().to_string()]);
        f
    };
    let good_flags = flags(&good, &good_key);
    let (code, _, err) = status(&https(&g), &good_flags.iter().map(String::as_str).collect::<Vec<_>>()).await;
    assert_eq!(code, Some(0), "a client the CA signed: {err}");

    let bad_flags = flags(&bad, &bad_key);
    let (code, _, err) = status(&https(&g), &bad_flags.iter().map(String::as_str).collect::<Vec<_>>()).await;
    assert_eq!(code, Some(1));
    assert!(err.contains("client certificate"), "a client another CA signed: {err}");

    let (code, _, err) = status(&https(&g), &ca_flag).await;
    assert_eq!(code, Some(1));
    assert!(err.contains("client certificate"), "no client certificate: {err}");
}

#[tokio::test]
async fn a_tls_key_that_is_not_pem_stops_serve_before_binding() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ca = Ca::new("ctxgate test CA");
    let (crt, _) = ca.leaf(&["localhost"], true, false);
    let crt = write_file(d, "server.crt", &crt);
    let key = write_file(d, "server.key", "not a key");
    let config = write_file(d, "c.json5", &format!("{{ gateway: {{ tls: {{ cert: {:?}, key: {:?} }} }} }}", crt, key));
    let out = tokio::process::Command::new(bin("ctxgate"))
        .args(["serve", "--listen", "127.0.0.1:0", "--config", config.to_str().unwrap()])
        .output()
        .await
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(out.stdout.is_empty(), "nothing was bound");
    assert!(err.contains("gateway.tls.key") && err.contains("private key"), "{err}");
}

/// `ctxgate-engine-window health` with `args`: exit code and stderr.
async fn window_health(args: &[&str]) -> (Option<i32>, String) {
    let out =
        tokio::process::Command::new(bin("ctxgate-engine-window")).arg("health").args(args).output().await.unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[tokio::test]
async fn the_gateway_reaches_an_engine_over_mtls_and_a_wrong_ca_name_or_no_client_certificate_keeps_it_out() {
    use ctxgate::config::EngineTls;
    use ctxgate_tests::TestGateway;
    use ctxgate_tests::hosting::{attached, engine_status, hosting, run_turn, selected, wait_engine};
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (ca, other) = (Ca::new("ctxgate test CA"), Ca::new("someone else"));
    let ca_pem = write_file(d, "ca.pem", &ca.pem);
    let other_pem = write_file(d, "other.pem", &other.pem);
    let (crt, key) = ca.leaf_files(d, "engine", &["localhost", "127.0.0.1"], true, false);
    let (gw, gw_key) = ca.leaf_files(d, "gateway", &["ctxgate-gateway"], false, false);
    // A client certificate from the same CA for another service.
    let (stranger, stranger_key) = ca.leaf_files(d, "stranger", &["engine-lossless"], false, false);
    let health_sock = d.join("health.sock");
    let health_at = format!("unix://{}", health_sock.display());
    let flags = ["--tls-cert", crt.to_str().unwrap(), "--tls-key", key.to_str().unwrap()];
    let flags = [
        &flags[..],
        &["--tls-client-ca", ca_pem.to_str().unwrap(), "--tls-client-name", "ctxgate-gateway"],
        &["--health-listen", &health_at],
    ]
    .concat();
    let engine = ctxgate_tests::start_window(&d.join("window"), &flags).await;
    let endpoint = engine.endpoint.replace("http://", "https://");

    let config = |ca: &Path, client: Option<(&PathBuf, &PathBuf)>| {
        let mut c = hosting("window", &endpoint, &[]);
        let tls = EngineTls {
            ca: Some(ca.to_owned()),
            cert: client.map(|(c, _)| c.clone()),
            key: client.map(|(_, k)| k.clone()),
            server_name: None,
        };
        c.plugins.entries.get_mut("window").unwrap().tls = Some(tls);
        c
    };
    // The engine's own health check, over mTLS with the gateway's
    // certificate (a NaN timeout is no panic), and over --health-listen in
    // plaintext with none; a certificate naming another service fails the
    // handshake.
    let tls_check = ["--endpoint", &endpoint, "--tls-ca", ca_pem.to_str().unwrap()];
    for timeout in ["3", "NaN"] {
        let pair = ["--tls-cert", gw.to_str().unwrap(), "--tls-key", gw_key.to_str().unwrap()];
        let (code, err) = window_health(&[&tls_check[..], &pair, &["--timeout-seconds", timeout]].concat()).await;
        assert_eq!(code, Some(0), "{err}");
    }
    let (code, err) = window_health(&["--endpoint", &health_at]).await;
    assert_eq!(code, Some(0), "health alone at --health-listen: {err}");
    let pair = ["--tls-cert", stranger.to_str().unwrap(), "--tls-key", stranger_key.to_str().unwrap()];
    let (code, err) = window_health(&[&tls_check[..], &pair].concat()).await;
    assert_eq!(code, Some(1), "a client certificate naming another service: {err}");

    let good = TestGateway::start(config(&ca_pem, Some((&gw, &gw_key)))).await;
    attached(&good, "window").await;
    let events = run_turn(&good, "over-mtls", "hello").await;
    assert_eq!(selected(&events).engine_id, "window", "the turn ran on the engine over mTLS");

    for (what, c) in [
        ("a CA that did not sign it", config(&other_pem, Some((&gw, &gw_key)))),
        ("no client certificate", config(&ca_pem, None)),
        ("a certificate for another name", config(&ca_pem, Some((&stranger, &stranger_key)))),
    ] {
        let g = TestGateway::start(c).await;
        // The attach has been tried and refused (the handshake failed, so
        // health reads UNREACHABLE) before anything is asserted: a fast
        // machine must not be what makes the refusal pass.
        let e = wait_engine(&g, "window", "checked over TLS", |e| e.health != "UNKNOWN").await;
        assert_eq!(e.health, "UNREACHABLE", "{what}: the handshake is refused: {e:?}");
        let events = run_turn(&g, "refused", "hello").await;
        assert_eq!(selected(&events).engine_id, "legacy", "{what}: legacy answers");
        let e = engine_status(&g, "window").await;
        assert!(e.name.is_empty() || e.quarantine.is_some(), "{what}: the engine never attached: {e:?}");
    }

    // Health without authentication is served on this machine only, and a
    // client name is a DNS name, matched exactly (no wildcard, no address).
    let refused = async |args: &[&str], says: &str| {
        let out = tokio::process::Command::new(bin("ctxgate-engine-window"))
            .args(["--listen", "127.0.0.1:0", "--state-dir", d.join("w2").to_str().unwrap()])
            .args(args)
            .output()
            .await
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_ne!(out.status.code(), Some(0), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    };
    refused(&["--health-listen", "0.0.0.0:0"], "--health-listen 0.0.0.0:0: health is served there without").await;
    let tls = ["--tls-cert", crt.to_str().unwrap(), "--tls-key", key.to_str().unwrap()];
    for bad in ["*.example", "127.0.0.1", "gate way"] {
        let args = [&tls[..], &["--tls-client-ca", ca_pem.to_str().unwrap(), "--tls-client-name", bad]].concat();
        refused(&args, "expected a DNS name").await;
    }
}

#[tokio::test]
async fn mtls_everywhere_client_to_gateway_gateway_to_engine_and_the_engines_callbacks() {
    use std::time::Duration;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ca = Ca::new("ctxgate test CA");
    let ca_pem = write_file(d, "ca.pem", &ca.pem);
    let pair = |name: &str| {
        let (c, k) = ca.leaf_both(&["localhost", "127.0.0.1"]);
        (write_file(d, &format!("{name}.crt"), &c), write_file(d, &format!("{name}.key"), &k))
    };
    let (gw, gw_key) = pair("gateway");
    let (en, en_key) = pair("engine");
    let (cli, cli_key) = pair("cli");
    let s = |p: &Path| p.to_str().unwrap().to_owned();
    let args = [
        "--listen",
        "127.0.0.1:0",
        "--fault",
        "grant-probe",
        "--tls-cert",
        &s(&en),
        "--tls-key",
        &s(&en_key),
        "--tls-client-ca",
        &s(&ca_pem),
        "--host-ca",
        &s(&ca_pem),
    ];
    let engine = EngineProcess::start(bin("ctxgate-fault-engine"), &args).await.unwrap();
    let tls = format!("cert: {:?}, key: {:?}, clientCa: {:?}", s(&gw), s(&gw_key), s(&ca_pem));
    let plugins = format!(
        "plugins: {{ slots: {{ contextEngine: 'fault' }}, entries: {{ fault: {{ endpoint: {:?}, tls: {{ ca: {:?}, cert: {:?}, key: {:?} }} }} }} }}",
        engine.endpoint.replace("http://", "https://"),
        s(&ca_pem),
        s(&gw),
        s(&gw_key)
    );
    let config = write_file(d, "all.json5", &format!("{{ gateway: {{ tls: {{ {tls} }} }}, {plugins} }}"));
    let state = d.join("state");
    let g = ctxgate_tests::serve(&state, Some(&config)).await;
    let url = https(&g);
    let flags = ["--tls-ca", &s(&ca_pem), "--tls-cert", &s(&cli), "--tls-key", &s(&cli_key)];
    // Wait for the gateway to attach the engine (over mTLS).
    engines_until(&url, &flags, "the engine attached over mTLS", |e| attached(e, "fault")).await;
    let out = tokio::process::Command::new(bin("ctxgate"))
        .args(["chat", "--gateway", &url, "--session", "all-tls", "-m", "hello"])
        .args(flags)
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // The engine read the session back through the Host service, over TLS.
    let line = engine.wait_line("event grant-own ", Duration::from_secs(10)).await.expect("the engine called back");
    // `event grant-own <entries read> <time>`: a number, not `error:…`.
    let n = line.trim_start_matches("event grant-own ").split(' ').next().unwrap_or_default();
    assert!(n.parse::<u32>().is_ok(), "the callback read the transcript: {line}");
}

#[tokio::test]
async fn the_conformance_kit_checks_the_python_engine_over_mtls() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ca = Ca::new("ctxgate test CA");
    let ca_pem = write_file(d, "ca.pem", &ca.pem);
    let (crt, key) = ca.leaf_files(d, "py", &["localhost", "127.0.0.1"], true, false);
    let (cli, cli_key) = ca.leaf_files(d, "kit", &["kit"], false, false);
    let s = |p: &Path| p.to_str().unwrap().to_owned();
    let flags = ["--tls-cert", &s(&crt), "--tls-key", &s(&key), "--tls-client-ca", &s(&ca_pem)];
    let engine = ctxgate_tests::start_python_with(&d.join("py"), &flags).await;
    let endpoint = engine.endpoint.replace("http://", "https://");
    let kit = async |extra: &[&str]| {
        let out = tokio::process::Command::new(bin("ctxgate-conformance"))
            .args(["--endpoint", &endpoint, "--tls-ca", &s(&ca_pem), "--case-timeout-ms", "20000"])
            .args(extra)
            .output()
            .await
            .unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let (code, report) = kit(&["--tls-cert", &s(&cli), "--tls-key", &s(&cli_key)]).await;
    assert_eq!(code, Some(0), "the kit passes over mTLS:\n{report}");
    let (code, report) = kit(&[]).await;
    assert_ne!(code, Some(0), "without a client certificate the engine serves nothing:\n{report}");
}

/// The compose stack's TLS as `docker-compose.yml` wires it, on loopback:
/// the certificates `.ci/certs` makes (a folder per service holding only
/// the CA and its own pair), the gateway config `docs/examples/compose.json5`
/// (its paths and addresses pointed here), the engines with the compose
/// file's flags (only the gateway's certificate is served; health alone on
/// a socket of its own), and the containers' health-check commands. The
/// lossless-claw host's certificate cannot call the window engine.
#[tokio::test]
async fn the_compose_certificates_and_config_carry_a_turn_to_the_window_engine_over_mtls() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let certs = d.join("certs");
    let made = std::process::Command::new(ctxgate_tests::repo_root().join(".ci/certs")).arg(&certs).output().unwrap();
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    let c = |service: &str, f: &str| certs.join(service).join(f).to_str().unwrap().to_owned();
    for service in ["gateway", "engine-window", "engine-python", "engine-lossless"] {
        let mut held: Vec<_> = std::fs::read_dir(certs.join(service))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        held.sort();
        let want = ["ca.pem".to_owned(), format!("{service}.key"), format!("{service}.pem")];
        assert_eq!(held, want, "{service}'s folder holds the CA and its own pair, nothing else");
    }
    let window_health = d.join("window-health.sock");
    let window_state = d.join("window");
    let window_args = [
        "--listen",
        "127.0.0.1:0",
        "--state-dir",
        window_state.to_str().unwrap(),
        "--tls-cert",
        &c("engine-window", "engine-window.pem"),
        "--tls-key",
        &c("engine-window", "engine-window.key"),
        "--tls-client-ca",
        &c("engine-window", "ca.pem"),
        "--tls-client-name",
        "gateway",
        "--health-listen",
        &format!("unix://{}", window_health.display()),
        "--host-ca",
        &c("engine-window", "ca.pem"),
    ];
    let window = EngineProcess::start(bin("ctxgate-engine-window"), &window_args).await.unwrap();
    let port = window.endpoint.rsplit_once(':').unwrap().1.to_owned();
    let (py_crt, py_key, py_ca) = (
        c("engine-python", "engine-python.pem"),
        c("engine-python", "engine-python.key"),
        c("engine-python", "ca.pem"),
    );
    let py_health = format!("unix://{}", d.join("python-health.sock").display());
    let python_args = [
        "--tls-cert",
        &py_crt,
        "--tls-key",
        &py_key,
        "--tls-client-ca",
        &py_ca,
        "--tls-client-name",
        "gateway",
        "--health-listen",
        &py_health,
    ];
    let python = ctxgate_tests::start_python_with(&d.join("python"), &python_args).await;
    let py_port = python.endpoint.rsplit_once(':').unwrap().1.to_owned();

    let compose = std::fs::read_to_string(ctxgate_tests::repo_root().join("docs/examples/compose.json5")).unwrap();
    let config = compose
        .replace("\"/certs/", &format!("\"{}/", certs.join("gateway").display()))
        .replace("dns:///engine-window:7401", &format!("dns:///localhost:{port}"))
        .replace("https://engine-python:7402", &format!("https://localhost:{py_port}"))
        // The derived host endpoint is this gateway's own Host listener.
        .replace("hostEndpoint: \"https://gateway:7301\",", "")
        .replace("hostListen: \"0.0.0.0:7301\",", "");
    assert_ne!(config, compose);
    let config = write_file(d, "compose.json5", &config);
    let s = |p: &Path| p.to_str().unwrap().to_owned();
    let state = d.join("state");
    let mut cmd = tokio::process::Command::new(bin("ctxgate"));
    cmd.args(["serve", "--listen", "127.0.0.1:0", "--config", &s(&config), "--state-dir", &s(&state)]);
    cmd.env("CTXGATE_METRICS_LISTEN", "127.0.0.1:0");
    let g = EngineProcess::spawn(cmd).await.unwrap();
    let url = https(&g);
    let ca_pem = certs.join("ca.pem").to_str().unwrap().to_owned();
    let ca = ["--tls-ca", &ca_pem];

    let engines =
        engines_until(&url, &ca, "the engines attached over mTLS", |e| attached(e, "window") && attached(e, "python"))
            .await;
    let w = engines.iter().find(|e| e["id"] == "window").unwrap();
    let at = |r: &serde_json::Value| r["address"] == format!("127.0.0.1:{port}");
    assert!(w["replicas"].as_array().unwrap().iter().any(at), "{w}");
    let out = tokio::process::Command::new(bin("ctxgate"))
        .args(["chat", "--gateway", &url, "--session", "compose-tls", "-m", "hello"])
        .args(ca)
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (_, out, _) = status(&url, &ca).await;
    assert!(out.contains(&format!("window (Window engine) at dns:///localhost:{port}: SERVING")), "{out}");

    // The containers' health checks, as docker-compose.yml runs them: the
    // engines' on their health sockets, in plaintext.
    let py = ctxgate_tests::repo_root().join("engines/python");
    let venv_python = py.join(".venv/bin/python");
    let checks: [(PathBuf, Vec<String>); 3] = [
        (venv_python, vec![s(&py.join("health.py")), py_health.clone()]),
        (bin("ctxgate"), vec!["health".into(), "--gateway".into(), url.clone(), "--tls-ca".into(), ca_pem.clone()]),
        (
            bin("ctxgate-engine-window"),
            vec!["health".into(), "--endpoint".into(), format!("unix://{}", window_health.display())],
        ),
    ];
    for (program, args) in checks {
        let out = tokio::process::Command::new(&program).args(&args).output().await.unwrap();
        assert!(out.status.success(), "{program:?} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }

    // The window engine serves the gateway's certificate, not another
    // engine's: the lossless-claw host's pair is refused at the handshake
    // (a server-only certificate, and not named gateway).
    let over_tls = |service: &str| {
        vec![
            "health".to_owned(),
            "--endpoint".into(),
            format!("https://localhost:{port}"),
            "--tls-ca".into(),
            ca_pem.clone(),
            "--tls-cert".into(),
            c(service, &format!("{service}.pem")),
            "--tls-key".into(),
            c(service, &format!("{service}.key")),
        ]
    };
    let run = async |args: Vec<String>| {
        let out = tokio::process::Command::new(bin("ctxgate-engine-window")).args(&args).output().await.unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (code, err) = run(over_tls("gateway")).await;
    assert_eq!(code, Some(0), "the gateway's certificate is served: {err}");
    for service in ["engine-lossless", "engine-python"] {
        let (code, err) = run(over_tls(service)).await;
        assert_eq!(code, Some(1), "{service}'s certificate calling the window engine: {err}");
    }
}

/// `kill -HUP` and wait until `ok()` holds (bounded), or fail with `what`.
async fn hup_until(pid: u32, what: &str, ok: impl AsyncFn() -> bool) {
    use std::time::Duration;
    let sent = tokio::process::Command::new("kill").args(["-HUP", &pid.to_string()]).status().await.unwrap();
    assert!(sent.success());
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !ok().await {
        assert!(std::time::Instant::now() < deadline, "{what}: not within 10 s of SIGHUP");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn sighup_replaces_the_certificates_of_the_gateway_and_of_an_sdk_engine() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (old, new) = (Ca::new("the old CA"), Ca::new("the new CA"));
    let (old_pem, new_pem) = (write_file(d, "old.pem", &old.pem), write_file(d, "new.pem", &new.pem));
    let s = |p: &Path| p.to_str().unwrap().to_owned();
    let trusts = |p: &Path| vec!["--tls-ca".to_owned(), s(p)];

    // The gateway: its API certificate.
    let (crt, key) = old.leaf_files(d, "api", &["localhost", "127.0.0.1"], true, false);
    let g = serve(d, "reloaded", &format!("cert: {:?}, key: {:?}", s(&crt), s(&key))).await;
    let url = https(&g);
    let reaches = |ca: &Path| {
        let (url, flags) = (url.clone(), trusts(ca));
        async move { status(&url, &flags.iter().map(String::as_str).collect::<Vec<_>>()).await.0 == Some(0) }
    };
    assert!(reaches(&old_pem).await && !reaches(&new_pem).await, "before: the old CA's certificate");
    new.leaf_files(d, "api", &["localhost", "127.0.0.1"], true, false);
    hup_until(g.pid(), "the gateway serving the new certificate", async || reaches(&new_pem).await).await;
    assert!(!reaches(&old_pem).await, "new connections no longer get the old certificate");
    // A reload that cannot be read keeps the running certificate.
    std::fs::write(&key, "not a key").unwrap();
    let sent = tokio::process::Command::new("kill").args(["-HUP", &g.pid().to_string()]).status().await.unwrap();
    assert!(sent.success());
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert!(reaches(&new_pem).await, "a bad key on reload changes nothing");

    // An SDK engine: its server certificate.
    let (crt, key) = old.leaf_files(d, "engine", &["localhost", "127.0.0.1"], true, false);
    let args = ["--listen", "127.0.0.1:0", "--fault", "none", "--tls-cert", &s(&crt), "--tls-key", &s(&key)];
    let engine = EngineProcess::start(bin("ctxgate-fault-engine"), &args).await.unwrap();
    let endpoint = https(&engine);
    let healthy = |ca: &Path| {
        let (endpoint, ca) = (endpoint.clone(), s(ca));
        async move {
            let out = tokio::process::Command::new(bin("ctxgate-engine-window"))
                .args(["health", "--endpoint", &endpoint, "--tls-ca", &ca])
                .output()
                .await
                .unwrap();
            out.status.success()
        }
    };
    assert!(healthy(&old_pem).await && !healthy(&new_pem).await, "before: the old CA's certificate");
    new.leaf_files(d, "engine", &["localhost", "127.0.0.1"], true, false);
    hup_until(engine.pid(), "the engine serving the new certificate", async || healthy(&new_pem).await).await;
    assert!(!healthy(&old_pem).await, "new connections no longer get the old certificate");
}

/// One managed turn on a client of its own that connects now: how long
/// from the first connect to the turn's end.
async fn first_turn(url: &str, ca: &str, key: &str) -> std::time::Duration {
    use tokio_stream::StreamExt;
    let started = std::time::Instant::now();
    let tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(ca))
        .domain_name("localhost");
    let channel = tonic::transport::Endpoint::from_shared(url.to_owned()).unwrap().tls_config(tls).unwrap();
    let mut client = ctxgate_proto::gateway::gateway_client::GatewayClient::new(channel.connect().await.unwrap());
    let req = ctxgate_proto::gateway::RunTurnRequest {
        session: Some(ctxgate_proto::gateway::SessionRef { agent_id: String::new(), session_key: key.into() }),
        message: "hello".into(),
        ..Default::default()
    };
    let mut events = client.run_turn(req).await.unwrap().into_inner();
    while let Some(e) = events.next().await {
        e.unwrap();
    }
    started.elapsed()
}

#[tokio::test]
async fn two_thousand_idle_connects_do_not_delay_a_new_clients_first_turn() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ca = Ca::new("idle CA");
    let (crt, key) = ca.leaf_files(d, "gateway", &["localhost", "127.0.0.1"], true, false);
    let g = serve(d, "idle", &format!("cert: '{}', key: '{}'", crt.display(), key.display())).await;
    let url = https(&g);
    let addr = g.endpoint.trim_start_matches("http://").to_owned();
    let unloaded = first_turn(&url, &ca.pem, "before").await;
    // Connect and say nothing: no TLS handshake, ever.
    let mut idle = Vec::with_capacity(2_000);
    for _ in 0..2_000 {
        idle.push(tokio::net::TcpStream::connect(&addr).await.unwrap());
    }
    let loaded = first_turn(&url, &ca.pem, "during").await;
    assert!(
        loaded < unloaded + std::time::Duration::from_secs(1),
        "2,000 idle connects delayed a new client's first turn: {loaded:?} (unloaded {unloaded:?})"
    );
    drop(idle);
}
