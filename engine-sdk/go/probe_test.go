package enginesdk

import (
	"context"
	"net"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/ctxgate/ctxgate/engine-sdk/go/pb"
)

// seen is what the probe engine observed in one call.
type seen struct {
	session string
	err     error // ctx.Err() when the method saw the end of its call
	at      time.Time
	read    error
	entries int
	host    bool
}

// probe is an engine whose Assemble misbehaves on request, by session id:
// "wait" blocks until its call ends, "panic" panics, "slow" answers after
// 300 ms, "read" reads the transcript through the host, "gap" answers a
// history gap.
type probe struct {
	seen    chan seen
	started chan string
}

func newProbe() *probe { return &probe{seen: make(chan seen, 64), started: make(chan string, 64)} }

func (p *probe) GetInfo(context.Context) (*pb.EngineInfo, error) {
	return &pb.EngineInfo{Id: "probe", Name: "probe", ContractVersion: "1.0"}, nil
}

func (p *probe) Ingest(ctx context.Context, req *pb.IngestRequest) (*pb.IngestResult, error) {
	p.seen <- seen{session: req.GetSessionId()}
	return &pb.IngestResult{Ingested: true}, nil
}

func (p *probe) Assemble(ctx context.Context, req *pb.AssembleRequest) (*pb.AssembleResult, error) {
	switch req.GetSessionId() {
	case "wait":
		p.started <- "wait"
		<-ctx.Done()
		p.seen <- seen{session: "wait", err: ctx.Err(), at: time.Now()}
		return nil, ctx.Err()
	case "panic":
		panic("engine bug")
	case "slow":
		p.started <- "slow"
		time.Sleep(300 * time.Millisecond)
	case "read":
		s := seen{session: "read"}
		if h := Host(ctx); h != nil {
			s.host = true
			entries, err := h.ReadTranscript(ctx, false)
			s.entries, s.read = len(entries), err
		}
		p.seen <- s
	case "gap":
		return nil, HistoryGap(&pb.HistoryCursor{MessageId: "m7", Seq: 7, MessageCount: 7, Tokens: 70})
	default:
		p.seen <- seen{session: req.GetSessionId()}
	}
	return &pb.AssembleResult{Messages: req.GetMessages(), EstimatedTokens: 1}, nil
}

func (p *probe) Compact(ctx context.Context, req *pb.CompactRequest, pr *Progress) (CompactOutcome, error) {
	if err := pr.Report("one", 1, 2, "half"); err != nil {
		return CompactOutcome{}, err
	}
	switch req.GetSessionId() {
	case "panic":
		panic("compaction bug")
	case "delegate":
		return DelegateToHost("use yours"), nil
	}
	return Compacted(&pb.CompactResult{Ok: true, Compacted: true, TokensBefore: 10}), nil
}

// served is an engine served on loopback by the real server.
type served struct {
	server *Server
	conn   *grpc.ClientConn
	client pb.ContextEngineClient
	stop   context.CancelFunc
	done   chan error
}

// serve starts engine on 127.0.0.1:0 with opts; the test stops it.
func serve(t *testing.T, engine Engine, opts Options) *served {
	t.Helper()
	if opts.Listen == "" {
		opts.Listen = "127.0.0.1:0"
	}
	if opts.Drain == 0 {
		opts.Drain = 2 * time.Second
	}
	if opts.MaxConcurrentCalls == 0 {
		opts.MaxConcurrentCalls = DefaultMaxConcurrentCalls
	}
	s, err := NewServer(engine, opts)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Listen(); err != nil {
		t.Fatal(err)
	}
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Serve(ctx) }()
	conn := dial(t, s.Addr())
	e := &served{server: s, conn: conn, client: pb.NewContextEngineClient(conn), stop: stop, done: done}
	t.Cleanup(func() { e.stop(); <-e.done })
	return e
}

func dial(t *testing.T, addr string) *grpc.ClientConn {
	t.Helper()
	e, err := ParseEndpoint(addr)
	if err != nil {
		t.Fatal(err)
	}
	conn, err := grpc.NewClient(e.target(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

func assembleReq(session string) *pb.AssembleRequest {
	return &pb.AssembleRequest{SessionId: session, Messages: []*pb.AgentMessage{userMsg("m", "hi")}}
}

func userMsg(id, text string) *pb.AgentMessage {
	return &pb.AgentMessage{Id: id, Role: pb.Role_ROLE_USER, Content: []*pb.ContentPart{TextPart(text)}}
}

func next[T any](t *testing.T, ch <-chan T) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(10 * time.Second):
		t.Fatal("the engine did not report in time")
	}
	var zero T
	return zero
}

func timeout(d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	_ = cancel // released when the deadline passes
	return ctx
}

// loopback listens on addr (e.g. "127.0.0.2:0": the whole 127/8 is loopback).
func loopback(t *testing.T, addr string) net.Listener {
	t.Helper()
	l, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}
