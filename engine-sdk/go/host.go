package enginesdk

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/ctxgate/ctxgate/engine-sdk/go/contract"
	"github.com/ctxgate/ctxgate/engine-sdk/go/pb"
)

// Host operations a grant can allow.
const (
	ReadTranscriptOp = "read_transcript"
	LlmCompleteOp    = "llm_complete"
)

// Caps on one ReadTranscript collection, over all its pages: a host (or
// something posing as one) that streams or pages for ever cannot exhaust
// the engine's memory.
const (
	MaxTranscriptBytes   = 16 * 1024 * 1024
	MaxTranscriptEntries = 20_000
)

// DefaultHostDeadline bounds a callback made from a call that has no
// deadline of its own (the gateway always sends one).
const DefaultHostDeadline = 60 * time.Second

// HostClient calls the gateway back during one engine call. Built by the
// server from the request's HostAccess; every request carries the grant
// token, the engine call's remaining deadline and its trace.
type HostClient struct {
	client pb.HostClient
	grant  *pb.Grant
}

// Allows reports whether the grant allows operation and has not expired.
func (h *HostClient) Allows(operation string) bool {
	if exp := h.grant.GetExpiresAtUnixMs(); exp != 0 && exp <= time.Now().UnixMilli() {
		return false
	}
	for _, o := range h.grant.GetOperations() {
		if o == operation {
			return true
		}
	}
	return false
}

// SessionID is the session the grant is scoped to.
func (h *HostClient) SessionID() string { return h.grant.GetSessionId() }

// HostError is a host callback that failed. Its gRPC status (what the
// engine's call answers if the engine returns it) is DEADLINE_EXCEEDED or
// CANCELLED when the callback ran out of time or was cancelled, UNIMPLEMENTED
// when the host does not offer the operation, FAILED_PRECONDITION when the
// grant does not allow it, RESOURCE_EXHAUSTED over a read cap, UNAVAILABLE
// otherwise.
type HostError struct {
	Operation string
	// Status is what the host answered (nil: the SDK refused the callback).
	Status *status.Status
	code   codes.Code
	msg    string
}

func (e *HostError) Error() string              { return e.msg }
func (e *HostError) GRPCStatus() *status.Status { return status.New(e.code, e.msg) }

// hostError maps what a callback failed with: a failure because the engine
// call's own deadline passed is that deadline, not a host fault.
func hostError(ctx context.Context, op string, err error) error {
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return &HostError{Operation: op, code: codes.DeadlineExceeded, msg: "the call's deadline passed"}
	}
	s := status.Convert(err)
	switch s.Code() {
	case codes.Unimplemented:
		return &HostError{Operation: op, Status: s, code: codes.Unimplemented, msg: op + " is not implemented"}
	case codes.DeadlineExceeded, codes.Canceled:
		return &HostError{Operation: op, Status: s, code: s.Code(), msg: fmt.Sprintf("host callback %s failed (%s)", op, s.Code())}
	}
	return &HostError{Operation: op, Status: s, code: codes.Unavailable, msg: fmt.Sprintf("host callback %s failed (%s)", op, s.Code())}
}

func notGranted(op string) error {
	return &HostError{Operation: op, code: codes.FailedPrecondition, msg: "the grant does not allow " + op}
}

// bounded is ctx with a default deadline when it has none, and the
// method's span as the callback's traceparent.
func bounded(ctx context.Context) (context.Context, context.CancelFunc) {
	cancel := context.CancelFunc(func() {})
	if _, has := ctx.Deadline(); !has {
		ctx, cancel = context.WithTimeout(ctx, DefaultHostDeadline)
	}
	if span, ok := Span(ctx); ok {
		ctx = metadata.AppendToOutgoingContext(ctx, contract.TraceHeader, span.String())
	}
	return ctx, cancel
}

// ReadTranscript collects the grant's session's transcript (visibleOnly:
// only the visible history) page by page: the host answers one page a
// call, and the last chunk's cursor asks for the next. At most
// MaxTranscriptEntries entries and MaxTranscriptBytes over all pages; more
// is RESOURCE_EXHAUSTED naming the cap. Each page is bounded by ctx's
// deadline (DefaultHostDeadline when it has none).
func (h *HostClient) ReadTranscript(ctx context.Context, visibleOnly bool) ([]*pb.TranscriptEntry, error) {
	var r transcriptRead
	cursor := ""
	for {
		next, err := h.readPage(ctx, visibleOnly, cursor, 0, &r)
		if err != nil {
			return nil, err
		}
		if next == "" {
			return r.entries, nil
		}
		cursor = next
	}
}

// ReadTranscriptPage reads one page: at most limit entries (0: as many as
// the host sends at once) after cursor ("": from the start), and the
// cursor of the next page ("": nothing follows). For sessions longer than
// the read caps; one page is capped as ReadTranscript is.
func (h *HostClient) ReadTranscriptPage(ctx context.Context, visibleOnly bool, cursor string, limit uint32) ([]*pb.TranscriptEntry, string, error) {
	var r transcriptRead
	next, err := h.readPage(ctx, visibleOnly, cursor, limit, &r)
	if err != nil {
		return nil, "", err
	}
	return r.entries, next, nil
}

// transcriptRead is what one read took so far, over all its pages,
// against the caps.
type transcriptRead struct {
	entries []*pb.TranscriptEntry
	size    int
}

