//! Size limits of the contract (docs/contract.md, "Limits"). Both sides
//! enforce them: a peer that sends more gets RESOURCE_EXHAUSTED.

/// Largest encoded gRPC message either side accepts.
pub const MAX_GRPC_MESSAGE_BYTES: usize = 16 * 1024 * 1024;

/// Largest content of one `AgentMessage` (the summed size of its parts).
pub const MAX_MESSAGE_CONTENT_BYTES: usize = 1024 * 1024;

/// Largest id (message, tool call, session, advancement key).
pub const MAX_ID_BYTES: usize = 256;

/// Most messages in one request or result.
pub const MAX_MESSAGES: usize = 20_000;
