//! Size limits of the contract (docs/contract.md, "Limits"). Both sides
//! enforce them: a peer that sends more gets RESOURCE_EXHAUSTED.

/// Largest encoded gRPC message either side accepts.
pub const MAX_GRPC_MESSAGE_BYTES: usize = 16 * 1024 * 1024;

/// Largest content of one `AgentMessage` (the summed size of its parts).
pub const MAX_MESSAGE_CONTENT_BYTES: usize = 1024 * 1024;

/// Most `AgentMessage.metadata` entries, and the longest key and value:
/// metadata rides along with every message (stored, logged, relayed), so
/// it is bounded like content is (at most ~1 MiB per message, and no
/// megabyte-sized single value).
pub const MAX_METADATA_ENTRIES: usize = 64;
pub const MAX_METADATA_KEY_BYTES: usize = 256;
pub const MAX_METADATA_VALUE_BYTES: usize = 16 * 1024;

/// Largest id (message, tool call, session, advancement key).
pub const MAX_ID_BYTES: usize = 256;

/// Most messages in one request or result.
pub const MAX_MESSAGES: usize = 20_000;

/// The largest token count a message's `usage` may report: more than any
/// model's window (a peer's `u64::MAX` is refused, not summed).
pub const MAX_USAGE_TOKENS: u64 = 1 << 32;

/// Most tools one engine declares (`EngineInfo.tools`).
pub const MAX_TOOLS: usize = 64;

/// Longest tool name (`^[a-zA-Z0-9_-]{1,64}$`, the common tool-name rule).
pub const MAX_TOOL_NAME_BYTES: usize = 64;

/// Longest tool description.
pub const MAX_TOOL_DESCRIPTION_BYTES: usize = 4 * 1024;

/// Largest JSON Schema of a tool's arguments.
pub const MAX_TOOL_SCHEMA_BYTES: usize = 64 * 1024;

/// Largest arguments a model's tool call may carry to an engine.
pub const MAX_TOOL_ARGUMENTS_BYTES: usize = 256 * 1024;

/// The most text of a tool's result the gateway keeps (it cuts the rest
/// and says so): what the model sees, and what the transcript stores.
pub const MAX_TOOL_RESULT_BYTES: usize = 256 * 1024;