// readPage makes one ReadTranscript call into r; the last chunk's cursor.
func (h *HostClient) readPage(ctx context.Context, visibleOnly bool, cursor string, limit uint32, r *transcriptRead) (string, error) {
	const op = "ReadTranscript"
	if !h.Allows(ReadTranscriptOp) {
		return "", notGranted(ReadTranscriptOp)
	}
	cctx, cancel := bounded(ctx)
	defer cancel() // also ends the stream when a cap cuts it
	stream, err := h.client.ReadTranscript(cctx, &pb.ReadTranscriptRequest{
		Grant: h.grant.GetToken(), SessionId: h.grant.GetSessionId(),
		Cursor: cursor, VisibleOnly: visibleOnly, Limit: limit,
	})
	if err != nil {
		return "", hostError(cctx, op, err)
	}
	before, last := len(r.entries), ""
	for {
		chunk, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return "", hostError(cctx, op, err)
		}
		for _, e := range chunk.GetEntries() {
			r.size += proto.Size(e)
			if len(r.entries) >= MaxTranscriptEntries {
				return "", overCap(op, fmt.Sprintf("more than %d entries", MaxTranscriptEntries))
			}
			if r.size > MaxTranscriptBytes {
				return "", overCap(op, fmt.Sprintf("more than %d bytes", MaxTranscriptBytes))
			}
			r.entries = append(r.entries, e)
		}
		last = chunk.GetNextCursor()
	}
	// A page that says more follows must have moved past cursor, or
	// following it would ask for the same page again.
	if last != "" && (len(r.entries) == before || last == cursor) {
		return "", &HostError{Operation: op, code: codes.Unavailable,
			msg: fmt.Sprintf("host callback %s: the host sent a page with no new entries and a cursor to more; "+
				"stopped rather than read the same page again", op)}
	}
	return last, nil
}

func overCap(op, what string) error {
	return &HostError{Operation: op, code: codes.ResourceExhausted,
		msg: fmt.Sprintf("host callback %s: the transcript holds %s, the SDK's read cap", op, what)}
}

// LlmComplete asks the host's model for one completion (the grant's token
// is filled in).
func (h *HostClient) LlmComplete(ctx context.Context, req *pb.LlmCompleteRequest) (*pb.LlmCompleteResult, error) {
	if !h.Allows(LlmCompleteOp) {
		return nil, notGranted(LlmCompleteOp)
	}
	req = proto.CloneOf(req)
	req.Grant = h.grant.GetToken()
	cctx, cancel := bounded(ctx)
	defer cancel()
	r, err := h.client.LlmComplete(cctx, req)
	if err != nil {
		return nil, hostError(cctx, "LlmComplete", err)
	}
	return r, nil
}

// maxHostConns is how many host endpoints' connections are kept; more
// means something sends many: start over.
const maxHostConns = 64

// hostConns are the connections to host endpoints, shared by all calls of
// one server, only to endpoints the policy allows.
type hostConns struct {
	policy HostPolicy
	// tls is what https:// host endpoints are called with (--host-ca, and
	// the engine's certificate as the client's).
	tls   func(serverName string) *tls.Config
	mu    sync.Mutex
	conns map[string]*grpc.ClientConn
}

// client is the Host client for access from peer, or nil when the call
// carries no usable grant or names an endpoint the policy refuses (logged:
// the engine then works without host callbacks).
func (h *hostConns) client(ctx context.Context, access *pb.HostAccess, peer Peer, within time.Duration) *HostClient {
	if access == nil || access.GetGrant().GetToken() == "" {
		return nil
	}
	c, err := h.policy.Check(ctx, access.GetEndpoint(), peer, within)
	if err != nil {
		slog.Warn("host callbacks refused for this call", "refused", err.Error())
		return nil
	}
	conn, err := h.conn(c)
	if err != nil {
		slog.Warn("host callbacks refused for this call", "endpoint", access.GetEndpoint(), "error", err.Error())
		return nil
	}
	return &HostClient{client: pb.NewHostClient(conn), grant: access.GetGrant()}
}

func (h *hostConns) conn(c checked) (*grpc.ClientConn, error) {
	key := c.key()
	h.mu.Lock()
	defer h.mu.Unlock()
	if conn, ok := h.conns[key]; ok {
		return conn, nil
	}
	if len(h.conns) >= maxHostConns {
		old := h.conns
		// Calls in flight on them finish first (they are bounded by their deadlines).
		time.AfterFunc(2*DefaultHostDeadline, func() {
			for _, c := range old {
				_ = c.Close()
			}
		})
		h.conns = nil
	}
	creds := insecure.NewCredentials()
	if c.https {
		creds = credentials.NewTLS(h.tls(c.serverName))
	}
	conn, err := grpc.NewClient(c.dial.target(), grpc.WithTransportCredentials(creds),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(contract.MaxGRPCMessageBytes),
			grpc.MaxCallSendMsgSize(contract.MaxGRPCMessageBytes)))
	if err != nil {
		return nil, err
	}
	if h.conns == nil {
		h.conns = map[string]*grpc.ClientConn{}
	}
	h.conns[key] = conn
	return conn, nil
}

func (h *hostConns) close() {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, c := range h.conns {
		_ = c.Close()
	}
	h.conns = nil
}
