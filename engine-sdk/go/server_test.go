package enginesdk

import (
	"context"
	"errors"
	"io"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	reflectionpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/ctxgate/ctxgate/engine-sdk/go/contract"
	"github.com/ctxgate/ctxgate/engine-sdk/go/pb"
)

func TestHealthServesBothNamesAndReflectionListsTheServices(t *testing.T) {
	e := serve(t, newProbe(), Options{})
	health := healthpb.NewHealthClient(e.conn)
	for _, name := range []string{"", contract.EngineService} {
		r, err := health.Check(timeout(5*time.Second), &healthpb.HealthCheckRequest{Service: name})
		if err != nil || r.GetStatus() != healthpb.HealthCheckResponse_SERVING {
			t.Fatalf("Check(%q) = %v, %v; want SERVING", name, r, err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel() // a stream left open would hold the drain
	stream, err := reflectionpb.NewServerReflectionClient(e.conn).ServerReflectionInfo(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.Send(&reflectionpb.ServerReflectionRequest{
		MessageRequest: &reflectionpb.ServerReflectionRequest_ListServices{}}); err != nil {
		t.Fatal(err)
	}
	r, err := stream.Recv()
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, s := range r.GetListServicesResponse().GetService() {
		names = append(names, s.GetName())
	}
	for _, want := range []string{contract.EngineService, "grpc.health.v1.Health"} {
		if !strings.Contains(strings.Join(names, " "), want) {
			t.Fatalf("reflection lists %v, missing %s", names, want)
		}
	}
}

// Every shared request vector, sent over gRPC to the real server: a refused
// one gets the vector's code and a message starting with its field path,
// and never reaches the engine; an accepted one does.
func TestTheSharedRequestVectorsThroughTheServer(t *testing.T) {
	cases, err := contract.LoadVectors(filepath.Join("..", "..", "proto", "testdata", "requests.json"))
	if err != nil {
		t.Fatal(err)
	}
	e := serve(t, &everything{probe: newProbe()}, Options{})
	var problems []string
	for _, c := range cases {
		err := invoke(e.conn, c.Method, c.Message)
		s := status.Convert(err)
		switch {
		case c.WantOK && (s.Code() == codes.InvalidArgument || s.Code() == codes.ResourceExhausted):
			problems = append(problems, c.Name+": refused ("+s.Message()+"), the vector accepts it")
		case !c.WantOK && (s.Code().String() != codeName(c.WantCode) || !strings.HasPrefix(s.Message(), c.WantField+": ")):
			problems = append(problems, c.Name+": answered "+s.Code().String()+" "+s.Message()+", the vector says "+
				c.WantCode+" at "+c.WantField)
		}
	}
	if len(problems) > 0 {
		t.Fatal(strings.Join(problems, "\n"))
	}
}

func codeName(vector string) string {
	return map[string]string{"INVALID_ARGUMENT": "InvalidArgument", "RESOURCE_EXHAUSTED": "ResourceExhausted"}[vector]
}

// invoke calls method with msg and reads its answer (Compact: the stream).
func invoke(conn *grpc.ClientConn, m contract.Method, msg proto.Message) error {
	ctx := timeout(5 * time.Second)
	name := "/" + contract.EngineService + "/" + string(m)
	if m == contract.Compact {
		s, err := conn.NewStream(ctx, &pb.ContextEngine_ServiceDesc.Streams[0], name)
		if err != nil {
			return err
		}
		if err := s.SendMsg(msg); err != nil {
			return err
		}
		_ = s.CloseSend()
		for {
			if err := s.RecvMsg(&pb.CompactEvent{}); err != nil {
				if errors.Is(err, io.EOF) {
					return nil
				}
				return err
			}
		}
	}
	return conn.Invoke(ctx, name, msg, &emptyReply{})
}

// emptyReply decodes any reply (its fields are not looked at).
type emptyReply = pb.DisposeResult

// everything implements every optional method (answering OK), so that an
// accepted vector reaches engine code.
type everything struct{ *probe }

func (everything) Bootstrap(context.Context, *pb.BootstrapRequest) (*pb.BootstrapResult, error) {
	return &pb.BootstrapResult{}, nil
}
func (everything) IngestBatch(context.Context, *pb.IngestBatchRequest) (*pb.IngestBatchResult, error) {
	return &pb.IngestBatchResult{}, nil
}
func (everything) AfterTurn(context.Context, *pb.AfterTurnRequest) (*pb.AfterTurnResult, error) {
	return &pb.AfterTurnResult{}, nil
}
func (everything) CommitTurn(context.Context, *pb.CommitTurnRequest) (*pb.CommitTurnResult, error) {
	return &pb.CommitTurnResult{Status: pb.CommitStatus_COMMIT_STATUS_COMMITTED}, nil
}
func (everything) Maintain(context.Context, *pb.MaintainRequest) (*pb.MaintainResult, error) {
	return &pb.MaintainResult{}, nil
}
func (everything) PrepareSubagentSpawn(context.Context, *pb.PrepareSubagentSpawnRequest) (*pb.PrepareSubagentSpawnResult, error) {
	return &pb.PrepareSubagentSpawnResult{}, nil
}
func (everything) RollbackSubagentSpawn(context.Context, *pb.RollbackSubagentSpawnRequest) (*pb.RollbackSubagentSpawnResult, error) {
	return &pb.RollbackSubagentSpawnResult{}, nil
}
func (everything) OnSubagentEnded(context.Context, *pb.OnSubagentEndedRequest) (*pb.OnSubagentEndedResult, error) {
	return &pb.OnSubagentEndedResult{}, nil
}
func (everything) ForgetSession(context.Context, *pb.ForgetSessionRequest) (*pb.ForgetSessionResult, error) {
	return &pb.ForgetSessionResult{}, nil
}
func (everything) Tools() []*pb.ToolDefinition { return []*pb.ToolDefinition{Tool("probe", "", "")} }
func (everything) CallTool(context.Context, *pb.CallToolRequest) (*pb.CallToolResult, error) {
	return ToolText("ok"), nil
}

func TestAnOptionalMethodNotImplementedIsUnimplementedAndInfoListsWhatIs(t *testing.T) {
	e := serve(t, newProbe(), Options{})
	_, err := e.client.Bootstrap(timeout(5*time.Second), &pb.BootstrapRequest{SessionId: "s"})
	if status.Code(err) != codes.Unimplemented {
		t.Fatalf("Bootstrap on an engine without it: %v", err)
	}
	info, err := e.client.GetInfo(timeout(5*time.Second), &pb.GetInfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(info.GetImplementedMethods(), ","); got != "GetInfo,Ingest,Assemble,Compact" {
		t.Fatalf("implemented_methods %s", got)
	}
	all := serve(t, &everything{newProbe()}, Options{})
	info, err = all.client.GetInfo(timeout(5*time.Second), &pb.GetInfoRequest{})
	if err != nil || len(info.GetImplementedMethods()) != len(contract.AllMethods)-1 || len(info.GetTools()) != 1 {
		t.Fatalf("info of an engine with every optional method but Dispose: %v, %v", info, err)
	}
}

// badTools declares a tool whose name breaks the contract.
type badTools struct{ *probe }

func (badTools) Tools() []*pb.ToolDefinition {
	return []*pb.ToolDefinition{Tool("no spaces allowed", "", "")}
}
func (badTools) CallTool(context.Context, *pb.CallToolRequest) (*pb.CallToolResult, error) {
	return ToolText("ok"), nil
}

func TestABadToolDeclarationIsAClearErrorAtStartAndOnGetInfo(t *testing.T) {
	engine := badTools{newProbe()}
	err := Run(timeout(5*time.Second), func(Options) (Engine, error) { return engine, nil },
		Options{Listen: "127.0.0.1:0", MaxConcurrentCalls: 1}, io.Discard)
	if err == nil || !strings.Contains(err.Error(), `info.tools[0].name: "no spaces allowed" is not 1 to 64 of [a-zA-Z0-9_-]`) {
		t.Fatalf("starting an engine with a bad tool name: %v", err)
	}
	e := serve(t, engine, Options{})
	_, err = e.client.GetInfo(timeout(5*time.Second), &pb.GetInfoRequest{})
	if status.Code(err) != codes.Internal || !strings.Contains(err.Error(), "info.tools[0].name") {
		t.Fatalf("GetInfo of an engine with a bad tool name: %v", err)
	}
}

func TestAClientCancelReachesTheMethodWithin50ms(t *testing.T) {
	p := newProbe()
	e := serve(t, p, Options{})
	ctx, cancel := context.WithCancel(context.Background())
	answered := make(chan error, 1)
	go func() { _, err := e.client.Assemble(ctx, assembleReq("wait")); answered <- err }()
	next(t, p.started)
	cancelled := time.Now()
	cancel()
	s := next(t, p.seen)
	if !errors.Is(s.err, context.Canceled) {
		t.Fatalf("the method saw %v, not a cancellation", s.err)
	}
	if took := s.at.Sub(cancelled); took > 50*time.Millisecond {
		t.Fatalf("the cancel reached the method after %s (over 50 ms)", took)
	}
	if err := next(t, answered); status.Code(err) != codes.Canceled {
		t.Fatalf("the cancelled call ended with %v", err)
	}
}

func TestACallOverItsDeadlineIsDeadlineExceededAndTheMethodSeesIt(t *testing.T) {
	p := newProbe()
	e := serve(t, p, Options{})
	started := time.Now()
	_, err := e.client.Assemble(timeout(200*time.Millisecond), assembleReq("wait"))
	if status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("a call over its deadline ended with %v", err)
	}
	s := next(t, p.seen)
	if !errors.Is(s.err, context.DeadlineExceeded) {
		t.Fatalf("the method saw %v, not its deadline", s.err)
	}
	if took := s.at.Sub(started); took > time.Second {
		t.Fatalf("the method saw its 200 ms deadline after %s", took)
	}
	// The server answers the deadline itself even when the method does not return.
	stuck := serve(t, stubborn{}, Options{})
	_, err = stuck.client.Assemble(timeout(100*time.Millisecond), assembleReq("s"))
	if status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("a method that ignores its context: %v", err)
	}
}

// stubborn ignores its context for a while.
type stubborn struct{ *probe }

func (stubborn) GetInfo(context.Context) (*pb.EngineInfo, error) {
	return &pb.EngineInfo{Id: "stubborn", Name: "stubborn", ContractVersion: "1.0"}, nil
}
func (stubborn) Assemble(context.Context, *pb.AssembleRequest) (*pb.AssembleResult, error) {
	time.Sleep(2 * time.Second)
	return &pb.AssembleResult{}, nil
}

func TestAPanickingMethodIsInternalAndTheConnectionKeepsServing(t *testing.T) {
	e := serve(t, newProbe(), Options{})
	_, err := e.client.Assemble(timeout(5*time.Second), assembleReq("panic"))
	if status.Code(err) != codes.Internal || status.Convert(err).Message() != "Assemble failed inside the engine" {
		t.Fatalf("a panicking Assemble: %v", err)
	}
	stream, err := e.client.Compact(timeout(5*time.Second), &pb.CompactRequest{SessionId: "panic", SessionKey: "k"})
	if err != nil {
		t.Fatal(err)
	}
	for err == nil {
		_, err = stream.Recv()
	}
	if status.Code(err) != codes.Internal || status.Convert(err).Message() != "Compact failed inside the engine" {
		t.Fatalf("a panicking Compact: %v", err)
	}
	if _, err := e.client.GetInfo(timeout(5*time.Second), &pb.GetInfoRequest{}); err != nil {
		t.Fatalf("after the panics: %v", err)
	}
}

func TestCompactStreamsProgressThenOneTerminalEvent(t *testing.T) {
	e := serve(t, newProbe(), Options{})
	for session, want := range map[string]string{"s": "result", "delegate": "delegate_to_host"} {
		stream, err := e.client.Compact(timeout(5*time.Second), &pb.CompactRequest{SessionId: session, SessionKey: "k"})
		if err != nil {
			t.Fatal(err)
		}
		var kinds []string
		for {
			ev, err := stream.Recv()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
			switch ev.GetEvent().(type) {
			case *pb.CompactEvent_Progress:
				kinds = append(kinds, "progress")
			case *pb.CompactEvent_Result:
				kinds = append(kinds, "result")
			case *pb.CompactEvent_DelegateToHost:
				kinds = append(kinds, "delegate_to_host")
			}
		}
		if got := strings.Join(kinds, ","); got != "progress,"+want {
			t.Fatalf("session %s: events %s", session, got)
		}
	}
}

func TestAHistoryGapIsFailedPreconditionWithTheTypedDetail(t *testing.T) {
	e := serve(t, newProbe(), Options{})
	var trailer metadata.MD
	_, err := e.client.Assemble(timeout(5*time.Second), assembleReq("gap"), grpc.Trailer(&trailer))
	gap, ok := contract.GapOf(err)
	if !ok || gap.GetHeld().GetMessageId() != "m7" || gap.GetHeld().GetMessageCount() != 7 {
		t.Fatalf("a gap answered %v", err)
	}
	// On the wire: grpc-status-details-bin is a contextengine.v1.RpcStatus
	// (google.rpc.Status) holding one AnyDetail with the HistoryGap type URL.
	raw := trailer.Get("grpc-status-details-bin")
	if len(raw) != 1 {
		t.Fatalf("trailer %v", trailer)
	}
	var rs pb.RpcStatus
	if err := proto.Unmarshal([]byte(raw[0]), &rs); err != nil {
		t.Fatal(err)
	}
	if rs.GetCode() != int32(codes.FailedPrecondition) || len(rs.GetDetails()) != 1 ||
		rs.GetDetails()[0].GetTypeUrl() != "type.googleapis.com/contextengine.v1.HistoryGap" {
		t.Fatalf("status details %v", &rs)
	}
	var held pb.HistoryGap
	if err := proto.Unmarshal(rs.GetDetails()[0].GetValue(), &held); err != nil || held.GetHeld().GetSeq() != 7 {
		t.Fatalf("HistoryGap %v, %v", &held, err)
	}
	if _, plain := contract.GapOf(status.Error(codes.FailedPrecondition, "history gap")); plain {
		t.Fatal("a precondition without the detail is not a gap")
	}
}

func TestOverTheCallLimitIsResourceExhaustedWithARetryPushback(t *testing.T) {
	p := newProbe()
	e := serve(t, p, Options{MaxConcurrentCalls: 1})
	slow := make(chan error, 1)
	go func() { _, err := e.client.Assemble(timeout(5*time.Second), assembleReq("slow")); slow <- err }()
	next(t, p.started)
	var trailer metadata.MD
	_, err := e.client.Assemble(timeout(5*time.Second), assembleReq("s"), grpc.Trailer(&trailer))
	if status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("a call over the limit: %v", err)
	}
	if got := trailer.Get("grpc-retry-pushback-ms"); len(got) != 1 || got[0] != "50" {
		t.Fatalf("pushback trailer %v", trailer)
	}
	stream, err := e.client.Compact(timeout(5*time.Second), &pb.CompactRequest{SessionId: "s", SessionKey: "k"})
	if err == nil {
		_, err = stream.Recv()
	}
	if status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("a Compact over the limit: %v", err)
	}
	if _, err := e.client.GetInfo(timeout(5*time.Second), &pb.GetInfoRequest{}); err != nil {
		t.Fatalf("GetInfo is always admitted: %v", err)
	}
	if err := next(t, slow); err != nil {
		t.Fatal(err)
	}
	if _, err := e.client.Assemble(timeout(5*time.Second), assembleReq("s")); err != nil {
		t.Fatalf("after the slot is free: %v", err)
	}
}

func TestShutdownReportsNotServingRefusesNewCallsAndDrainsInFlightOnes(t *testing.T) {
	p := newProbe()
	e := serve(t, p, Options{Drain: 5 * time.Second})
	watch, err := healthpb.NewHealthClient(e.conn).Watch(context.Background(),
		&healthpb.HealthCheckRequest{Service: contract.EngineService})
	if err != nil {
		t.Fatal(err)
	}
	if r, err := watch.Recv(); err != nil || r.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("first status %v, %v", r, err)
	}
	inFlight := make(chan error, 1)
	go func() { _, err := e.client.Assemble(timeout(5*time.Second), assembleReq("slow")); inFlight <- err }()
	next(t, p.started)
	e.stop()
	if r, err := watch.Recv(); err != nil || r.GetStatus() != healthpb.HealthCheckResponse_NOT_SERVING {
		t.Fatalf("status after shutdown %v, %v", r, err)
	}
	_, err = e.client.Assemble(timeout(5*time.Second), assembleReq("s"))
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("a new call while draining: %v", err)
	}
	if err := next(t, inFlight); err != nil {
		t.Fatalf("the in-flight call: %v", err)
	}
	select {
	case err := <-e.done:
		if err != nil {
			t.Fatal(err)
		}
		e.done <- nil // for the cleanup
	case <-time.After(10 * time.Second):
		t.Fatal("the server did not stop after draining")
	}
}
