package main

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"

	enginesdk "github.com/ctxgate/ctxgate/engine-sdk/go"
	"github.com/ctxgate/ctxgate/engine-sdk/go/contract"
	"github.com/ctxgate/ctxgate/engine-sdk/go/pb"
)

// recall keeps every message of each session (DELTA delivery: the gateway
// sends only what is new), assembles the newest turns that fit the budget
// without splitting a tool call from its result, leaves summarising to the
// gateway, and offers the model one tool, search_history, to find what
// fell out of the window.
type recall struct{ store *store }

func (r *recall) GetInfo(context.Context) (*pb.EngineInfo, error) {
	return &pb.EngineInfo{
		Id: "go-recall", Name: "Go recall engine (SDK example)", Version: enginesdk.Version,
		ContractVersion: "1.0", HistoryDelivery: pb.HistoryDelivery_HISTORY_DELIVERY_DELTA,
		// implemented_methods is left empty: the SDK lists what this type implements.
	}, nil
}

func (r *recall) Ingest(ctx context.Context, req *pb.IngestRequest) (*pb.IngestResult, error) {
	n, err := r.append(req.GetSessionId(), []*pb.AgentMessage{req.GetMessage()})
	return &pb.IngestResult{Ingested: n == 1}, err
}

func (r *recall) IngestBatch(ctx context.Context, req *pb.IngestBatchRequest) (*pb.IngestBatchResult, error) {
	n, err := r.append(req.GetSessionId(), req.GetMessages())
	return &pb.IngestBatchResult{IngestedCount: uint64(n)}, err
}

func (r *recall) append(sessionID string, messages []*pb.AgentMessage) (int, error) {
	s, err := r.store.session(sessionID)
	if err != nil {
		return 0, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.append(messages)
}

func (r *recall) Assemble(ctx context.Context, req *pb.AssembleRequest) (*pb.AssembleResult, error) {
	history := req.GetMessages()
	if cursor := req.GetCursor(); cursor != nil && cursor.GetMessageId() != "" {
		s, err := r.store.session(req.GetSessionId())
		if err != nil {
			return nil, err
		}
		s.mu.Lock()
		_, holds := s.ids[cursor.GetMessageId()]
		if !holds || uint64(len(s.messages)) < cursor.GetMessageCount() {
			held := heldCursor(s)
			s.mu.Unlock()
			return nil, enginesdk.HistoryGap(held)
		}
		// What it holds up to the cursor, then what the request brings.
		own := append([]*pb.AgentMessage(nil), s.messages[:s.ids[cursor.GetMessageId()]+1]...)
		s.mu.Unlock()
		history = append(own, history...)
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	// The newest messages that fit, tool pairs whole (the newest always).
	out, tokens := contract.FitBudget(history, req.TokenBudget)
	return &pb.AssembleResult{Messages: out, EstimatedTokens: tokens}, nil
}

// heldCursor is what s holds, for a gap's detail (nil: nothing).
func heldCursor(s *session) *pb.HistoryCursor {
	if len(s.messages) == 0 {
		return nil
	}
	n := uint64(len(s.messages))
	return &pb.HistoryCursor{MessageId: s.messages[n-1].GetId(), Seq: n, MessageCount: n, Tokens: s.tokens}
}

func (r *recall) Compact(ctx context.Context, req *pb.CompactRequest, p *enginesdk.Progress) (enginesdk.CompactOutcome, error) {
	s, err := r.store.session(req.GetSessionId())
	if err != nil {
		return enginesdk.CompactOutcome{}, err
	}
	s.mu.Lock()
	held := uint64(len(s.messages))
	s.mu.Unlock()
	if err := p.Report("counting", held, held, fmt.Sprintf("%d messages held", held)); err != nil {
		return enginesdk.CompactOutcome{}, err
	}
	return enginesdk.DelegateToHost("the recall engine keeps every message; the gateway's compaction summarises"), nil
}

func (r *recall) ForgetSession(ctx context.Context, req *pb.ForgetSessionRequest) (*pb.ForgetSessionResult, error) {
	return &pb.ForgetSessionResult{}, r.store.forget(req.GetSessionId())
}

const searchTool = "search_history"

func (r *recall) Tools() []*pb.ToolDefinition {
	return []*pb.ToolDefinition{enginesdk.Tool(searchTool,
		"Searches every message of this conversation, including those no longer in view, for a text (case-insensitive).",
		`{"type":"object","properties":{"query":{"type":"string"},"limit":{"type":"integer","minimum":1,"maximum":50}},"required":["query"]}`)}
}

func (r *recall) CallTool(ctx context.Context, req *pb.CallToolRequest) (*pb.CallToolResult, error) {
	if req.GetName() != searchTool {
		return enginesdk.ToolError(fmt.Sprintf("unknown tool %q: this engine offers %s", req.GetName(), searchTool)), nil
	}
	var args struct {
		Query string `json:"query"`
		Limit int    `json:"limit"`
	}
	if err := json.Unmarshal([]byte(req.GetArgumentsJson()), &args); err != nil {
		return enginesdk.ToolError("the arguments are not a JSON object with a query: " + err.Error()), nil
	}
	if strings.TrimSpace(args.Query) == "" {
		return enginesdk.ToolError(`give a "query" to search for`), nil
	}
	if args.Limit <= 0 || args.Limit > 50 {
		args.Limit = 5
	}
	s, err := r.store.session(req.GetSessionId())
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	query := strings.ToLower(args.Query)
	var found []string
	for i := len(s.messages) - 1; i >= 0 && len(found) < args.Limit; i-- {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		m := s.messages[i]
		if text := textOf(m); strings.Contains(strings.ToLower(text), query) {
			found = append(found, fmt.Sprintf("[%s, %s] %s", m.GetId(), roleName(m.GetRole()), snippet(text, 300)))
		}
	}
	if len(found) == 0 {
		return enginesdk.ToolText(fmt.Sprintf("nothing in this conversation mentions %q", args.Query)), nil
	}
	return enginesdk.ToolText(strings.Join(found, "\n")), nil
}

func textOf(m *pb.AgentMessage) string {
	var b strings.Builder
	for _, p := range m.GetContent() {
		switch {
		case p.GetText() != "":
			b.WriteString(p.GetText())
		case p.GetToolResult() != nil:
			b.WriteString(p.GetToolResult().GetText())
		case p.GetToolCall() != nil:
			b.WriteString(p.GetToolCall().GetName() + " " + p.GetToolCall().GetArgumentsJson())
		}
		b.WriteByte(' ')
	}
	return strings.TrimSpace(b.String())
}

func roleName(r pb.Role) string {
	return strings.ToLower(strings.TrimPrefix(r.String(), "ROLE_"))
}

func snippet(s string, runes int) string {
	if r := []rune(s); len(r) > runes {
		return string(r[:runes]) + "…"
	}
	return s
}
