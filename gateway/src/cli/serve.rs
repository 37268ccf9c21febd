//! `ctxgate serve`: the gateway itself, with SIGHUP reloading the config
//! file and Ctrl-C or SIGTERM draining it.

use std::io::Write;
use std::path::PathBuf;

use super::CliError;
use crate::config::Config;

/// The target of serve's log lines: `ctxgate::cli`, as before the CLI was
/// split into files, so log lines (and filters on them) do not change with the layout.
const LOG_TARGET: &str = "ctxgate::cli";

/// `ctxgate serve`: config, then bind, then run until Ctrl-C or SIGTERM.
pub async fn run(config: Option<PathBuf>, listen: Option<String>, state_dir: Option<PathBuf>) -> Result<(), CliError> {
    // `--listen` is CTXGATE_LISTEN given on the command line: applied
    // before the config is validated, as the environment is.
    let env = move |k: &str| match (&listen, k) {
        (Some(l), "CTXGATE_LISTEN") => Some(l.clone()),
        _ => std::env::var(k).ok(),
    };
    let mut cfg = Config::load(config.as_deref(), &env)?;
    if let Some(d) = state_dir {
        cfg.state_dir = d;
    }
    let store = crate::store::open(&cfg).await.map_err(crate::api::server::ServeError::from)?;
    let listeners = crate::api::server::Listeners::bind(&cfg).await?;
    let addr = listeners.api.local_addr()?;
    let host = listeners.host.local_addr()?;
    let metrics = listeners.metrics.as_ref().and_then(|l| l.local_addr().ok());
    let store_at = match &cfg.store.url {
        Some(url) => crate::store::postgres::redacted(url),
        None => cfg.state_dir.display().to_string(),
    };
    tracing::info!(target: LOG_TARGET, %addr, %host, ?metrics, store = %store_at, provider = ?cfg.models.provider, "ctxgate serving");
    println!("listening on {addr}");
    let _ = std::io::stdout().flush();
    // SIGHUP re-reads the config file and applies its engine settings.
    let (reload_tx, reloads) = tokio::sync::mpsc::channel(1);
    let (path, overrides, env) = (config.clone(), cfg.clone(), env.clone());
    tokio::spawn(async move {
        let Ok(mut hup) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) else { return };
        while hup.recv().await.is_some() {
            match Config::load(path.as_deref(), &env) {
                Ok(mut next) => {
                    // Listen addresses and state dir cannot change without a restart.
                    next.gateway.listen.clone_from(&overrides.gateway.listen);
                    next.gateway.host_listen.clone_from(&overrides.gateway.host_listen);
                    next.state_dir.clone_from(&overrides.state_dir);
                    let _ = reload_tx.send(next).await;
                }
                Err(e) => {
                    tracing::error!(target: LOG_TARGET, error = %e, "config reload failed; keeping the running configuration")
                }
            }
        }
    });
    Ok(crate::api::server::run_with_reloads(cfg, store, listeners, shutdown_signal(), reloads).await?)
}

async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! { _ = tokio::signal::ctrl_c() => {}, () = term => {} }
}
