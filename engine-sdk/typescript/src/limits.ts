// Size limits of the contract (docs/contract.md, "Limits"), the same
// numbers as proto/src/limits.rs. Both sides enforce them.

/** Largest encoded gRPC message either side accepts. */
export const MAX_GRPC_MESSAGE_BYTES = 16 * 1024 * 1024;
/** Largest content of one AgentMessage (the summed size of its parts). */
export const MAX_MESSAGE_CONTENT_BYTES = 1024 * 1024;
export const MAX_METADATA_ENTRIES = 64;
export const MAX_METADATA_KEY_BYTES = 256;
export const MAX_METADATA_VALUE_BYTES = 16 * 1024;
/** Largest id (message, tool call, session, advancement key). */
export const MAX_ID_BYTES = 256;
/** Most messages in one request or result. */
export const MAX_MESSAGES = 20_000;
export const MAX_TOOLS = 64;
export const MAX_TOOL_NAME_BYTES = 64;
export const MAX_TOOL_DESCRIPTION_BYTES = 4 * 1024;
export const MAX_TOOL_SCHEMA_BYTES = 64 * 1024;
export const MAX_TOOL_ARGUMENTS_BYTES = 256 * 1024;
export const MAX_TOOL_RESULT_BYTES = 256 * 1024;
/** What a ReadTranscript collects at most, in all (a hostile host that
 * streams for ever meets these, not the engine's memory). */
export const MAX_TRANSCRIPT_BYTES = 16 * 1024 * 1024;
export const MAX_TRANSCRIPT_ENTRIES = 20_000;
