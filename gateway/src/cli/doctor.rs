//! `ctxgate doctor`: checks the configured context engine without running
//! the gateway — reachable, contract valid, healthy, and runnable on every
//! configured host — and reports in OpenClaw's wording. `--fix` removes the
//! slot override only when every host is incompatible.

use std::path::{Path, PathBuf};
use std::time::Duration;

use ctxgate_proto::ENGINE_SERVICE;
use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient};

use crate::config::{Config, ConfigError, EngineSlot};
use crate::core::types::{HostProfile, Operation};
use crate::engines::Call;
use crate::engines::remote::Remote;

const SLOT: &str = "plugins.slots.contextEngine";

/// Why `ctxgate doctor` exits 1. The findings themselves are printed as
/// the checks run; `NeedsAttention` only points at them.
#[derive(Debug, thiserror::Error)]
pub enum DoctorError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The slot's entry cannot be dialled (its endpoint or TLS settings).
    #[error("{0}")]
    Entry(String),
    #[error("the context engine needs attention (see above)")]
    NeedsAttention,
    /// `--fix`: reading, backing up or rewriting the config file.
    #[error("{}: {source}", path.display())]
    File { path: PathBuf, source: std::io::Error },
    /// `--fix`: the config file is not JSON5.
    #[error("{}: {source}", path.display())]
    Parse { path: PathBuf, source: json5::Error },
    #[error(transparent)]
    Render(#[from] serde_json::Error),
}

/// Runs the checks; `Err` when something needs attention (exit 1).
pub async fn run(config_path: Option<&Path>, fix: bool) -> Result<(), DoctorError> {
    let config = Config::load(config_path, |k| std::env::var(k).ok())?;
    let EngineSlot::Named(slot) = config.plugins.slots.context_engine() else {
        println!("{SLOT}: the default \"legacy\" engine; nothing to check.");
        return Ok(());
    };
    let Some(entry) = config.plugins.entries.get(slot) else {
        return warn(format!(
            "- {SLOT}: could not inspect context engine \"{slot}\" host requirements because it is not registered (no plugins.entries.{slot}); turns use \"legacy\"."
        ));
    };
    if !entry.enabled || config.plugins.deny.iter().any(|d| d == slot) {
        return warn(format!("- {SLOT}: context engine \"{slot}\" is disabled or denied; turns use \"legacy\"."));
    }
    // Replicas are one engine: any one of them answers for all.
    let at = entry.target().map_err(DoctorError::Entry)?.by_name();
    let remote = Remote::new(slot, entry, config.compaction_timeout(), &at, None).map_err(DoctorError::Entry)?;
    let info = match tokio::time::timeout(Duration::from_secs(10), remote.attach(&Call::default())).await {
        Ok(Ok(info)) => info,
        Ok(Err(e)) => {
            return warn(format!(
                "- {SLOT}: could not inspect context engine \"{slot}\" host requirements because it failed to attach at {}: {e}",
                entry.endpoint
            ));
        }
        Err(_) => {
            return warn(format!(
                "- {SLOT}: could not inspect context engine \"{slot}\": no answer from {} within 10 s",
                entry.endpoint
            ));
        }
    };
    println!(
        "{SLOT}: \"{slot}\" is {} {} (contract {}) at {}.",
        info.name, info.version, info.contract_version, entry.endpoint
    );
    let health = HealthClient::new(remote.channel()).check(HealthCheckRequest { service: ENGINE_SERVICE.into() }).await;
    match health {
        Ok(r) if r.get_ref().status == ServingStatus::Serving as i32 => println!("health: SERVING"),
        Ok(r) => println!("- health: {:?}; the gateway would quarantine it", r.get_ref().status),
        Err(s) if s.code() == tonic::Code::Unimplemented => println!("health: no health service (counted as healthy)"),
        Err(s) => println!("- health: check failed: {}", s.message()),
    }
    // The configured agent-run host is the embedded managed driver;
    // harnesses declare their own profile per turn.
    let embedded = HostProfile::embedded();
    let hosts = [(&embedded, "agents.defaults")];
    let problems: Vec<String> = hosts
        .iter()
        .filter_map(|(host, paths)| {
            let label = &host.label;
            host.unmet(slot, &info, Operation::AgentRun).err().map(|m| {
                let m = m.replacen(
                    &format!("cannot run operation \"agent-run\" on {label}"),
                    &format!("is incompatible with {label} ({paths})"),
                    1,
                );
                format!("- {SLOT}: {}", m.replacen("Context engine", "context engine", 1))
            })
        })
        .collect();
    if problems.is_empty() {
        println!("host requirements: met by {}.", embedded.label);
        return Ok(());
    }
    for p in &problems {
        println!("{p}");
    }
    if problems.len() < hosts.len() {
        return warn(format!(
            "- Some configured runtimes support context engine \"{slot}\" and others do not; doctor will not rewrite the global contextEngine slot automatically."
        ));
    }
    if !fix {
        return warn(format!(
            "- Run \"ctxgate doctor --fix\" to remove the {SLOT} override and restore the default \"legacy\", or configure a compatible runtime/harness for agent runs."
        ));
    }
    let Some(path) = config_path else {
        return warn(format!("- {SLOT} comes from the environment or defaults, not a file: nothing to fix here."));
    };
    reset_slot(path)?;
    println!(
        "Reset {SLOT} to the default \"legacy\" because context engine \"{slot}\" is incompatible with every configured agent-run host."
    );
    Ok(())
}

fn warn(message: String) -> Result<(), DoctorError> {
    println!("{message}");
    Err(DoctorError::NeedsAttention)
}

/// Removes the slot from the config file, keeping a `.bak` copy. The file
/// is rewritten as JSON (valid JSON5; comments are not kept — the backup has them).
fn reset_slot(path: &Path) -> Result<(), DoctorError> {
    let io = |source| DoctorError::File { path: path.to_owned(), source };
    let text = std::fs::read_to_string(path).map_err(io)?;
    let mut v: serde_json::Value =
        json5::from_str(&text).map_err(|source| DoctorError::Parse { path: path.to_owned(), source })?;
    if let Some(slots) = v.pointer_mut("/plugins/slots").and_then(|s| s.as_object_mut()) {
        slots.remove("contextEngine");
    }
    let backup = path.with_extension("json5.bak");
    std::fs::write(&backup, &text).map_err(io)?;
    let out = serde_json::to_string_pretty(&v)?;
    std::fs::write(path, out + "\n").map_err(io)?;
    Ok(())
}
