package enginesdk

import (
	"context"
	"fmt"
	"net"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/ctxgate/ctxgate/engine-sdk/go/contract"
	"github.com/ctxgate/ctxgate/engine-sdk/go/pb"
)

// fakeHost plays the gateway's Host service: a grant is its token, and
// mode says how ReadTranscript answers ("" three entries, "endless" 1000
// small entries a chunk for ever, "huge" 1 MiB entries for ever).
type fakeHost struct {
	pb.UnimplementedHostServer
	mode     string
	grant    atomic.Value // the last grant token seen
	deadline atomic.Bool  // the last request carried a deadline
	trace    atomic.Value // the last traceparent seen
	sent     atomic.Int64 // entries sent in all
	ended    chan struct{}
}

func (h *fakeHost) ReadTranscript(req *pb.ReadTranscriptRequest, stream pb.Host_ReadTranscriptServer) error {
	ctx := stream.Context()
	h.grant.Store(req.GetGrant())
	_, hasDeadline := ctx.Deadline()
	h.deadline.Store(hasDeadline)
	md, _ := metadata.FromIncomingContext(ctx)
	h.trace.Store(strings.Join(md.Get(contract.TraceHeader), ""))
	if req.GetGrant() != "token-of-read" || req.GetSessionId() != "read" {
		return status.Error(codes.PermissionDenied, "bad grant")
	}
	entry := func(i int64, text string) *pb.TranscriptEntry {
		return &pb.TranscriptEntry{Id: "e", Seq: uint64(i), Entry: &pb.TranscriptEntry_Message{Message: userMsg("m", text)}}
	}
	if h.mode == "" {
		return stream.Send(&pb.TranscriptChunk{Entries: []*pb.TranscriptEntry{entry(1, "a"), entry(2, "b"), entry(3, "c")}})
	}
	defer close(h.ended)
	big := strings.Repeat("x", 1<<20)
	for i := int64(0); ; i++ {
		chunk := &pb.TranscriptChunk{}
		if h.mode == "huge" {
			chunk.Entries = []*pb.TranscriptEntry{entry(i, big)}
		} else {
			for j := 0; j < 1000; j++ {
				chunk.Entries = append(chunk.Entries, entry(i, "a line of transcript"))
			}
		}
		if err := stream.Send(chunk); err != nil {
			return err
		}
		h.sent.Add(int64(len(chunk.Entries)))
		if ctx.Err() != nil {
			return ctx.Err()
		}
	}
}

// startHost serves h on addr; answers its endpoint.
func startHost(t *testing.T, h *fakeHost, addr string) string {
	t.Helper()
	h.ended = make(chan struct{})
	l := loopback(t, addr)
	s := grpc.NewServer()
	pb.RegisterHostServer(s, h)
	go func() { _ = s.Serve(l) }()
	t.Cleanup(s.Stop)
	return "http://" + l.Addr().String()
}

func access(endpoint string) *pb.HostAccess {
	return &pb.HostAccess{Endpoint: endpoint, Grant: &pb.Grant{
		Token: "token-of-read", SessionId: "read", Operations: []string{ReadTranscriptOp},
		ExpiresAtUnixMs: time.Now().Add(time.Minute).UnixMilli(),
	}}
}

func readVia(t *testing.T, e *served, p *probe, endpoint string, ctx context.Context) seen {
	t.Helper()
	req := assembleReq("read")
	req.Host = access(endpoint)
	if _, err := e.client.Assemble(ctx, req); err != nil {
		t.Fatal(err)
	}
	return next(t, p.seen)
}

func TestHostCallbacksCarryTheGrantTheDeadlineAndTheMethodsSpan(t *testing.T) {
	h := &fakeHost{}
	endpoint := startHost(t, h, "127.0.0.1:0")
	p := newProbe()
	e := serve(t, p, Options{})
	incoming := "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	ctx := metadata.AppendToOutgoingContext(timeout(5*time.Second), contract.TraceHeader, incoming)
	got := readVia(t, e, p, endpoint, ctx)
	if !got.host || got.read != nil || got.entries != 3 {
		t.Fatalf("read through the calling peer's host: %+v", got)
	}
	if h.grant.Load() != "token-of-read" || !h.deadline.Load() {
		t.Fatalf("the callback carried grant %v, a deadline: %v", h.grant.Load(), h.deadline.Load())
	}
	sent, ok := contract.ParseTraceParent(h.trace.Load().(string))
	in, _ := contract.ParseTraceParent(incoming)
	if !ok || sent.TraceID != in.TraceID || sent.ParentID == in.ParentID {
		t.Fatalf("the callback's traceparent %q does not continue %q under the method's span", h.trace.Load(), incoming)
	}
	// Without a deadline of its own, the callback still carries one.
	got = readVia(t, e, p, endpoint, context.Background())
	if got.read != nil || !h.deadline.Load() {
		t.Fatalf("a call without a deadline: %+v, deadline %v", got, h.deadline.Load())
	}
}

