// Command recall is the Go SDK's example engine: durable per-session
// history under --state-dir, DELTA delivery with the typed history gap and
// IngestBatch resync, and one tool (search_history).
//
//	go run ./examples/recall --listen 127.0.0.1:7403 --state-dir ./recall-state
package main

import (
	"errors"

	enginesdk "github.com/ctxgate/ctxgate/engine-sdk/go"
)

func main() {
	enginesdk.Main(func(opts enginesdk.Options) (enginesdk.Engine, error) {
		if opts.StateDir == "" {
			return nil, errors.New("--state-dir is required: where the engine keeps each session's history")
		}
		st, err := openStore(opts.StateDir)
		if err != nil {
			return nil, err
		}
		return &recall{store: st}, nil
	})
}
