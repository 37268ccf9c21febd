package contract

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"google.golang.org/protobuf/encoding/protojson"

	"github.com/ctxgate/ctxgate/engine-sdk/go/pb"
)

// The shared vectors' folder, from this package's directory.
var testdata = filepath.Join("..", "..", "..", "proto", "testdata")

func TestEveryRequestVectorIsAcceptedOrRefusedAsItSays(t *testing.T) {
	cases, err := LoadVectors(filepath.Join(testdata, "requests.json"))
	if err != nil {
		t.Fatal(err)
	}
	if len(cases) < 40 {
		t.Fatalf("only %d request vectors: are they all there?", len(cases))
	}
	var problems []string
	for _, c := range cases {
		if d := c.Disagreement(CheckRequest(c.Message)); d != "" {
			problems = append(problems, d)
		}
	}
	if len(problems) > 0 {
		t.Fatal(strings.Join(problems, "\n"))
	}
}

func TestEveryResultVectorIsAcceptedOrRefusedAsItSays(t *testing.T) {
	cases, err := LoadVectors(filepath.Join(testdata, "results.json"))
	if err != nil {
		t.Fatal(err)
	}
	if len(cases) < 30 {
		t.Fatalf("only %d result vectors: are they all there?", len(cases))
	}
	var problems []string
	for _, c := range cases {
		if d := c.Disagreement(c.CheckResult()); d != "" {
			problems = append(problems, d)
		}
	}
	if len(problems) > 0 {
		t.Fatal(strings.Join(problems, "\n"))
	}
}

// The shared budget vectors (budget.json): FitBudget keeps the ids each case
// says, with its estimate, as the Rust SDK's fit_budget does.
func TestEveryBudgetVectorKeepsWhatItSays(t *testing.T) {
	raw, err := os.ReadFile(filepath.Join(testdata, "budget.json"))
	if err != nil {
		t.Fatal(err)
	}
	var cases []struct {
		Name            string            `json:"name"`
		Budget          *uint64           `json:"budget"`
		Messages        []json.RawMessage `json:"messages"`
		Kept            []string          `json:"kept"`
		EstimatedTokens uint64            `json:"estimatedTokens"`
	}
	if err := json.Unmarshal(raw, &cases); err != nil {
		t.Fatal(err)
	}
	if len(cases) < 10 {
		t.Fatalf("only %d budget vectors: are they all there?", len(cases))
	}
	var problems []string
	for _, c := range cases {
		messages := make([]*pb.AgentMessage, len(c.Messages))
		for i, m := range c.Messages {
			var v any
			if err := json.Unmarshal(m, &v); err != nil {
				t.Fatal(err)
			}
			body, err := json.Marshal(expand(v))
			if err != nil {
				t.Fatal(err)
			}
			messages[i] = &pb.AgentMessage{}
			if err := protojson.Unmarshal(body, messages[i]); err != nil {
				t.Fatalf("%s: messages[%d]: %v", c.Name, i, err)
			}
		}
		out, tokens := FitBudget(messages, c.Budget)
		kept := make([]string, len(out))
		for i, m := range out {
			kept[i] = m.GetId()
		}
		if !slices.Equal(kept, c.Kept) || tokens != c.EstimatedTokens {
			problems = append(problems, fmt.Sprintf("%s: kept %q (%d tokens), the vector says %q (%d)", c.Name, kept, tokens, c.Kept, c.EstimatedTokens))
		}
	}
	if len(problems) > 0 {
		t.Fatal(strings.Join(problems, "\n"))
	}
}
