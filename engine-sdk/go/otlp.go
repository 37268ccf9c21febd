package enginesdk

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	resourcepb "go.opentelemetry.io/proto/otlp/resource/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/ctxgate/ctxgate/engine-sdk/go/contract"
)

// Span export over OTLP/gRPC, bounded by construction: at most SpanQueue
// spans wait to be sent, more are dropped and counted (telemetry never
// slows a call or grows without limit). A batch goes out every second or
// as soon as SpanBatch spans wait; a collector that fails or stalls loses
// that batch (logged once until it recovers), never a call.
const (
	SpanQueue = 4096
	SpanBatch = 512
)

const (
	spanEvery     = time.Second
	exportTimeout = 5 * time.Second
	exportMethod  = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
	scopeName     = "ctxgate-engine-sdk-go"
	rpcSystemGRPC = "grpc"
)

// finishedSpan is one engine method's span.
type finishedSpan struct {
	name       string
	this       contract.TraceParent
	parent     [8]byte
	start, end time.Time
	method     string
	err        string
}

// Exporter sends spans to one OTLP/gRPC collector.
type Exporter struct {
	mu       sync.RWMutex // closed and the queue's close
	closed   bool
	queue    chan finishedSpan
	dropped  atomic.Uint64
	conn     *grpc.ClientConn
	resource *resourcepb.Resource
	endpoint string
	done     chan struct{}
}

// StartExporter starts exporting to endpoint (http://HOST:PORT, usually
// port 4317) as service. Close stops it.
func StartExporter(endpoint, service string) (*Exporter, error) {
	e, err := ParseEndpoint(endpoint)
	if err != nil {
		return nil, err
	}
	if e.Unix != "" {
		return nil, fmt.Errorf("%q: OTLP goes to http://HOST:PORT", endpoint)
	}
	conn, err := grpc.NewClient(e.target(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	x := &Exporter{
		queue: make(chan finishedSpan, SpanQueue), conn: conn, endpoint: endpoint, done: make(chan struct{}),
		resource: &resourcepb.Resource{Attributes: []*commonpb.KeyValue{kv("service.name", service)}},
	}
	go x.send()
	return x, nil
}

// record queues a finished span; drops it (counted) when the queue is full.
// A trace its caller did not sample (W3C flags) is not exported.
func (x *Exporter) record(s finishedSpan) {
	if x == nil || !s.this.Sampled() {
		return
	}
	x.mu.RLock()
	defer x.mu.RUnlock()
	if x.closed {
		return
	}
	select {
	case x.queue <- s:
	default:
		x.dropped.Add(1)
	}
}

// Dropped is how many spans were dropped because the queue was full.
func (x *Exporter) Dropped() uint64 { return x.dropped.Load() }

// Close sends what is queued (best effort) and stops.
func (x *Exporter) Close() {
	if x == nil {
		return
	}
	x.mu.Lock()
	if x.closed {
		x.mu.Unlock()
		return
	}
	x.closed = true
	close(x.queue)
	x.mu.Unlock()
	<-x.done
	_ = x.conn.Close()
}

func kv(key, value string) *commonpb.KeyValue {
	return &commonpb.KeyValue{Key: key, Value: &commonpb.AnyValue{Value: &commonpb.AnyValue_StringValue{StringValue: value}}}
}

func (s finishedSpan) wire() *tracepb.Span {
	st := &tracepb.Status{Code: tracepb.Status_STATUS_CODE_OK}
	if s.err != "" {
		st = &tracepb.Status{Code: tracepb.Status_STATUS_CODE_ERROR, Message: s.err}
	}
	return &tracepb.Span{
		TraceId: s.this.TraceID[:], SpanId: s.this.ParentID[:], ParentSpanId: s.parent[:],
		Flags: uint32(s.this.Flags), Name: s.name, Kind: tracepb.Span_SPAN_KIND_SERVER,
		StartTimeUnixNano: uint64(s.start.UnixNano()), EndTimeUnixNano: uint64(s.end.UnixNano()),
		Attributes: []*commonpb.KeyValue{kv("rpc.system", rpcSystemGRPC), kv("rpc.method", s.method)},
		Status:     st,
	}
}

// send is the sending loop: a batch per second or per SpanBatch spans.
func (x *Exporter) send() {
	defer close(x.done)
	failing := false
	for {
		batch, more := x.collect()
		if len(batch) > 0 {
			failing = x.export(batch, failing)
		}
		if !more {
			return
		}
	}
}

func (x *Exporter) collect() ([]*tracepb.Span, bool) {
	var batch []*tracepb.Span
	window := time.NewTimer(spanEvery)
	defer window.Stop()
	for len(batch) < SpanBatch {
		select {
		case s, ok := <-x.queue:
			if !ok {
				return batch, false
			}
			batch = append(batch, s.wire())
		case <-window.C:
			return batch, true
		}
	}
	return batch, true
}

func (x *Exporter) export(batch []*tracepb.Span, failing bool) bool {
	rs := &tracepb.ResourceSpans{Resource: x.resource, ScopeSpans: []*tracepb.ScopeSpans{{
		Scope: &commonpb.InstrumentationScope{Name: scopeName, Version: Version}, Spans: batch,
	}}}
	body, err := proto.Marshal(rs)
	if err != nil {
		return failing
	}
	// ExportTraceServiceRequest is `repeated ResourceSpans resource_spans = 1`:
	// encoded by hand, so the SDK needs only the OTLP data types, not the
	// collector package (which drags grpc-gateway in).
	req := protowire.AppendBytes(protowire.AppendTag(nil, 1, protowire.BytesType), body)
	ctx, cancel := context.WithTimeout(context.Background(), exportTimeout)
	defer cancel()
	var reply rawMessage
	err = x.conn.Invoke(ctx, exportMethod, rawMessage(req), &reply, grpc.ForceCodec(rawCodec{}))
	switch {
	case err == nil && failing:
		slog.Info("OTLP export works again", "endpoint", x.endpoint)
		return false
	case err != nil && !failing:
		slog.Warn("OTLP export failed; spans dropped until it works", "endpoint", x.endpoint, "spans", len(batch), "error", err.Error())
		return true
	}
	return failing
}

// rawMessage is an already-encoded protobuf message.
type rawMessage []byte

// rawCodec passes rawMessage through as the wire bytes.
type rawCodec struct{}

func (rawCodec) Name() string { return "proto" }

func (rawCodec) Marshal(v any) ([]byte, error) {
	if m, ok := v.(rawMessage); ok {
		return m, nil
	}
	return nil, fmt.Errorf("rawCodec: cannot marshal %T", v)
}

func (rawCodec) Unmarshal(data []byte, v any) error {
	if m, ok := v.(*rawMessage); ok {
		*m = append((*m)[:0], data...)
		return nil
	}
	return fmt.Errorf("rawCodec: cannot unmarshal into %T", v)
}
