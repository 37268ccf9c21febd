package main

import (
	"context"
	"testing"

	enginesdk "github.com/ctxgate/ctxgate/engine-sdk/go"
	"github.com/ctxgate/ctxgate/engine-sdk/go/contract"
	"github.com/ctxgate/ctxgate/engine-sdk/go/pb"
)

func msg(id string, role pb.Role, parts ...*pb.ContentPart) *pb.AgentMessage {
	return &pb.AgentMessage{Id: id, Role: role, Content: parts}
}

func open(t *testing.T, dir string) *recall {
	t.Helper()
	st, err := openStore(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.lock.Close() })
	return &recall{store: st}
}

func ids(ms []*pb.AgentMessage) (out []string) {
	for _, m := range ms {
		out = append(out, m.GetId())
	}
	return out
}

func TestWhatWasAcknowledgedSurvivesARestartAndAnUnknownCursorIsAGap(t *testing.T) {
	dir := t.TempDir()
	ctx := context.Background()
	r := open(t, dir)
	held := []*pb.AgentMessage{msg("d1", pb.Role_ROLE_USER, enginesdk.TextPart("ticket D-1")), msg("d2", pb.Role_ROLE_ASSISTANT, enginesdk.TextPart("noted"))}
	if got, err := r.IngestBatch(ctx, &pb.IngestBatchRequest{SessionId: "s", Messages: held}); err != nil || got.GetIngestedCount() != 2 {
		t.Fatalf("%v %v", got, err)
	}
	if _, err := openStore(dir); err == nil {
		t.Fatal("a second engine on the same state directory")
	}
	r.store.lock.Close() // the first engine stops
	r = open(t, dir)
	cursor := &pb.HistoryCursor{MessageId: "d2", Seq: 2, MessageCount: 2}
	out, err := r.Assemble(ctx, &pb.AssembleRequest{SessionId: "s", Cursor: cursor,
		Messages: []*pb.AgentMessage{msg("d3", pb.Role_ROLE_USER, enginesdk.TextPart("and D-3"))}})
	if err != nil || len(out.GetMessages()) != 3 || out.GetEstimatedTokens() == 0 {
		t.Fatalf("after a restart: %v, %v", ids(out.GetMessages()), err)
	}
	if again, _ := r.Ingest(ctx, &pb.IngestRequest{SessionId: "s", Message: held[0]}); again.GetIngested() {
		t.Fatal("a held message was ingested twice")
	}
	_, err = r.Assemble(ctx, &pb.AssembleRequest{SessionId: "other", Cursor: cursor})
	if gap, ok := contract.GapOf(err); !ok || gap.GetHeld() != nil {
		t.Fatalf("an unknown cursor: %v", err)
	}
	_, err = r.Assemble(ctx, &pb.AssembleRequest{SessionId: "s", Cursor: &pb.HistoryCursor{MessageId: "d2", MessageCount: 5}})
	if gap, ok := contract.GapOf(err); !ok || gap.GetHeld().GetMessageId() != "d2" || gap.GetHeld().GetMessageCount() != 2 {
		t.Fatalf("a cursor counting more than is held: %v", err)
	}
}

func TestTheBudgetKeepsTheNewestTurnsWithoutSplittingAToolPair(t *testing.T) {
	call := &pb.ContentPart{Part: &pb.ContentPart_ToolCall{ToolCall: &pb.ToolCall{Id: "c1", Name: "read"}}}
	result := &pb.ContentPart{Part: &pb.ContentPart_ToolResult{ToolResult: &pb.ToolResult{ToolCallId: "c1", Text: "a long output of the tool, long enough"}}}
	history := []*pb.AgentMessage{
		msg("u1", pb.Role_ROLE_USER, enginesdk.TextPart("read it")), msg("a1", pb.Role_ROLE_ASSISTANT, call),
		msg("t1", pb.Role_ROLE_TOOL, result), msg("u2", pb.Role_ROLE_USER, enginesdk.TextPart("thanks")),
	}
	budget := contract.MessageTokens(history[2]) + contract.MessageTokens(history[3])
	out, _ := contract.FitBudget(history, &budget)
	if err := contract.CheckAssembleResult(&pb.AssembleResult{Messages: out}, len(history)); err != nil || len(out) != 1 || out[0].GetId() != "u2" {
		t.Fatalf("%v %v", ids(out), err)
	}
	tiny := uint64(0)
	if out, _ := contract.FitBudget(history, &tiny); len(out) != 1 || out[0].GetId() != "u2" {
		t.Fatalf("the newest message always stays: %v", ids(out))
	}
}

func TestSearchHistoryFindsWhatWasSaidAndFailsAsAResult(t *testing.T) {
	ctx := context.Background()
	r := open(t, t.TempDir())
	_, _ = r.Ingest(ctx, &pb.IngestRequest{SessionId: "s", Message: msg("m1", pb.Role_ROLE_USER, enginesdk.TextPart("The code word is PELICAN."))})
	call := func(name, args string) *pb.CallToolResult {
		res, err := r.CallTool(ctx, &pb.CallToolRequest{SessionId: "s", ToolCallId: "t", Name: name, ArgumentsJson: args})
		if err != nil {
			t.Fatal(err)
		}
		return res
	}
	if res := call(searchTool, `{"query":"pelican"}`); res.GetIsError() || res.GetContent()[0].GetText() != "[m1, user] The code word is PELICAN." {
		t.Fatalf("%v", res)
	}
	for _, c := range [][2]string{{searchTool, "not json"}, {searchTool, `{}`}, {"other", `{}`}} {
		if res := call(c[0], c[1]); !res.GetIsError() {
			t.Fatalf("%v answered %v", c, res)
		}
	}
}
