// Command assemble-bench measures the Assemble round trip of engines, side
// by side in one run, the way gateway/benches/engine_call.rs measures its
// "direct" path: one client, a 200-message session (the same messages),
// latency per call at 1 and 16 concurrent callers. Engines are measured in
// interleaved rounds so that the machine's noise falls on all of them.
//
//	go run ./cmd/assemble-bench [-calls 2000] NAME=http://HOST:PORT ...
//	go run ./cmd/assemble-bench passthrough   # serves the Go SDK pass-through engine
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"sort"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"

	enginesdk "github.com/ctxgate/ctxgate/engine-sdk/go"
	"github.com/ctxgate/ctxgate/engine-sdk/go/contract"
	"github.com/ctxgate/ctxgate/engine-sdk/go/pb"
)

// passThrough is engine_call.rs's PassThrough on the Go SDK: Assemble
// returns the history it was sent.
type passThrough struct{}

func (passThrough) GetInfo(context.Context) (*pb.EngineInfo, error) {
	return &pb.EngineInfo{Id: "bench", Name: "bench", ContractVersion: "1.0"}, nil
}
func (passThrough) Ingest(context.Context, *pb.IngestRequest) (*pb.IngestResult, error) {
	return &pb.IngestResult{}, nil
}
func (passThrough) Assemble(_ context.Context, r *pb.AssembleRequest) (*pb.AssembleResult, error) {
	return &pb.AssembleResult{Messages: r.GetMessages(), EstimatedTokens: contract.MessagesTokens(r.GetMessages())}, nil
}
func (passThrough) Compact(context.Context, *pb.CompactRequest, *enginesdk.Progress) (enginesdk.CompactOutcome, error) {
	return enginesdk.DelegateToHost(""), nil
}

// request is engine_call.rs's request(): 200 messages, user and assistant
// in turn, each "message {i}: " and eight times "some words of conversation ".
func request() *pb.AssembleRequest {
	var messages []*pb.AgentMessage
	for i := 0; i < 200; i++ {
		role := pb.Role_ROLE_USER
		if i%2 == 1 {
			role = pb.Role_ROLE_ASSISTANT
		}
		text := fmt.Sprintf("message %d: %s", i, strings.Repeat("some words of conversation ", 8))
		messages = append(messages, &pb.AgentMessage{Id: fmt.Sprintf("m%d", i), Role: role,
			Content: []*pb.ContentPart{enginesdk.TextPart(text)}})
	}
	budget, key := uint64(100_000), "bench"
	return &pb.AssembleRequest{SessionId: "bench", SessionKey: &key, Messages: messages, TokenBudget: &budget}
}

type target struct {
	name   string
	client pb.ContextEngineClient
	lat    map[int][]time.Duration
	spent  map[int]time.Duration
}

func main() {
	if len(os.Args) > 1 && os.Args[1] == "passthrough" {
		os.Args = append(os.Args[:1], os.Args[2:]...)
		enginesdk.Main(func(enginesdk.Options) (enginesdk.Engine, error) { return passThrough{}, nil })
		return
	}
	calls := flag.Int("calls", 2000, "calls per engine at concurrency 1 (6400 at 16)")
	rounds := flag.Int("rounds", 20, "interleaved rounds the calls are split into")
	flag.Parse()
	var targets []*target
	for _, arg := range flag.Args() {
		name, endpoint, ok := strings.Cut(arg, "=")
		e, err := enginesdk.ParseEndpoint(endpoint)
		if !ok || err != nil {
			fmt.Fprintf(os.Stderr, "assemble-bench: %q is not NAME=ENDPOINT\n", arg)
			os.Exit(2)
		}
		conn, err := grpc.NewClient("passthrough:///"+e.String(),
			grpc.WithTransportCredentials(insecure.NewCredentials()),
			grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(contract.MaxGRPCMessageBytes)))
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		targets = append(targets, &target{name: name, client: pb.NewContextEngineClient(conn),
			lat: map[int][]time.Duration{}, spent: map[int]time.Duration{}})
	}
	req := request()
	fmt.Printf("Assemble of a 200-message session (%d KiB), latency in µs\n", proto.Size(req)/1024)
	for _, t := range targets { // warm up: connections, caches
		t.run(req, 4, 200)
		t.lat = map[int][]time.Duration{}
		t.spent = map[int]time.Duration{}
	}
	for _, conc := range []int{1, 16} {
		n := *calls
		if conc > 1 {
			n = *calls * 16 / 5
		}
		for r := 0; r < *rounds; r++ {
			for _, t := range targets {
				t.record(conc, req, n / *rounds)
			}
		}
	}
	fmt.Printf("%-16s %5s %10s %10s %10s\n", "engine", "conc", "p50", "p99", "calls/s")
	for _, conc := range []int{1, 16} {
		for _, t := range targets {
			l := t.lat[conc]
			sort.Slice(l, func(i, j int) bool { return l[i] < l[j] })
			fmt.Printf("%-16s %5d %10.0f %10.0f %10.0f\n", t.name, conc, pct(l, 0.5), pct(l, 0.99),
				float64(len(l))/t.spent[conc].Seconds())
		}
	}
}

func (t *target) record(conc int, req *pb.AssembleRequest, n int) {
	started := time.Now()
	lat := t.run(req, conc, n)
	t.spent[conc] += time.Since(started)
	t.lat[conc] = append(t.lat[conc], lat...)
}

// run makes n calls from conc callers; answers their latencies.
func (t *target) run(req *pb.AssembleRequest, conc, n int) []time.Duration {
	var mu sync.Mutex
	var all []time.Duration
	var wg sync.WaitGroup
	for c := 0; c < conc; c++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			out := make([]time.Duration, 0, n/conc)
			for i := 0; i < n/conc; i++ {
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				start := time.Now()
				if _, err := t.client.Assemble(ctx, req); err != nil {
					fmt.Fprintf(os.Stderr, "assemble-bench: %s: %v\n", t.name, err)
					os.Exit(1)
				}
				out = append(out, time.Since(start))
				cancel()
			}
			mu.Lock()
			all = append(all, out...)
			mu.Unlock()
		}()
	}
	wg.Wait()
	return all
}

func pct(sorted []time.Duration, p float64) float64 {
	i := int(float64(len(sorted)-1)*p + 0.5)
	return float64(sorted[i].Microseconds())
}
