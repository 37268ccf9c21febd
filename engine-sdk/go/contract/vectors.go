package contract

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/ctxgate/ctxgate/engine-sdk/go/pb"
)

// A Vector is one case of the shared validation vectors (proto/testdata,
// format in its README): a request an engine server must accept or refuse,
// or a reply a caller must accept or refuse, with the status code and the
// field path of the refusal.
type Vector struct {
	Name            string
	Method          Method
	Message         proto.Message
	RequestMessages int
	// WantOK, else WantCode ("INVALID_ARGUMENT" or "RESOURCE_EXHAUSTED")
	// at WantField.
	WantOK    bool
	WantCode  string
	WantField string
}

// LoadVectors reads one vector file (requests.json or results.json) and
// decodes each case's message with protojson, `$repeat` strings expanded.
func LoadVectors(path string) ([]Vector, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var cases []map[string]any
	if err := json.Unmarshal(raw, &cases); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	results := strings.HasPrefix(filepath.Base(path), "results")
	out := make([]Vector, 0, len(cases))
	for _, c := range cases {
		v := Vector{Name: fmt.Sprint(c["name"]), Method: Method(fmt.Sprint(c["method"]))}
		key := "request"
		v.Message = requestOf(v.Method)
		if results {
			key, v.Message = "result", resultOf(v.Method)
		}
		if v.Message == nil {
			return nil, fmt.Errorf("%s: %s: no %s message for method %s", path, v.Name, key, v.Method)
		}
		body, err := json.Marshal(expand(c[key]))
		if err != nil {
			return nil, err
		}
		if err := protojson.Unmarshal(body, v.Message); err != nil {
			return nil, fmt.Errorf("%s: %s: %w", path, v.Name, err)
		}
		if n, ok := c["requestMessages"].(float64); ok {
			v.RequestMessages = int(n)
		}
		expect, _ := c["expect"].(map[string]any)
		v.WantOK, _ = expect["ok"].(bool)
		v.WantCode, _ = expect["code"].(string)
		v.WantField, _ = expect["field"].(string)
		out = append(out, v)
	}
	return out, nil
}

// expand replaces {"$repeat": s, "times": n, "then"?: t} with its string.
func expand(v any) any {
	switch x := v.(type) {
	case map[string]any:
		if s, ok := x["$repeat"].(string); ok {
			n, _ := x["times"].(float64)
			then, _ := x["then"].(string)
			return strings.Repeat(s, int(n)) + then
		}
		out := make(map[string]any, len(x))
		for k, e := range x {
			out[k] = expand(e)
		}
		return out
	case []any:
		out := make([]any, len(x))
		for i, e := range x {
			out[i] = expand(e)
		}
		return out
	}
	return v
}

func requestOf(m Method) proto.Message {
	switch m {
	case Bootstrap:
		return &pb.BootstrapRequest{}
	case Ingest:
		return &pb.IngestRequest{}
	case IngestBatch:
		return &pb.IngestBatchRequest{}
	case Assemble:
		return &pb.AssembleRequest{}
	case Compact:
		return &pb.CompactRequest{}
	case AfterTurn:
		return &pb.AfterTurnRequest{}
	case CommitTurn:
		return &pb.CommitTurnRequest{}
	case Maintain:
		return &pb.MaintainRequest{}
	case PrepareSubagentSpawn:
		return &pb.PrepareSubagentSpawnRequest{}
	case RollbackSubagentSpawn:
		return &pb.RollbackSubagentSpawnRequest{}
	case OnSubagentEnded:
		return &pb.OnSubagentEndedRequest{}
	case ForgetSession:
		return &pb.ForgetSessionRequest{}
	case CallTool:
		return &pb.CallToolRequest{}
	}
	return nil
}

func resultOf(m Method) proto.Message {
	switch m {
	case GetInfo:
		return &pb.EngineInfo{}
	case Assemble:
		return &pb.AssembleResult{}
	case CommitTurn:
		return &pb.CommitTurnResult{}
	case Maintain:
		return &pb.MaintainResult{}
	case CallTool:
		return &pb.CallToolResult{}
	}
	return nil
}

// CheckResult applies the result check of v's method to its message.
func (v Vector) CheckResult() error {
	switch r := v.Message.(type) {
	case *pb.EngineInfo:
		return CheckInfo(r)
	case *pb.AssembleResult:
		return CheckAssembleResult(r, v.RequestMessages)
	case *pb.CommitTurnResult:
		return CheckCommitTurnResult(r)
	case *pb.MaintainResult:
		return CheckMaintainResult(r)
	case *pb.CallToolResult:
		return CheckCallToolResult(r)
	}
	return fmt.Errorf("no result check for %s", v.Method)
}

// Disagreement says where err (what a check answered) and the vector
// differ; "" when they agree.
func (v Vector) Disagreement(err error) string {
	if err == nil {
		if v.WantOK {
			return ""
		}
		return fmt.Sprintf("%s: accepted, the vector refuses it (%s at %s)", v.Name, v.WantCode, v.WantField)
	}
	if v.WantOK {
		return fmt.Sprintf("%s: refused (%v), the vector accepts it", v.Name, err)
	}
	viol, ok := err.(*Violation)
	if !ok {
		return fmt.Sprintf("%s: refused with %v, which is not a violation", v.Name, err)
	}
	code := "INVALID_ARGUMENT"
	if viol.TooLarge {
		code = "RESOURCE_EXHAUSTED"
	}
	if code != v.WantCode || viol.Field != v.WantField {
		return fmt.Sprintf("%s: refused as %s at %q (%v), the vector says %s at %q", v.Name, code, viol.Field, err,
			v.WantCode, v.WantField)
	}
	return ""
}
