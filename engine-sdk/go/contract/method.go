// Package contract is the contract's vocabulary for Go, the counterpart of
// the Rust crate ctxgate-proto: the RPC names, the size limits, the token
// estimate, request and result validation with field paths, the typed
// history_gap status and W3C trace context. The generated messages are in
// package pb.
package contract

// Method is one RPC of contextengine.v1.ContextEngine, by its wire name
// (the name in EngineInfo.implemented_methods).
type Method string

// Every RPC, in lifecycle order.
const (
	GetInfo               Method = "GetInfo"
	Bootstrap             Method = "Bootstrap"
	Ingest                Method = "Ingest"
	IngestBatch           Method = "IngestBatch"
	Assemble              Method = "Assemble"
	Compact               Method = "Compact"
	AfterTurn             Method = "AfterTurn"
	CommitTurn            Method = "CommitTurn"
	Maintain              Method = "Maintain"
	PrepareSubagentSpawn  Method = "PrepareSubagentSpawn"
	RollbackSubagentSpawn Method = "RollbackSubagentSpawn"
	OnSubagentEnded       Method = "OnSubagentEnded"
	Dispose               Method = "Dispose"
	ForgetSession         Method = "ForgetSession"
	CallTool              Method = "CallTool"
)

// AllMethods lists every RPC, in lifecycle order.
var AllMethods = []Method{
	GetInfo, Bootstrap, Ingest, IngestBatch, Assemble, Compact, AfterTurn, CommitTurn, Maintain,
	PrepareSubagentSpawn, RollbackSubagentSpawn, OnSubagentEnded, Dispose, ForgetSession, CallTool,
}

// EngineService is the full name of the engine service (health, reflection).
const EngineService = "contextengine.v1.ContextEngine"

// LegacyEngineID is reserved for the gateway's own engine.
const LegacyEngineID = "legacy"

// Required reports whether every engine implements m (the rest are
// optional: UNIMPLEMENTED means "not implemented").
func (m Method) Required() bool {
	return m == GetInfo || m == Ingest || m == Assemble || m == Compact
}

// Known reports whether m names an RPC of the contract.
func (m Method) Known() bool {
	for _, k := range AllMethods {
		if k == m {
			return true
		}
	}
	return false
}

// ListedIn reports whether implemented (EngineInfo.implemented_methods)
// lists m.
func (m Method) ListedIn(implemented []string) bool {
	for _, s := range implemented {
		if s == string(m) {
			return true
		}
	}
	return false
}