func TestAHostEndpointThatIsNotTheCallerIsNeverDialledUnlessAllowed(t *testing.T) {
	// A canary on another loopback address: any connection to it is a dial.
	canary := loopback(t, "127.0.0.2:0")
	var dials atomic.Int64
	go func() {
		for {
			c, err := canary.Accept()
			if err != nil {
				return
			}
			dials.Add(1)
			_ = c.Close()
		}
	}()
	foreign := canary.Addr().String()
	allowed, err := ParseHostEndpoint(foreign)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		allow   []HostEndpoint
		dialled bool
	}{{nil, false}, {[]HostEndpoint{allowed}, true}} {
		p := newProbe()
		e := serve(t, p, Options{HostAllow: c.allow})
		got := readVia(t, e, p, foreign, timeout(5*time.Second))
		if c.dialled {
			if !got.host || got.read == nil || dials.Load() == 0 {
				t.Fatalf("a listed endpoint is called: %+v, %d dials", got, dials.Load())
			}
		} else if got.host || dials.Load() != 0 {
			t.Fatalf("an endpoint that is not the caller got a host client (%+v) or a dial (%d)", got, dials.Load())
		}
	}
}

func TestAnEndlessTranscriptIsCutAtTheReadCapsWithBoundedMemory(t *testing.T) {
	for mode, cap := range map[string]string{"endless": "more than 20000 entries", "huge": "more than 16777216 bytes"} {
		h := &fakeHost{mode: mode}
		endpoint := startHost(t, h, "127.0.0.1:0")
		p := newProbe()
		e := serve(t, p, Options{})
		var before runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		got := readVia(t, e, p, endpoint, timeout(20*time.Second))
		if status.Code(got.read) != codes.ResourceExhausted || !strings.Contains(got.read.Error(), cap) {
			t.Fatalf("%s: the read ended with %v, not RESOURCE_EXHAUSTED naming the cap (%s)", mode, got.read, cap)
		}
		select {
		case <-h.ended:
		case <-time.After(5 * time.Second):
			t.Fatalf("%s: the host's stream was not cut off", mode)
		}
		var after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&after)
		if grown := int64(after.HeapInuse) - int64(before.HeapInuse); grown > 64<<20 {
			t.Fatalf("%s: the heap grew by %d MiB", mode, grown>>20)
		}
	}
}

// pagedHost answers ReadTranscript as the gateway does: a page of at most
// 1000 of entries after the request's cursor, in chunks of 128, the last
// chunk's cursor set when more follow; stuck: a page with no entries and a
// cursor to more.
type pagedHost struct {
	pb.UnimplementedHostServer
	entries  []*pb.TranscriptEntry
	stuck    bool
	mu       sync.Mutex
	requests []*pb.ReadTranscriptRequest
}

func (h *pagedHost) ReadTranscript(req *pb.ReadTranscriptRequest, stream pb.Host_ReadTranscriptServer) error {
	h.mu.Lock()
	h.requests = append(h.requests, req)
	h.mu.Unlock()
	if h.stuck {
		return stream.Send(&pb.TranscriptChunk{NextCursor: "e1"})
	}
	start := 0
	for i, e := range h.entries {
		if e.GetId() == req.GetCursor() {
			start = i + 1
		}
	}
	n := 1000
	if l := int(req.GetLimit()); l > 0 && l < n {
		n = l
	}
	page := h.entries[start:min(start+n, len(h.entries))]
	more := start+len(page) < len(h.entries)
	for i := 0; i < len(page); i += 128 {
		chunk := page[i:min(i+128, len(page))]
		next := chunk[len(chunk)-1].GetId()
		if i+128 >= len(page) && !more {
			next = ""
		}
		if err := stream.Send(&pb.TranscriptChunk{Entries: chunk, NextCursor: next}); err != nil {
			return err
		}
	}
	return nil
}

// seen is the requests h answered so far.
func (h *pagedHost) seen() []*pb.ReadTranscriptRequest {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.requests)
}

