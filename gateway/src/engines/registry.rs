//! The engines of one configuration: the core-owned legacy engine, one
//! replica set (a guarded client and health monitor per address) per
//! enabled `plugins.entries.<id>`, and the slot's selection. A config reload builds a new registry; the old
//! one's monitors stop when it is dropped.

use std::collections::BTreeMap;
use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use super::replicas::Replicas;
use super::{Engine, Legacy};
use crate::config::{Config, EngineSlot};
use crate::metrics::Metrics;

pub struct Registry {
    pub legacy: Arc<Legacy>,
    engines: BTreeMap<String, Arc<Replicas>>,
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
            let (timeout, token) = (config.compaction_timeout(), stop.child_token());
            match Replicas::start(id, entry, timeout, legacy.clone(), metrics.clone(), token) {
                Ok(r) => {
                    engines.insert(id.clone(), r);
                }
                Err(e) => tracing::error!(engine = %id, error = %e, "cannot build the engine client"),
            }
        }
        let selected = config.selected_engine().map(|(id, _)| id.to_owned());
        if let EngineSlot::Named(slot) = config.plugins.slots.context_engine()
            && selected.is_none()
        {
            tracing::warn!(slot, "plugins.slots.contextEngine names no enabled, allowed entry; using \"legacy\"");
        }
        Self { legacy, engines, selected, stop }
    }

    /// The configured engine (guarded), if the slot selects a remote one.
    pub fn selected(&self) -> Option<&Arc<Replicas>> {
        self.engines.get(self.selected.as_deref()?)
    }

    pub fn legacy(&self) -> Arc<dyn Engine> {
        self.legacy.clone()
    }

    pub fn get(&self, id: &str) -> Option<&Arc<Replicas>> {
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

    /// Every configured engine, by id.
    pub fn engines(&self) -> impl Iterator<Item = (&str, &Arc<Replicas>)> {
        self.engines.iter().map(|(id, r)| (id.as_str(), r))
    }

    pub fn selected_id(&self) -> &str {
        self.selected.as_deref().unwrap_or(super::LEGACY_ID)
    }
}
