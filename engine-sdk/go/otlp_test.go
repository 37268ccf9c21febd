package enginesdk

import (
	"context"
	"testing"
	"time"

	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/ctxgate/ctxgate/engine-sdk/go/contract"
)

// collector is an OTLP/gRPC trace collector that hands over what it gets.
type collector struct{ got chan *tracepb.ResourceSpans }

func (c *collector) export(_ any, ctx context.Context, dec func(any) error, _ grpc.UnaryServerInterceptor) (any, error) {
	var req rawMessage
	if err := dec(&req); err != nil {
		return nil, err
	}
	b := []byte(req)
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		b = b[n:]
		if num != 1 || typ != protowire.BytesType {
			n = protowire.ConsumeFieldValue(num, typ, b)
			b = b[n:]
			continue
		}
		v, n := protowire.ConsumeBytes(b)
		b = b[n:]
		rs := &tracepb.ResourceSpans{}
		if err := proto.Unmarshal(v, rs); err != nil {
			return nil, err
		}
		c.got <- rs
	}
	return rawMessage(nil), nil
}

func startCollector(t *testing.T) (string, *collector) {
	t.Helper()
	c := &collector{got: make(chan *tracepb.ResourceSpans, 64)}
	s := grpc.NewServer(grpc.ForceServerCodec(rawCodec{}))
	s.RegisterService(&grpc.ServiceDesc{
		ServiceName: "opentelemetry.proto.collector.trace.v1.TraceService",
		HandlerType: (*any)(nil),
		Methods:     []grpc.MethodDesc{{MethodName: "Export", Handler: c.export}},
	}, c)
	l := loopback(t, "127.0.0.1:0")
	go func() { _ = s.Serve(l) }()
	t.Cleanup(s.Stop)
	return "http://" + l.Addr().String(), c
}

func TestTraceContextIsContinuedAndTheMethodsSpanExportedOverOTLP(t *testing.T) {
	endpoint, c := startCollector(t)
	e := serve(t, newProbe(), Options{OTLPEndpoint: endpoint, OTLPServiceName: "probe-engine"})
	unsampled := "00-11111111111111111111111111111111-2222222222222222-00"
	sampled := "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	for _, tp := range []string{unsampled, sampled} {
		ctx := metadata.AppendToOutgoingContext(timeout(5*time.Second), contract.TraceHeader, tp)
		if _, err := e.client.Assemble(ctx, assembleReq("s")); err != nil {
			t.Fatal(err)
		}
	}
	in, _ := contract.ParseTraceParent(sampled)
	for {
		select {
		case rs := <-c.got:
			if a := rs.GetResource().GetAttributes(); len(a) != 1 || a[0].GetValue().GetStringValue() != "probe-engine" {
				t.Fatalf("resource %v", rs.GetResource())
			}
			for _, ss := range rs.GetScopeSpans() {
				for _, s := range ss.GetSpans() {
					if string(s.GetTraceId()) != string(in.TraceID[:]) {
						t.Fatalf("exported a span of trace %x (unsampled?)", s.GetTraceId())
					}
					if string(s.GetParentSpanId()) != string(in.ParentID[:]) || string(s.GetSpanId()) == string(in.ParentID[:]) ||
						s.GetName() != contract.EngineService+"/Assemble" || s.GetKind() != tracepb.Span_SPAN_KIND_SERVER {
						t.Fatalf("span %v does not continue %s as the method's own span", s, sampled)
					}
					return
				}
			}
		case <-time.After(5 * time.Second):
			t.Fatal("no span reached the collector")
		}
	}
}
