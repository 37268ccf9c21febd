"""The RPCs of `contextengine.v1.ContextEngine` (`proto/src/method.rs`): their
wire names and which ones every engine implements."""

ENGINE_SERVICE = "contextengine.v1.ContextEngine"
HOST_SERVICE = "contextengine.v1.Host"

# Every RPC, in lifecycle order.
ALL = (
    "GetInfo", "Bootstrap", "Ingest", "IngestBatch", "Assemble", "Compact", "AfterTurn", "CommitTurn",
    "Maintain", "PrepareSubagentSpawn", "RollbackSubagentSpawn", "OnSubagentEnded", "Dispose",
    "ForgetSession", "CallTool",
)
REQUIRED = frozenset({"GetInfo", "Ingest", "Assemble", "Compact"})
