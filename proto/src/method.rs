//! The RPCs of `ContextEngine` as one typed vocabulary: their wire names
//! (`implemented_methods`, metric labels, status texts), their config keys
//! (`plugins.entries.<id>.timeouts`), and what the contract says of each
//! (required or optional, queued per row or answered by a fallback). This is
//! the only place that spells an RPC's name.

use std::fmt;

/// One RPC of `contextengine.v1.ContextEngine`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Method {
    GetInfo,
    Bootstrap,
    Ingest,
    IngestBatch,
    Assemble,
    Compact,
    AfterTurn,
    CommitTurn,
    Maintain,
    PrepareSubagentSpawn,
    RollbackSubagentSpawn,
    OnSubagentEnded,
    Dispose,
    ForgetSession,
    CallTool,
}

impl Method {
    /// Every RPC, in lifecycle order.
    pub const ALL: [Method; 15] = [
        Self::GetInfo,
        Self::Bootstrap,
        Self::Ingest,
        Self::IngestBatch,
        Self::Assemble,
        Self::Compact,
        Self::AfterTurn,
        Self::CommitTurn,
        Self::Maintain,
        Self::PrepareSubagentSpawn,
        Self::RollbackSubagentSpawn,
        Self::OnSubagentEnded,
        Self::Dispose,
        Self::ForgetSession,
        Self::CallTool,
    ];

    /// The name on the wire and in `EngineInfo.implemented_methods`.
    pub const fn name(self) -> &'static str {
        match self {
            Self::GetInfo => "GetInfo",
            Self::Bootstrap => "Bootstrap",
            Self::Ingest => "Ingest",
            Self::IngestBatch => "IngestBatch",
            Self::Assemble => "Assemble",
            Self::Compact => "Compact",
            Self::AfterTurn => "AfterTurn",
            Self::CommitTurn => "CommitTurn",
            Self::Maintain => "Maintain",
            Self::PrepareSubagentSpawn => "PrepareSubagentSpawn",
            Self::RollbackSubagentSpawn => "RollbackSubagentSpawn",
            Self::OnSubagentEnded => "OnSubagentEnded",
            Self::Dispose => "Dispose",
            Self::ForgetSession => "ForgetSession",
            Self::CallTool => "CallTool",
        }
    }

    /// The key naming it in config (`plugins.entries.<id>.timeouts`):
    /// the wire name in camelCase, as OpenClaw's config spells methods.
    pub const fn config_key(self) -> &'static str {
        match self {
            Self::GetInfo => "getInfo",
            Self::Bootstrap => "bootstrap",
            Self::Ingest => "ingest",
            Self::IngestBatch => "ingestBatch",
            Self::Assemble => "assemble",
            Self::Compact => "compact",
            Self::AfterTurn => "afterTurn",
            Self::CommitTurn => "commitTurn",
            Self::Maintain => "maintain",
            Self::PrepareSubagentSpawn => "prepareSubagentSpawn",
            Self::RollbackSubagentSpawn => "rollbackSubagentSpawn",
            Self::OnSubagentEnded => "onSubagentEnded",
            Self::Dispose => "dispose",
            Self::ForgetSession => "forgetSession",
            Self::CallTool => "callTool",
        }
    }

    /// Every engine implements it (the rest are optional: an engine lists
    /// what it implements, and UNIMPLEMENTED also means "not implemented").
    pub const fn required(self) -> bool {
        matches!(self, Self::GetInfo | Self::Ingest | Self::Assemble | Self::Compact)
    }

    /// The gateway queues it per row and retries it rather than answer it
    /// by a fallback: a refusal is about that row, not the engine.
    pub const fn queued(self) -> bool {
        matches!(self, Self::CommitTurn | Self::ForgetSession)
    }

    /// The method of a wire name.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.name() == name)
    }

    /// The method of a config key.
    pub fn from_config_key(key: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.config_key() == key)
    }

    /// Whether `info` lists this method as implemented.
    pub fn listed_in(self, implemented: &[String]) -> bool {
        implemented.iter().any(|m| m == self.name())
    }
}

impl fmt::Display for Method {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::Method;

    #[test]
    fn names_and_config_keys_round_trip_and_differ_only_in_the_first_letter() {
        for m in Method::ALL {
            assert_eq!(Method::from_name(m.name()), Some(m));
            assert_eq!(Method::from_config_key(m.config_key()), Some(m));
            let (wire, key) = (m.name(), m.config_key());
            assert_eq!(wire[..1].to_lowercase() + &wire[1..], key);
        }
        assert_eq!(Method::ALL.iter().filter(|m| m.required()).count(), 4);
        assert_eq!(Method::from_name("getInfo"), None);
    }
}
