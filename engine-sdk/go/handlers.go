package enginesdk

import (
	"context"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/ctxgate/ctxgate/engine-sdk/go/contract"
	"github.com/ctxgate/ctxgate/engine-sdk/go/pb"
)

// The generated service's methods, each through unary (or, for Compact,
// its streaming counterpart).

func (s *service) GetInfo(ctx context.Context, req *pb.GetInfoRequest) (*pb.EngineInfo, error) {
	return unary(s, ctx, contract.GetInfo, req, nil, func(ctx context.Context, _ *pb.GetInfoRequest) (*pb.EngineInfo, error) {
		return info(ctx, s.engine)
	})
}

// info is the engine's GetInfo with what the SDK knows filled in (the
// implemented methods when the engine lists none, its tools), checked by
// the contract's result rules: a bad declaration is a clear error.
func info(ctx context.Context, e Engine) (*pb.EngineInfo, error) {
	i, err := e.GetInfo(ctx)
	if err != nil {
		return nil, err
	}
	if i == nil {
		i = &pb.EngineInfo{}
	}
	// The engine may hand out one shared value: fill in a copy.
	i = proto.CloneOf(i)
	if len(i.ImplementedMethods) == 0 {
		for _, m := range Implemented(e) {
			i.ImplementedMethods = append(i.ImplementedMethods, string(m))
		}
	}
	if tp, ok := e.(ToolProvider); ok && len(i.Tools) == 0 {
		i.Tools = tp.Tools()
		if len(i.Tools) > 0 && !contract.CallTool.ListedIn(i.ImplementedMethods) {
			i.ImplementedMethods = append(i.ImplementedMethods, string(contract.CallTool))
		}
	}
	if err := contract.CheckInfo(i); err != nil {
		return nil, status.Errorf(codes.Internal, "the engine's GetInfo breaks the contract: %v", err)
	}
	return i, nil
}

// Implemented lists the methods e implements: the required ones and the
// optional interfaces its type satisfies.
func Implemented(e Engine) []contract.Method {
	out := []contract.Method{contract.GetInfo, contract.Ingest, contract.Assemble, contract.Compact}
	add := func(ok bool, m contract.Method) {
		if ok {
			out = append(out, m)
		}
	}
	_, b := e.(Bootstrapper)
	add(b, contract.Bootstrap)
	_, b = e.(BatchIngester)
	add(b, contract.IngestBatch)
	_, b = e.(AfterTurner)
	add(b, contract.AfterTurn)
	_, b = e.(TurnCommitter)
	add(b, contract.CommitTurn)
	_, b = e.(Maintainer)
	add(b, contract.Maintain)
	_, b = e.(SpawnPreparer)
	add(b, contract.PrepareSubagentSpawn)
	_, b = e.(SpawnRollbacker)
	add(b, contract.RollbackSubagentSpawn)
	_, b = e.(SubagentEndedHandler)
	add(b, contract.OnSubagentEnded)
	_, b = e.(Disposer)
	add(b, contract.Dispose)
	_, b = e.(SessionForgetter)
	add(b, contract.ForgetSession)
	_, b = e.(ToolProvider)
	add(b, contract.CallTool)
	return out
}

func (s *service) Ingest(ctx context.Context, req *pb.IngestRequest) (*pb.IngestResult, error) {
	return unary(s, ctx, contract.Ingest, req, nil, s.engine.Ingest)
}

func (s *service) Assemble(ctx context.Context, req *pb.AssembleRequest) (*pb.AssembleResult, error) {
	return unary(s, ctx, contract.Assemble, req, req.GetHost(), s.engine.Assemble)
}

// optional serves an optional method: UNIMPLEMENTED (after validation, as
// the Rust SDK answers) when the engine does not implement it.
func optional[E any, Req proto.Message, Res any](s *service, ctx context.Context, m contract.Method, req Req, access *pb.HostAccess,
	f func(E, context.Context, Req) (Res, error)) (Res, error) {
	e, ok := s.engine.(E)
	if !ok {
		var zero Res
		if err := contract.CheckRequest(req); err != nil {
			return zero, statusOf(m, err)
		}
		return zero, unimplemented(m)
	}
	return unary(s, ctx, m, req, access, func(ctx context.Context, req Req) (Res, error) { return f(e, ctx, req) })
}

func (s *service) Bootstrap(ctx context.Context, req *pb.BootstrapRequest) (*pb.BootstrapResult, error) {
	return optional(s, ctx, contract.Bootstrap, req, req.GetHost(), Bootstrapper.Bootstrap)
}

