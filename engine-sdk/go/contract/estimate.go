package contract

import (
	"google.golang.org/protobuf/proto"

	"github.com/ctxgate/ctxgate/engine-sdk/go/pb"
)

// ImageTokens is what one image reference is charged.
const ImageTokens = 2000

// TextTokens estimates a text: chars/4 rounded up, CJK characters one
// token each (they tokenise far denser than Latin text).
func TextTokens(text string) uint64 {
	var other, cjk uint64
	for _, c := range text {
		if isCJK(c) {
			cjk++
		} else {
			other++
		}
	}
	return (other+3)/4 + cjk
}

// MessageTokens estimates one message: the provider's output count when it
// reported one, else the estimate of its parts.
func MessageTokens(m *pb.AgentMessage) uint64 {
	if u := m.GetUsage(); u != nil && u.OutputTokens != nil {
		return u.GetOutputTokens()
	}
	var n uint64
	for _, p := range m.GetContent() {
		switch part := p.GetPart().(type) {
		case *pb.ContentPart_Text:
			n += TextTokens(part.Text)
		case *pb.ContentPart_Thinking:
			n += TextTokens(part.Thinking.GetText())
		case *pb.ContentPart_Image:
			n += ImageTokens
		case *pb.ContentPart_ToolCall:
			n += TextTokens(part.ToolCall.GetName()) + TextTokens(part.ToolCall.GetArgumentsJson())
		case *pb.ContentPart_ToolResult:
			n += TextTokens(part.ToolResult.GetText())
		}
	}
	return n
}

// MessagesTokens estimates a list of messages.
func MessagesTokens(messages []*pb.AgentMessage) uint64 {
	var n uint64
	for _, m := range messages {
		n += MessageTokens(m)
	}
	return n
}

// FitBudget is what of messages to assemble under budget tokens (an
// AssembleRequest's TokenBudget, nil when unset): the newest messages that
// fit, and their estimate. A message with tool calls and the tool results
// that follow it (answering those calls) are kept or dropped together, with
// everything between, so the model never sees a result without its call; a
// tool result whose call precedes it nowhere in messages is dropped first
// (and a message it leaves empty), as the contract refuses it. The walk
// stops at the first unit that does not fit (the context stays one
// contiguous run of the newest history), and the newest unit is kept even
// over the budget (the contract refuses an empty answer to a request with
// history; the estimate shows the overflow). No budget keeps everything.
// The same rule as every SDK's, pinned by proto/testdata/budget.json. The
// slice returned shares messages' array, and its messages are messages'
// own unless a result was dropped from one (that one is a copy).
func FitBudget(messages []*pb.AgentMessage, budget *uint64) ([]*pb.AgentMessage, uint64) {
	messages = withoutOrphanResults(messages)
	if budget == nil {
		return messages, MessagesTokens(messages)
	}
	start, tokens := len(messages), uint64(0)
	for start > 0 {
		unit := unitStart(messages, start-1)
		cost := MessagesTokens(messages[unit:start])
		if start < len(messages) && (cost > *budget || tokens > *budget-cost) {
			break
		}
		start, tokens = unit, tokens+cost
	}
	return messages[start:], tokens
}

// withoutOrphanResults is messages without the tool results whose call
// precedes them nowhere (in the order the contract's validation walks), and
// without a message that leaves empty: messages itself when there are none.
func withoutOrphanResults(messages []*pb.AgentMessage) []*pb.AgentMessage {
	calls := map[string]bool{}
	orphan := func(p *pb.ContentPart) bool {
		if c := p.GetToolCall(); c != nil {
			calls[c.GetId()] = true
		}
		r := p.GetToolResult()
		return r != nil && !calls[r.GetToolCallId()]
	}
	found := false
	for _, m := range messages {
		for _, p := range m.GetContent() {
			found = orphan(p) || found
		}
	}
	if !found {
		return messages
	}
	clear(calls)
	kept := make([]*pb.AgentMessage, 0, len(messages))
	for _, m := range messages {
		var content []*pb.ContentPart
		for _, p := range m.GetContent() {
			if !orphan(p) {
				content = append(content, p)
			}
		}
		switch {
		case len(content) == len(m.GetContent()):
			kept = append(kept, m)
		case len(content) > 0:
			copied := proto.Clone(m).(*pb.AgentMessage)
			copied.Content = content
			kept = append(kept, copied)
		}
	}
	return kept
}

// unitStart is where the unit that ends at last starts: a tool result pulls
// it back to the nearest earlier message holding its call, and so do the
// results between.
func unitStart(messages []*pb.AgentMessage, last int) int {
	start := last
	for i := last; i >= start; i-- {
		for _, p := range messages[i].GetContent() {
			r := p.GetToolResult()
			if r == nil {
				continue
			}
			for j := i - 1; j >= 0; j-- {
				if holdsCall(messages[j], r.GetToolCallId()) {
					start = min(start, j)
					break
				}
			}
		}
	}
	return start
}

func holdsCall(m *pb.AgentMessage, id string) bool {
	for _, p := range m.GetContent() {
		if c := p.GetToolCall(); c != nil && c.GetId() == id {
			return true
		}
	}
	return false
}

func isCJK(c rune) bool {
	switch {
	case c >= 0x3040 && c <= 0x30FF, // Hiragana, Katakana
		c >= 0x3400 && c <= 0x4DBF,   // CJK Extension A
		c >= 0x4E00 && c <= 0x9FFF,   // CJK Unified Ideographs
		c >= 0xAC00 && c <= 0xD7AF,   // Hangul syllables
		c >= 0xF900 && c <= 0xFAFF,   // CJK Compatibility Ideographs
		c >= 0x20000 && c <= 0x2FA1F: // Extensions B..F, compatibility supplement
		return true
	}
	return false
}
