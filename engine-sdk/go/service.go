package enginesdk

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"runtime/debug"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/ctxgate/ctxgate/engine-sdk/go/contract"
	"github.com/ctxgate/ctxgate/engine-sdk/go/pb"
)

// Version is this SDK's version (the OTLP instrumentation scope's).
const Version = "0.1.0"

// PushbackMillis is how long a caller refused at the call limit is asked
// to wait (trailer grpc-retry-pushback-ms).
const PushbackMillis = "50"

// calls counts engine calls in flight and refuses new ones once a drain
// has begun (the drain waits for the count to reach zero).
type calls struct {
	mu       sync.Mutex
	n        int
	draining bool
	idle     chan struct{}
}

func (c *calls) enter() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.draining {
		return false
	}
	c.n++
	return true
}

func (c *calls) leave() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.n--
	if c.draining && c.n == 0 && c.idle != nil {
		close(c.idle)
		c.idle = nil
	}
}

// drain refuses new calls from now on; the channel closes once none is in
// flight.
func (c *calls) drain() <-chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.draining = true
	done := make(chan struct{})
	if c.n == 0 {
		close(done)
	} else {
		c.idle = done
	}
	return done
}

// service is the generated ContextEngine service over an Engine: each call
// is refused while draining, validated, admitted under the call limit,
// given its context (deadline, cancellation, Host client, trace) and run
// in its own goroutine with panics contained.
type service struct {
	pb.UnimplementedContextEngineServer
	engine   Engine
	hosts    *hostConns
	slots    chan struct{}
	maxCalls int
	spans    *Exporter
	inflight *calls
}

// admit takes a slot for one engine call, or answers the overload: GetInfo
// always gets in (the gateway needs it to attach).
func (s *service) admit(ctx context.Context, m contract.Method) (release func(), err error) {
	if m == contract.GetInfo {
		return func() {}, nil
	}
	select {
	case s.slots <- struct{}{}:
		return func() { <-s.slots }, nil
	default:
	}
	slog.Warn("engine call refused: at the concurrent-call limit", "method", string(m))
	_ = grpc.SetTrailer(ctx, metadata.Pairs("grpc-retry-pushback-ms", PushbackMillis))
	return nil, status.Errorf(codes.ResourceExhausted, "the engine is serving its limit of %d concurrent calls", s.maxCalls)
}

// hop is a traced method's span: its own id (what its callbacks continue)
// and the caller's.
type hop struct {
	this   contract.TraceParent
	parent [8]byte
	start  time.Time
}

func (s *service) finish(h *hop, m contract.Method, err error) {
	if h == nil || s.spans == nil {
		return
	}
	msg := ""
	if err != nil {
		msg = status.Convert(err).Message()
	}
	s.spans.record(finishedSpan{
		name: contract.EngineService + "/" + string(m), this: h.this, parent: h.parent,
		start: h.start, end: time.Now(), method: string(m), err: msg,
	})
}

// callContext is ctx with the call's Host client and trace.
func (s *service) callContext(ctx context.Context, access *pb.HostAccess) (context.Context, *hop) {
	c := &call{}
	if t, ok := traceOf(ctx); ok {
		child := t.Child()
		c.trace, c.span = &t, &child
	}
	if access != nil {
		// No TCP peer: the call came over the unix socket.
		var from Peer
		if p, ok := peer.FromContext(ctx); ok {
			if tcp, ok := p.Addr.(*net.TCPAddr); ok {
				from = Peer{IP: tcp.IP}
			}
		}
		within := 2 * time.Second
		if d, ok := ctx.Deadline(); ok {
			within = time.Until(d)
		}
		c.host = s.hosts.client(ctx, access, from, within)
	}
	var h *hop
	if c.span != nil {
		h = &hop{this: *c.span, parent: c.trace.ParentID, start: time.Now()}
	}
	return withCall(ctx, c), h
}

func traceOf(ctx context.Context) (contract.TraceParent, bool) {
	md, _ := metadata.FromIncomingContext(ctx)
	if v := md.Get(contract.TraceHeader); len(v) > 0 {
		return contract.ParseTraceParent(v[0])
	}
	return contract.TraceParent{}, false
}

// run runs f in its own goroutine and waits for its answer or the end of
// ctx (the caller cancelled, or the deadline passed): the method then sees
// ctx cancelled and the caller gets its answer at once. A panic is
// INTERNAL for this call only, logged with its stack. release runs when f
// has returned (the slot is held while the work runs).
func run[Res any](ctx context.Context, m contract.Method, release func(), f func() (Res, error)) (Res, error) {
	type answer struct {
		res Res
		err error
	}
	done := make(chan answer, 1)
	go func() {
		var a answer
		func() {
			defer func() {
				if p := recover(); p != nil {
					slog.Error("engine method panicked", "method", string(m), "panic", fmt.Sprint(p), "stack", string(debug.Stack()))
					a.err = status.Errorf(codes.Internal, "%s failed inside the engine", m)
				}
			}()
			a.res, a.err = f()
		}()
		// The slot is free before the answer goes out: a caller that got
		// its answer finds the slot free.
		release()
		done <- a
	}()
	select {
	case a := <-done:
		return a.res, a.err
	case <-ctx.Done():
		var zero Res
		return zero, ctx.Err()
	}
}

// unary serves one unary engine method.
func unary[Req proto.Message, Res any](s *service, ctx context.Context, m contract.Method, req Req,
	access *pb.HostAccess, f func(ctx context.Context, req Req) (Res, error)) (res Res, err error) {
	if !s.inflight.enter() {
		return res, status.Error(codes.Unavailable, "the engine is draining")
	}
	defer s.inflight.leave()
	if err := contract.CheckRequest(req); err != nil {
		return res, statusOf(m, err)
	}
	release, err := s.admit(ctx, m)
	if err != nil {
		return res, err
	}
	ctx, done := methodContext(ctx)
	defer done()
	ctx, h := s.callContext(ctx, access)
	res, err = run(ctx, m, release, func() (Res, error) { return f(ctx, req) })
	err = statusOf(m, err)
	s.finish(h, m, err)
	return res, err
}

// deadlineSlack: a caller whose own deadline fired resets its stream a
// moment before the server's copy of that deadline passes (the server's
// starts when the request arrives). A cancel that close to the deadline is
// the deadline.
const deadlineSlack = 20 * time.Millisecond

// methodContext is the context an engine method runs in: cancelled with the
// call, ending with context.DeadlineExceeded when the cancel is the
// caller's deadline (see deadlineSlack), so the method can tell a deadline
// from a cancel.
func methodContext(parent context.Context) (context.Context, context.CancelFunc) {
	d, ok := parent.Deadline()
	if !ok {
		return context.WithCancel(parent)
	}
	ctx, cancel := context.WithDeadline(context.WithoutCancel(parent), d)
	stop := context.AfterFunc(parent, func() {
		if time.Until(d) > deadlineSlack {
			cancel()
		}
	})
	return ctx, func() { stop(); cancel() }
}
