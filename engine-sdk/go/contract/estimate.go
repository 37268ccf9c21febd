package contract

import "github.com/ctxgate/ctxgate/engine-sdk/go/pb"

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
