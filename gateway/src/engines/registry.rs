//! The engines of one configuration: the core-owned legacy engine, one
//! guarded client (and health monitor) per enabled `plugins.entries.<id>`,
//! and the slot's selection. A config reload builds a new registry; the old
//! one's monitors stop when it is dropped.

use std::collections::BTreeMap;
use std::sync::Arc;

use ctxgate_proto::gateway as api;
use tokio_util::sync::CancellationToken;

use super::guarded::Guarded;
use super::remote::Remote;
use super::{Engine, Legacy};
use crate::config::Config;
use crate::metrics::Metrics;

pub struct Registry {
    pub legacy: Arc<Legacy>,
    engines: BTreeMap<String, Arc<Guarded>>,
    selected: Option<String>,
    stop: CancellationToken,
}

impl Drop for Registry {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl Registry {
    /// Builds clients for every enabled entry and starts their monitors.
    /// Must run inside a tokio runtime.
    pub fn build(config: &Config, metrics: &Metrics) -> Self {
        let legacy = Arc::new(Legacy::default());
        let stop = CancellationToken::new();
        let mut engines = BTreeMap::new();
        for (id, entry) in config.plugins.entries.iter().filter(|(_, e)| e.enabled) {
            // Entries were validated with the config; a failure here is a bug.
            match Remote::new(id, entry, config.compaction_timeout()) {
                Ok(remote) => {
                    let g = Arc::new(Guarded::new(remote, legacy.clone(), metrics.clone(), entry.max_concurrent_calls));
                    tokio::spawn(super::health::monitor(g.clone(), stop.child_token()));
                    engines.insert(id.clone(), g);
                }
                Err(e) => tracing::error!(engine = %id, error = %e, "cannot build the engine client"),
            }
        }
        let selected = config.selected_engine().map(|(id, _)| id.to_owned());
        if let Some(slot) = config.plugins.slots.context_engine.as_deref().map(str::trim)
            && !matches!(slot, "" | "legacy" | "none")
            && selected.is_none()
        {
            tracing::warn!(slot, "plugins.slots.contextEngine names no enabled, allowed entry; using \"legacy\"");
        }
        Self { legacy, engines, selected, stop }
    }

    /// The configured engine (guarded), if the slot selects a remote one.
    pub fn selected(&self) -> Option<&Arc<Guarded>> {
        self.engines.get(self.selected.as_deref()?)
    }

    pub fn legacy(&self) -> Arc<dyn Engine> {
        self.legacy.clone()
    }

    pub fn get(&self, id: &str) -> Option<&Arc<Guarded>> {
        self.engines.get(id)
    }

    /// The ids of the engines in service now (attached, not quarantined).
    pub fn in_service(&self) -> Vec<String> {
        self.engines.iter().filter(|(_, g)| !g.is_quarantined()).map(|(id, _)| id.clone()).collect()
    }

    /// Operator re-admission (`ctxgate engines readmit ID`).
    pub fn readmit(&self, id: &str) -> Option<bool> {
        self.engines.get(id).map(|g| g.readmit("operator readmit"))
    }

    /// Engines for Status: legacy first, then every remote one.
    pub fn status(&self) -> Vec<api::EngineStatus> {
        let legacy = self.legacy.info();
        let mut out = vec![api::EngineStatus {
            id: legacy.id,
            name: legacy.name,
            endpoint: "in-process".into(),
            health: "SERVING".into(),
            quarantine: None,
            methods: vec![],
        }];
        for (id, g) in &self.engines {
            let info = g.remote.info();
            out.push(api::EngineStatus {
                id: id.clone(),
                name: info.map(|i| i.name).unwrap_or_default(),
                endpoint: g.remote.endpoint.clone(),
                health: g.health().as_str().into(),
                quarantine: g.quarantine_record().map(|q| api::Quarantine {
                    operation: q.operation,
                    reason: q.reason,
                    since_unix_ms: q.since.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64),
                }),
                methods: g
                    .stats()
                    .into_iter()
                    .map(|(m, s)| api::MethodCounters {
                        method: m.into(),
                        calls: s.calls,
                        failures: s.failures,
                        timeouts: s.timeouts,
                        fallbacks: s.fallbacks,
                        shed: s.shed,
                    })
                    .collect(),
            });
        }
        out
    }

    pub fn selected_id(&self) -> &str {
        self.selected.as_deref().unwrap_or(super::LEGACY_ID)
    }
}
