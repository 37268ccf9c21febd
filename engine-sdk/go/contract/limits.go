package contract

// Size limits of the contract (docs/contract.md, "Limits"); both sides
// enforce them: a peer that sends more gets RESOURCE_EXHAUSTED.
const (
	// MaxGRPCMessageBytes is the largest encoded gRPC message either side accepts.
	MaxGRPCMessageBytes = 16 * 1024 * 1024
	// MaxMessageContentBytes bounds one AgentMessage (the summed size of its parts).
	MaxMessageContentBytes = 1024 * 1024
	// MaxMetadataEntries, MaxMetadataKeyBytes and MaxMetadataValueBytes bound
	// AgentMessage.metadata, which rides along with every message.
	MaxMetadataEntries    = 64
	MaxMetadataKeyBytes   = 256
	MaxMetadataValueBytes = 16 * 1024
	// MaxIDBytes is the largest id (message, tool call, session, advancement key).
	MaxIDBytes = 256
	// MaxMessages is the most messages in one request or result.
	MaxMessages = 20_000
	// MaxTools is the most tools one engine declares.
	MaxTools = 64
	// MaxToolNameBytes is the longest tool name (^[a-zA-Z0-9_-]{1,64}$).
	MaxToolNameBytes = 64
	// MaxToolDescriptionBytes is the longest tool description.
	MaxToolDescriptionBytes = 4 * 1024
	// MaxToolSchemaBytes is the largest JSON Schema of a tool's arguments.
	MaxToolSchemaBytes = 64 * 1024
	// MaxToolArgumentsBytes is the largest arguments a tool call may carry.
	MaxToolArgumentsBytes = 256 * 1024
	// MaxToolResultBytes is the most tool result text the gateway keeps.
	MaxToolResultBytes = 256 * 1024
)