// pagedClient is a host client to h, served on loopback.
func pagedClient(t *testing.T, h *pagedHost) *HostClient {
	t.Helper()
	l := loopback(t, "127.0.0.1:0")
	s := grpc.NewServer()
	pb.RegisterHostServer(s, h)
	go func() { _ = s.Serve(l) }()
	t.Cleanup(s.Stop)
	conn, err := grpc.NewClient(l.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return &HostClient{client: pb.NewHostClient(conn), grant: access("").GetGrant()}
}

func TestAReadFollowsTheHostsPagesToTheEndInOrder(t *testing.T) {
	h := &pagedHost{}
	for i := 0; i < 2500; i++ {
		h.entries = append(h.entries, &pb.TranscriptEntry{Id: fmt.Sprintf("e%d", i), Seq: uint64(i)})
	}
	c := pagedClient(t, h)
	ctx := timeout(10 * time.Second)
	entries, err := c.ReadTranscript(ctx, true)
	if err != nil {
		t.Fatal(err)
	}
	if len(entries) != 2500 {
		t.Fatalf("read %d entries, not 2500", len(entries))
	}
	for i, e := range entries {
		if e.GetSeq() != uint64(i) {
			t.Fatalf("entry %d is seq %d: not in order", i, e.GetSeq())
		}
	}
	var cursors []string
	for _, r := range h.seen() {
		if !r.GetVisibleOnly() || r.GetLimit() != 0 {
			t.Fatalf("a page asked for %v", r)
		}
		cursors = append(cursors, r.GetCursor())
	}
	if want := []string{"", "e999", "e1999"}; !slices.Equal(cursors, want) {
		t.Fatalf("the calls' cursors were %q, not %q (three calls, each resuming)", cursors, want)
	}
	page, next, err := c.ReadTranscriptPage(ctx, false, "e999", 10)
	if err != nil || len(page) != 10 || page[0].GetId() != "e1000" || next != "e1009" {
		t.Fatalf("one page of 10 after e999: %d entries, next %q, %v", len(page), next, err)
	}
	page, next, err = c.ReadTranscriptPage(ctx, false, "e2399", 500)
	if err != nil || len(page) != 100 || page[99].GetId() != "e2499" || next != "" {
		t.Fatalf("the last page: %d entries, next %q (nothing follows), %v", len(page), next, err)
	}
}

func TestAPageWithNoEntriesButACursorFailsRatherThanLoop(t *testing.T) {
	h := &pagedHost{stuck: true}
	c := pagedClient(t, h)
	_, err := c.ReadTranscript(timeout(10*time.Second), false)
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "no new entries and a cursor to more") {
		t.Fatalf("a host paging without progress: %v", err)
	}
	if n := len(h.seen()); n != 1 {
		t.Fatalf("it asked %d times", n)
	}
}

func TestByDefaultOnlyTheCallingPeerIsCalledBack(t *testing.T) {
	var p HostPolicy
	ip := func(s string) Peer { return Peer{IP: net.ParseIP(s)} }
	check := func(pol HostPolicy, endpoint string, from Peer) error {
		_, err := pol.Check(context.Background(), endpoint, from, 2*time.Second)
		return err
	}
	for _, ok := range []struct {
		endpoint string
		peer     Peer
	}{
		{"127.0.0.1:7300", ip("127.0.0.1")}, {"http://127.0.0.1:7300", ip("127.0.0.1")},
		{"localhost:7300", ip("127.0.0.1")}, {"127.0.0.1:7300", ip("::ffff:127.0.0.1")},
		{"127.0.0.1:7300", Peer{}},
	} {
		if err := check(p, ok.endpoint, ok.peer); err != nil {
			t.Errorf("%s from %s: %v", ok.endpoint, ok.peer, err)
		}
	}
	for _, refused := range []struct {
		endpoint, why string
		peer          Peer
	}{
		{"10.1.2.3:7300", "is not the calling peer", ip("127.0.0.1")},
		{"127.0.0.2:7300", "is not the calling peer", ip("127.0.0.1")},
		{"unix:///run/gw.sock", "is a unix socket named by a request", Peer{}},
		{"name.invalid:7300", "is not the calling peer", ip("127.0.0.1")},
		{"not an endpoint", "is not a valid endpoint", ip("127.0.0.1")},
		{"10.1.2.3:7300", "is not the calling peer", Peer{}},
	} {
		if err := check(p, refused.endpoint, refused.peer); err == nil || !strings.Contains(err.Error(), refused.why) {
			t.Errorf("%s from %s: %v, want %q", refused.endpoint, refused.peer, err, refused.why)
		}
	}
	// A name is dialled at the address that matched, verified by its name.
	c, err := p.Check(context.Background(), "https://localhost:7300", ip("127.0.0.1"), 2*time.Second)
	if err != nil || c.dial.String() != "127.0.0.1:7300" || !c.https || c.serverName != "localhost" {
		t.Errorf("https://localhost:7300: %+v, %v", c, err)
	}
}

func TestAnAllowListIsAllThatIsCalledBack(t *testing.T) {
	var allow []HostEndpoint
	for _, s := range []string{"10.0.0.5:7300", "unix:///run/gw.sock", "https://gateway:7300"} {
		e, err := ParseHostEndpoint(s)
		if err != nil {
			t.Fatal(err)
		}
		allow = append(allow, e)
	}
	p := HostPolicy{Allow: allow}
	from := Peer{IP: net.ParseIP("192.168.1.1")}
	for endpoint, want := range map[string]bool{
		"http://10.0.0.5:7300": true, "https://gateway:7300": true, "unix:///run/gw.sock": true,
		"gateway:7300": false, "https://10.0.0.5:7300": false, "127.0.0.1:7300": false,
	} {
		_, err := p.Check(context.Background(), endpoint, from, time.Second)
		if (err == nil) != want {
			t.Errorf("%s: %v, want allowed=%v", endpoint, err, want)
		}
		if err != nil && !strings.Contains(err.Error(), "--host-allow") {
			t.Errorf("%s: %v does not say how to allow it", endpoint, err)
		}
	}
}
