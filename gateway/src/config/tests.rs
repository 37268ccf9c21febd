use super::*;

fn load_str(text: &str) -> Result<Config, ConfigError> {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("c.json5");
    std::fs::write(&p, text).unwrap();
    Config::load(Some(&p), |_| None)
}

#[test]
fn no_file_gives_working_defaults() {
    let c = Config::load(None, |_| None).unwrap();
    assert_eq!(c.listen_addr().unwrap().to_string(), "127.0.0.1:7300");
    assert_eq!(c.models.provider, ProviderKind::Offline);
    assert_eq!(c.agents.defaults.compaction.timeout_seconds, 180);
    assert_eq!(c.reserve_tokens(), 8_000);
}

#[test]
fn json5_with_comments_and_openclaw_keys() {
    let c = load_str(
        "{ // comment\n agents: { defaults: { compaction: { keepRecentTokens: 500, timeoutSeconds: 5 } } },\n plugins: { slots: { contextEngine: 'legacy' } }, }",
    )
    .unwrap();
    assert_eq!(c.agents.defaults.compaction.keep_recent_tokens, 500);
}

#[test]
fn unknown_keys_and_bad_values_name_their_path() {
    let e = load_str("{ agents: { defaults: { compaction: { keepRecentTokenz: 5 } } } }").unwrap_err().to_string();
    assert!(e.contains("agents.defaults.compaction") && e.contains("keepRecentTokenz"), "{e}");
    let e = load_str("{ models: { contextWindow: 'big' } }").unwrap_err().to_string();
    assert!(e.contains("models.contextWindow"), "{e}");
    let e = load_str("{ gateway: { listen: 'nowhere' } }").unwrap_err().to_string();
    assert!(e.contains("gateway.listen"), "{e}");
    let e =
        load_str("{ plugins: { entries: { legacy: { endpoint: 'http://127.0.0.1:1' } } } }").unwrap_err().to_string();
    assert!(e.contains("plugins.entries.legacy") && e.contains("reserved"), "{e}");
    let e = load_str("{ plugins: { entries: { w: { endpoint: 'ftp://x' } } } }").unwrap_err().to_string();
    assert!(e.contains("plugins.entries.w.endpoint"), "{e}");
    for bad in [
        "dns:///",
        "dns:///name",
        "dns:///na me:1",
        "dns:///unix:///x",
        "dns://name:1",
        "ipv4:",
        "ipv4:1.2.3.4",
        "ipv4:[::1]:1",
        "ipv6:127.0.0.1:1",
    ] {
        let e = load_str(&format!("{{ plugins: {{ entries: {{ w: {{ endpoint: '{bad}' }} }} }} }}"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("plugins.entries.w.endpoint") && e.contains(&format!("{bad:?}")), "{bad}: {e}");
    }
    for bad in ["unix:///tmp/c.sock", "https://unix:///tmp/c.sock", "not an endpoint"] {
        let e = load_str(&format!("{{ gateway: {{ otlp: {{ endpoint: '{bad}' }} }} }}")).unwrap_err().to_string();
        assert!(e.contains("gateway.otlp.endpoint") && e.contains("http://HOST:PORT"), "{bad}: {e}");
    }
    assert!(load_str("{ gateway: { otlp: { endpoint: 'https://collector:4317', ca: 'ca.pem' } } }").is_ok());
    let e = load_str("{ gateway: { otlp: { endpoint: 'http://collector:4317', ca: 'ca.pem' } } }").unwrap_err();
    assert!(e.to_string().contains("gateway.otlp.ca"), "{e}");
    let c = load_str("{ gateway: { otlp: { endpoint: 'http://collector:4317' } } }").unwrap();
    assert_eq!(c.gateway.otlp.map(|o| o.service_name).as_deref(), Some("ctxgate"));
    let c = load_str("{ plugins: { entries: { w: { endpoint: 'dns:///engine-window:7401' } } } }").unwrap();
    let w = &c.plugins.entries["w"];
    assert_eq!(w.target(), Ok(Target::Dns { host: "engine-window".into(), port: 7401 }));
    assert!(!w.uses_tls());
    let c =
        load_str("{ plugins: { entries: { w: { endpoint: 'ipv4:127.0.0.1:2, 127.0.0.1:1,127.0.0.1:2' } } } }").unwrap();
    let two = ["127.0.0.1:1".parse().unwrap(), "127.0.0.1:2".parse().unwrap()];
    assert_eq!(c.plugins.entries["w"].target(), Ok(Target::Static(two.to_vec())));
    let e = load_str("{ plugins: { entries: { w: { endpoint: 'http://127.0.0.1:1', timeouts: { asemble: 1 } } } } }")
        .unwrap_err()
        .to_string();
    assert!(e.contains("plugins.entries.w.timeouts") && e.contains("asemble"), "{e}");
    let e = load_str("{ plugins: { entries: { w: { endpoint: 'http://127.0.0.1:1', tls: { ca: 'x' } } } } }")
        .unwrap_err()
        .to_string();
    assert!(e.contains("plugins.entries.w.tls"), "{e}");
    let e = load_str("{ models: { provider: 'openai', baseUrl: 'not a url', model: 'm' } }").unwrap_err().to_string();
    assert!(e.contains("models.baseUrl"), "{e}");
}

#[test]
fn the_slot_selects_enabled_allowed_entries_only() {
    let base = "entries: { w: { endpoint: 'http://127.0.0.1:7401' }, off: { endpoint: 'unix:///tmp/x.sock', enabled: false } }";
    let pick = |slot: &str, deny: &str| {
        let c = load_str(&format!("{{ plugins: {{ slots: {{ contextEngine: '{slot}' }}, deny: [{deny}], {base} }} }}"))
            .unwrap();
        c.selected_engine().map(|(id, _)| id.to_owned())
    };
    assert_eq!(pick("w", ""), Some("w".into()));
    assert_eq!(pick("legacy", ""), None);
    assert_eq!(pick("none", ""), None);
    assert_eq!(pick("off", ""), None, "disabled: legacy, silently");
    assert_eq!(pick("w", "'w'"), None, "denied: legacy, silently");
    assert_eq!(pick("gone", ""), None, "a removed entry resets the slot to legacy");
}

#[test]
fn the_documented_examples_load() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/examples");
    // compose.json5 names certificates only the stack has: tests/process/tls.rs
    // loads it with certificates of its own.
    for name in ["small-window.json5", "openai.json5", "remote-window.json5"] {
        Config::load(Some(&dir.join(name)), |_| None).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

#[test]
fn env_overrides_win_and_are_validated() {
    let env = |k: &str| match k {
        "CTXGATE_LISTEN" => Some("127.0.0.1:9999".to_owned()),
        "CTXGATE_CONTEXT_WINDOW" => Some("64000".to_owned()),
        _ => None,
    };
    let c = Config::load(None, env).unwrap();
    assert_eq!(c.listen_addr().unwrap().port(), 9999);
    assert_eq!(c.models.context_window, 64_000);
    let e = Config::load(None, |k| (k == "CTXGATE_CONTEXT_WINDOW").then(|| "lots".to_owned())).unwrap_err();
    assert!(e.to_string().contains("models.contextWindow"));
    let c = Config::load(None, |k| (k == "CTXGATE_OTLP_ENDPOINT").then(|| "http://127.0.0.1:4317".to_owned())).unwrap();
    assert_eq!(c.gateway.otlp.unwrap().endpoint, "http://127.0.0.1:4317");
    let e = Config::load(None, |k| (k == "CTXGATE_OTLP_ENDPOINT").then(|| "ftp://x".to_owned())).unwrap_err();
    assert!(e.to_string().contains("gateway.otlp.endpoint"), "{e}");
}

#[test]
fn a_client_api_other_hosts_reach_must_authenticate_its_clients() {
    let open = load_str("{ gateway: { listen: '0.0.0.0:7300' } }").unwrap_err().to_string();
    for key in ["gateway.auth.token", "gateway.tls.clientCa", "gateway.allowUnauthenticated"] {
        assert!(open.contains(key), "{open}");
    }
    assert!(load_str("{ gateway: { listen: '[::]:7300' } }").is_err(), "IPv6 all-interfaces too");
    assert!(load_str("{ gateway: { listen: '0.0.0.0:7300', auth: { token: '0123456789abcdef' } } }").is_ok());
    assert!(load_str("{ gateway: { listen: '0.0.0.0:7300', allowUnauthenticated: true } }").is_ok());
    assert!(load_str("{ gateway: { listen: '[::1]:7300' } }").is_ok(), "loopback needs nothing");
    let env = |k: &str| (k == "CTXGATE_AUTH_TOKEN").then(|| "0123456789abcdef".to_owned());
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("c.json5");
    std::fs::write(&p, "{ gateway: { listen: '0.0.0.0:7300' } }").unwrap();
    assert!(Config::load(Some(&p), env).is_ok(), "the token may come from the environment");
}

#[test]
fn a_token_short_enough_to_guess_is_refused() {
    for short in ["t", "s3cret", "0123456789abcde"] {
        let e = load_str(&format!("{{ gateway: {{ auth: {{ token: '{short}' }} }} }}")).unwrap_err().to_string();
        assert!(e.contains("gateway.auth.token") && e.contains("at least 16"), "{short}: {e}");
    }
    assert!(load_str("{ gateway: { auth: { token: '0123456789abcdef' } } }").is_ok());
}

#[test]
fn the_host_listener_is_its_own() {
    let c = Config::load(None, |_| None).unwrap();
    assert_eq!(c.host_listen_addr().unwrap().to_string(), "127.0.0.1:0", "loopback, a free port");
    let c = load_str("{ gateway: { listen: '0.0.0.0:7300', auth: { token: '0123456789abcdef' } } }").unwrap();
    assert_eq!(c.host_listen_addr().unwrap().to_string(), "127.0.0.1:0", "not on all interfaces unless asked");
    let e = load_str("{ gateway: { hostListen: '127.0.0.1:7300' } }").unwrap_err().to_string();
    assert!(e.contains("gateway.hostListen"), "{e}");
    let e = load_str("{ gateway: { hostListen: 'x' } }").unwrap_err().to_string();
    assert!(e.contains("gateway.hostListen"), "{e}");
    let bound = "0.0.0.0:7301".parse().unwrap();
    assert_eq!(c.host_endpoint(bound), "http://127.0.0.1:7301");
}

#[test]
fn postgres_sslmode_prefer_is_refused_with_what_to_use() {
    let e = load_str("{ store: { url: 'postgres://u@db.example.com/ctx?sslmode=prefer' } }").unwrap_err().to_string();
    assert!(e.contains("store.url") && e.contains("sslmode=require") && e.contains("sslmode=disable"), "{e}");
    assert!(load_str("{ store: { url: 'postgres://u@db.example.com/ctx?sslmode=require' } }").is_ok());
    // Percent-encoded, as the driver decodes it.
    for url in ["postgres://u@db.example.com/ctx?sslmode=pr%65fer", "postgres://u@db.example.com/ctx?ss%6Cmode=prefer"]
    {
        let e = load_str(&format!("{{ store: {{ url: '{url}' }} }}")).unwrap_err().to_string();
        assert!(e.contains("sslmode=require"), "{url}: {e}");
    }
    assert!(load_str("{ store: { url: 'postgres://u@db.example.com/ctx' } }").is_ok(), "unset: plaintext, warned");
}

#[test]
fn a_commit_is_held_after_at_least_one_failure() {
    assert_eq!(Config::load(None, |_| None).unwrap().store.hold_commit_after_failures, 3);
    assert_eq!(Config::load(None, |_| None).unwrap().store.tail_cache_mib, 32);
    assert_eq!(load_str("{ store: { tailCacheMiB: 256 } }").unwrap().store.tail_cache_mib, 256);
    let e = load_str("{ store: { tailCacheMiB: 0 } }").unwrap_err().to_string();
    assert!(e.contains("store.tailCacheMiB"), "{e}");
    assert_eq!(load_str("{ store: { holdCommitAfterFailures: 1 } }").unwrap().store.hold_commit_after_failures, 1);
    let e = load_str("{ store: { holdCommitAfterFailures: 0 } }").unwrap_err().to_string();
    assert!(e.contains("store.holdCommitAfterFailures"), "{e}");
}

#[test]
fn the_drop_audit_is_kept_at_least_a_day() {
    assert_eq!(Config::load(None, |_| None).unwrap().store.audit_retention_days, 90);
    let e = load_str("{ store: { auditRetentionDays: 0 } }").unwrap_err().to_string();
    assert!(e.contains("store.auditRetentionDays"), "{e}");
}

#[test]
fn metrics_on_a_port_alone_listen_on_loopback() {
    for (listen, want) in [(":9464", "127.0.0.1:9464"), ("9464", "127.0.0.1:9464"), ("0.0.0.0:9464", "0.0.0.0:9464")] {
        let c = load_str(&format!("{{ gateway: {{ metricsListen: {listen:?} }} }}")).unwrap();
        assert_eq!(c.metrics_addr().unwrap().unwrap().to_string(), want, "{listen}");
    }
    let e = load_str("{ gateway: { metricsListen: 'nine' } }").unwrap_err().to_string();
    assert!(e.contains("gateway.metricsListen"), "{e}");
}

#[test]
fn connection_limits_out_of_range_name_their_key() {
    let e = load_str("{ gateway: { limits: { connections: { openTotal: 0 } } } }").unwrap_err().to_string();
    assert!(e.contains("gateway.limits.connections.openTotal"), "{e}");
    let e = load_str("{ gateway: { limits: { connections: { maxAgeSeconds: 3 } } } }").unwrap_err().to_string();
    assert!(e.contains("maxAgeSeconds"), "{e}");
}
