package contract

import (
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/ctxgate/ctxgate/engine-sdk/go/pb"
)

func text(s string) *pb.ContentPart { return &pb.ContentPart{Part: &pb.ContentPart_Text{Text: s}} }

// What the vectors cannot say in JSON (a number outside an enum).
func TestUnknownAndMissingRolesNameTheField(t *testing.T) {
	m := &pb.AgentMessage{Id: "a", Role: pb.Role(42), Content: []*pb.ContentPart{text("hi")}}
	v := CheckMessages([]*pb.AgentMessage{m}, "messages")
	if v == nil || v.Field != "messages[0].role" || v.Code() != codes.InvalidArgument || v.Problem != "unknown role 42" {
		t.Fatalf("%v", v)
	}
	m.Role = pb.Role_ROLE_UNSPECIFIED
	if v := CheckMessage(m, "m"); v == nil || v.Field != "m.role" {
		t.Fatalf("%v", v)
	}
	bad := &pb.ToolDefinition{Name: "t", Audience: pb.ToolAudience(9)}
	if v := CheckTools([]*pb.ToolDefinition{bad}, "info.tools"); v == nil || v.Field != "info.tools[0].audience" {
		t.Fatalf("%v", v)
	}
}

func TestAViolationIsAStatusErrorWithItsFieldPath(t *testing.T) {
	big := &pb.AgentMessage{Id: "b", Role: pb.Role_ROLE_USER, Content: []*pb.ContentPart{text(strings.Repeat("x", MaxMessageContentBytes+1))}}
	err := CheckRequest(&pb.IngestRequest{SessionId: "s", Message: big})
	if s := status.Convert(err); s.Code() != codes.ResourceExhausted || s.Message() != "message.content: is 1048577 bytes, the limit is 1048576" {
		t.Fatalf("%v", s)
	}
	if err := CheckRequest(&pb.GetInfoRequest{}); err != nil {
		t.Fatalf("GetInfo has nothing to check: %v", err)
	}
}

func TestTheEstimateIsCharsOverFourWithCJKAndImagesAndUsageWins(t *testing.T) {
	for s, want := range map[string]uint64{"": 0, "abcd": 1, "abcde": 2, "日本語": 3, "日本語abcd": 4} {
		if got := TextTokens(s); got != want {
			t.Errorf("TextTokens(%q) = %d, want %d", s, got, want)
		}
	}
	m := &pb.AgentMessage{Content: []*pb.ContentPart{{Part: &pb.ContentPart_Image{Image: &pb.ImageRef{}}}, text("abcd")}}
	if got := MessageTokens(m); got != ImageTokens+1 {
		t.Errorf("image + text: %d", got)
	}
	seven := uint64(7)
	m.Usage = &pb.Usage{OutputTokens: &seven}
	if got := MessageTokens(m); got != 7 {
		t.Errorf("reported usage: %d", got)
	}
}

func TestTraceParentsRoundTripAndInvalidOnesAreRefused(t *testing.T) {
	s := "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	tp, ok := ParseTraceParent(s)
	if !ok || tp.String() != s || tp.TraceIDHex() != "4bf92f3577b34da6a3ce929d0e0e4736" || !tp.Sampled() {
		t.Fatalf("%v %v", tp, ok)
	}
	if c := tp.Child(); c.TraceID != tp.TraceID || c.Flags != tp.Flags || c.ParentID == tp.ParentID {
		t.Fatalf("child %v", c)
	}
	for _, bad := range []string{
		"", "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
		"00-00000000000000000000000000000000-00f067aa0ba902b7-01",
		"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
		"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
		"00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
		"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
		"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-zz",
	} {
		if _, ok := ParseTraceParent(bad); ok {
			t.Errorf("%q parsed", bad)
		}
	}
}

func TestAGapRoundTripsAndPlainPreconditionsAreNotGaps(t *testing.T) {
	held := &pb.HistoryCursor{MessageId: "m7", Seq: 7, MessageCount: 7, Tokens: 70}
	gap, ok := GapOf(GapStatus(held).Err())
	if !ok || gap.GetHeld().GetMessageId() != "m7" || gap.GetHeld().GetTokens() != 70 {
		t.Fatalf("%v %v", gap, ok)
	}
	if _, ok := GapOf(status.Error(codes.FailedPrecondition, "history gap")); ok {
		t.Fatal("text is not a detail")
	}
	if _, ok := GapOf(status.Error(codes.Internal, "x")); ok {
		t.Fatal("INTERNAL is not a gap")
	}
}
