package enginesdk

import (
	"context"
	"errors"
	"sync"

	"github.com/ctxgate/ctxgate/engine-sdk/go/contract"
	"github.com/ctxgate/ctxgate/engine-sdk/go/pb"
)

// call is what the server knows about one engine call, carried in its
// context: the Host client built from the call's grant, and its trace.
type call struct {
	host *HostClient
	// trace is the caller's traceparent, when it sent one; span is this
	// method's own span in that trace (what callbacks send on).
	trace, span *contract.TraceParent
}

type callKey struct{}

func withCall(ctx context.Context, c *call) context.Context {
	return context.WithValue(ctx, callKey{}, c)
}

func callOf(ctx context.Context) *call {
	c, _ := ctx.Value(callKey{}).(*call)
	return c
}

// Host is the call's Host client, nil when the call carried no usable grant
// or named a host endpoint this engine may not call (see --host-allow).
func Host(ctx context.Context) *HostClient {
	if c := callOf(ctx); c != nil {
		return c.host
	}
	return nil
}

// Trace is the caller's W3C trace context (its parent id is the caller's
// span for this call), when it sent one.
func Trace(ctx context.Context) (contract.TraceParent, bool) {
	if c := callOf(ctx); c != nil && c.trace != nil {
		return *c.trace, true
	}
	return contract.TraceParent{}, false
}

// Span is this method's own span in the caller's trace (the one exported
// with --otlp-endpoint): the parent to send on in calls it makes. Host
// callbacks send it.
func Span(ctx context.Context) (contract.TraceParent, bool) {
	if c := callOf(ctx); c != nil && c.span != nil {
		return *c.span, true
	}
	return contract.TraceParent{}, false
}

// ErrStreamClosed is what Progress.Report answers once the Compact call
// has ended (its caller went away, or its outcome was sent).
var ErrStreamClosed = errors.New("the Compact stream has ended")

// Progress sends CompactProgress events to the caller while Compact runs.
type Progress struct {
	ctx    context.Context
	mu     sync.Mutex
	closed bool
	send   func(*pb.CompactEvent) error
}

// Report sends one progress event. It waits while the caller is slow to
// read; it answers the call's context error once the caller has gone.
func (p *Progress) Report(stage string, done, total uint64, message string) error {
	if err := p.ctx.Err(); err != nil {
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return ErrStreamClosed
	}
	ev := &pb.CompactEvent{Event: &pb.CompactEvent_Progress{Progress: &pb.CompactProgress{
		Stage: stage, Done: done, Total: total, Message: message,
	}}}
	if err := p.send(ev); err != nil {
		if ctxErr := p.ctx.Err(); ctxErr != nil {
			return ctxErr
		}
		return err
	}
	return nil
}

// finish sends the terminal event (nil: none) and closes the reporter.
func (p *Progress) finish(terminal *pb.CompactEvent) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return ErrStreamClosed
	}
	p.closed = true
	if terminal == nil {
		return nil
	}
	return p.send(terminal)
}
