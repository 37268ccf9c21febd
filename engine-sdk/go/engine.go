// Package enginesdk serves a ctxgate context engine written in Go: the
// engine implements Engine (and any of the optional interfaces below), and
// Main or Server serves it over gRPC with the contract's guarantees —
// requests validated before engine code runs, each call bounded by its
// context (deadline and client cancellation), a panic contained to its
// call, a per-call limit with a retry pushback, grpc.health.v1 (NOT_SERVING
// while draining) and reflection, the typed history_gap, a Host client
// behind a host allow-list, TLS reloaded on SIGHUP, W3C trace context with
// spans over OTLP, and a SIGTERM drain. The generated messages are in
// package pb, the contract's vocabulary (limits, validation, estimate) in
// package contract.
package enginesdk

import (
	"context"

	"github.com/ctxgate/ctxgate/engine-sdk/go/pb"
)

// Engine is what every context engine implements: the four required
// methods of the contract. Requests arrive validated (ids present, roles
// known, sizes within limits). ctx carries the call's deadline and is
// cancelled when the caller goes away or the deadline passes; it also
// carries the call's Host client (Host) and trace (Span).
//
// Errors: return a status error (status.Error) for a specific gRPC code,
// HistoryGap for a DELTA cursor the engine does not hold, or ctx.Err();
// any other error is INTERNAL for that call, its text logged, never sent.
type Engine interface {
	GetInfo(ctx context.Context) (*pb.EngineInfo, error)
	Ingest(ctx context.Context, req *pb.IngestRequest) (*pb.IngestResult, error)
	Assemble(ctx context.Context, req *pb.AssembleRequest) (*pb.AssembleResult, error)
	// Compact reports progress through p and ends with one outcome: a
	// result (Compacted) or a delegation to the host's own compaction
	// (DelegateToHost).
	Compact(ctx context.Context, req *pb.CompactRequest, p *Progress) (CompactOutcome, error)
}

// The optional methods: an engine implements the interfaces of those it
// offers; the others answer UNIMPLEMENTED, which the gateway reads as "not
// implemented". When GetInfo leaves implemented_methods empty, the SDK
// lists the methods the engine's type implements.
type (
	Bootstrapper interface {
		Bootstrap(ctx context.Context, req *pb.BootstrapRequest) (*pb.BootstrapResult, error)
	}
	BatchIngester interface {
		IngestBatch(ctx context.Context, req *pb.IngestBatchRequest) (*pb.IngestBatchResult, error)
	}
	AfterTurner interface {
		AfterTurn(ctx context.Context, req *pb.AfterTurnRequest) (*pb.AfterTurnResult, error)
	}
	TurnCommitter interface {
		CommitTurn(ctx context.Context, req *pb.CommitTurnRequest) (*pb.CommitTurnResult, error)
	}
	Maintainer interface {
		Maintain(ctx context.Context, req *pb.MaintainRequest) (*pb.MaintainResult, error)
	}
	SpawnPreparer interface {
		PrepareSubagentSpawn(ctx context.Context, req *pb.PrepareSubagentSpawnRequest) (*pb.PrepareSubagentSpawnResult, error)
	}
	SpawnRollbacker interface {
		RollbackSubagentSpawn(ctx context.Context, req *pb.RollbackSubagentSpawnRequest) (*pb.RollbackSubagentSpawnResult, error)
	}
	SubagentEndedHandler interface {
		OnSubagentEnded(ctx context.Context, req *pb.OnSubagentEndedRequest) (*pb.OnSubagentEndedResult, error)
	}
	Disposer interface {
		Dispose(ctx context.Context) (*pb.DisposeResult, error)
	}
	// SessionForgetter drops everything held for a deleted session before
	// answering; idempotent (an unknown session is OK).
	SessionForgetter interface {
		ForgetSession(ctx context.Context, req *pb.ForgetSessionRequest) (*pb.ForgetSessionResult, error)
	}
	// ToolProvider offers tools to the model. The SDK adds Tools() to
	// GetInfo's tools (and CallTool to its implemented methods) when
	// GetInfo declares none itself. A tool that cannot help — unknown,
	// arguments that are not JSON, nothing found — answers ToolError, a
	// result the model reads, never an error status.
	ToolProvider interface {
		Tools() []*pb.ToolDefinition
		CallTool(ctx context.Context, req *pb.CallToolRequest) (*pb.CallToolResult, error)
	}
)

// CompactOutcome is how a Compact call ends: exactly one of Result and
// Delegate is set.
type CompactOutcome struct {
	Result   *pb.CompactResult
	Delegate *pb.DelegateToHost
}

// Compacted ends Compact with a result.
func Compacted(r *pb.CompactResult) CompactOutcome { return CompactOutcome{Result: r} }

// DelegateToHost ends Compact by asking the gateway to run its built-in
// compaction (OpenClaw delegateCompactionToRuntime); reason is logged.
func DelegateToHost(reason string) CompactOutcome {
	d := &pb.DelegateToHost{}
	if reason != "" {
		d.Reason = &reason
	}
	return CompactOutcome{Delegate: d}
}

// Tool declares a tool: its name, what it does, its arguments' JSON Schema,
// offered in main sessions.
func Tool(name, description, parametersJSONSchema string) *pb.ToolDefinition {
	return &pb.ToolDefinition{Name: name, Description: description, ParametersJsonSchema: parametersJSONSchema}
}

// ToolText is a tool's result: text for the model.
func ToolText(text string) *pb.CallToolResult {
	return &pb.CallToolResult{Content: []*pb.ContentPart{TextPart(text)}}
}

// ToolError is a tool's failure, for the model: why it could not help.
func ToolError(text string) *pb.CallToolResult {
	return &pb.CallToolResult{Content: []*pb.ContentPart{TextPart(text)}, IsError: true}
}

// TextPart is a text content part.
func TextPart(text string) *pb.ContentPart {
	return &pb.ContentPart{Part: &pb.ContentPart_Text{Text: text}}
}