func (s *service) IngestBatch(ctx context.Context, req *pb.IngestBatchRequest) (*pb.IngestBatchResult, error) {
	return optional(s, ctx, contract.IngestBatch, req, nil, BatchIngester.IngestBatch)
}

func (s *service) AfterTurn(ctx context.Context, req *pb.AfterTurnRequest) (*pb.AfterTurnResult, error) {
	return optional(s, ctx, contract.AfterTurn, req, req.GetHost(), AfterTurner.AfterTurn)
}

func (s *service) CommitTurn(ctx context.Context, req *pb.CommitTurnRequest) (*pb.CommitTurnResult, error) {
	return optional(s, ctx, contract.CommitTurn, req, req.GetHost(), TurnCommitter.CommitTurn)
}

func (s *service) Maintain(ctx context.Context, req *pb.MaintainRequest) (*pb.MaintainResult, error) {
	return optional(s, ctx, contract.Maintain, req, req.GetHost(), Maintainer.Maintain)
}

func (s *service) PrepareSubagentSpawn(ctx context.Context, req *pb.PrepareSubagentSpawnRequest) (*pb.PrepareSubagentSpawnResult, error) {
	return optional(s, ctx, contract.PrepareSubagentSpawn, req, req.GetHost(), SpawnPreparer.PrepareSubagentSpawn)
}

func (s *service) RollbackSubagentSpawn(ctx context.Context, req *pb.RollbackSubagentSpawnRequest) (*pb.RollbackSubagentSpawnResult, error) {
	return optional(s, ctx, contract.RollbackSubagentSpawn, req, nil, SpawnRollbacker.RollbackSubagentSpawn)
}

func (s *service) OnSubagentEnded(ctx context.Context, req *pb.OnSubagentEndedRequest) (*pb.OnSubagentEndedResult, error) {
	return optional(s, ctx, contract.OnSubagentEnded, req, nil, SubagentEndedHandler.OnSubagentEnded)
}

func (s *service) Dispose(ctx context.Context, req *pb.DisposeRequest) (*pb.DisposeResult, error) {
	return optional(s, ctx, contract.Dispose, req, nil, func(e Disposer, ctx context.Context, _ *pb.DisposeRequest) (*pb.DisposeResult, error) {
		return e.Dispose(ctx)
	})
}

func (s *service) ForgetSession(ctx context.Context, req *pb.ForgetSessionRequest) (*pb.ForgetSessionResult, error) {
	return optional(s, ctx, contract.ForgetSession, req, nil, SessionForgetter.ForgetSession)
}

func (s *service) CallTool(ctx context.Context, req *pb.CallToolRequest) (*pb.CallToolResult, error) {
	return optional(s, ctx, contract.CallTool, req, req.GetHost(), ToolProvider.CallTool)
}

// Compact runs the engine's Compact with a progress reporter on the stream
// and sends exactly one terminal event: its result or delegation, or the
// stream ends with the error.
func (s *service) Compact(req *pb.CompactRequest, stream pb.ContextEngine_CompactServer) (err error) {
	const m = contract.Compact
	ctx := stream.Context()
	if !s.inflight.enter() {
		return status.Error(codes.Unavailable, "the engine is draining")
	}
	defer s.inflight.leave()
	if err := contract.CheckRequest(req); err != nil {
		return statusOf(m, err)
	}
	release, err := s.admit(ctx, m)
	if err != nil {
		return err
	}
	ctx, done := methodContext(ctx)
	defer done()
	ctx, h := s.callContext(ctx, req.GetHost())
	progress := &Progress{ctx: ctx, send: stream.Send}
	outcome, err := run(ctx, m, release, func() (CompactOutcome, error) { return s.engine.Compact(ctx, req, progress) })
	defer func() { s.finish(h, m, err) }()
	if err != nil {
		_ = progress.finish(nil)
		return statusOf(m, err)
	}
	var terminal *pb.CompactEvent
	switch {
	case outcome.Result != nil && outcome.Delegate == nil:
		terminal = &pb.CompactEvent{Event: &pb.CompactEvent_Result{Result: outcome.Result}}
	case outcome.Delegate != nil && outcome.Result == nil:
		terminal = &pb.CompactEvent{Event: &pb.CompactEvent_DelegateToHost{DelegateToHost: outcome.Delegate}}
	default:
		_ = progress.finish(nil)
		return statusOf(m, errBadOutcome)
	}
	return progress.finish(terminal)
}

type outcomeError struct{}

func (outcomeError) Error() string {
	return "Compact answered neither exactly one result nor a delegation (CompactOutcome)"
}

var errBadOutcome error = outcomeError{}
