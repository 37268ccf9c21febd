// Command minimal is the smallest engine on the Go SDK: it remembers which
// messages it has seen, assembles the history it is sent, and leaves
// compaction to the gateway.
package main

import (
	"context"
	"sync"

	enginesdk "github.com/ctxgate/ctxgate/engine-sdk/go"
	"github.com/ctxgate/ctxgate/engine-sdk/go/contract"
	"github.com/ctxgate/ctxgate/engine-sdk/go/pb"
)

type minimal struct {
	mu   sync.Mutex
	seen map[[2]string]bool // (session id, message id)
}

func (e *minimal) GetInfo(context.Context) (*pb.EngineInfo, error) {
	return &pb.EngineInfo{Id: "minimal-go", Name: "Minimal Go engine", ContractVersion: "1.0"}, nil
}

func (e *minimal) Ingest(_ context.Context, req *pb.IngestRequest) (*pb.IngestResult, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	key := [2]string{req.GetSessionId(), req.GetMessage().GetId()}
	fresh := !e.seen[key]
	e.seen[key] = true
	return &pb.IngestResult{Ingested: fresh}, nil
}

func (e *minimal) Assemble(_ context.Context, req *pb.AssembleRequest) (*pb.AssembleResult, error) {
	messages := req.GetMessages()
	return &pb.AssembleResult{Messages: messages, EstimatedTokens: contract.MessagesTokens(messages)}, nil
}

func (e *minimal) Compact(context.Context, *pb.CompactRequest, *enginesdk.Progress) (enginesdk.CompactOutcome, error) {
	return enginesdk.DelegateToHost("the minimal engine does not summarise"), nil
}

func main() {
	enginesdk.Main(func(enginesdk.Options) (enginesdk.Engine, error) {
		return &minimal{seen: map[[2]string]bool{}}, nil
	})
}
