package contract

import (
	"encoding/json"
	"fmt"
	"strings"
	"unicode/utf8"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/ctxgate/ctxgate/engine-sdk/go/pb"
)

// A Violation says why a contract message is not acceptable: the offending
// field path (proto names, e.g. messages[3].content[0].tool_result.tool_call_id)
// and the problem. It is an error whose gRPC status is INVALID_ARGUMENT
// (malformed) or RESOURCE_EXHAUSTED (over a size limit), with the message
// "<field>: <problem>", as every SDK words it.
type Violation struct {
	Field    string
	TooLarge bool
	Problem  string
}

func invalid(field, problem string) *Violation { return &Violation{Field: field, Problem: problem} }

func tooLarge(field, problem string) *Violation {
	return &Violation{Field: field, TooLarge: true, Problem: problem}
}

func (v *Violation) Error() string { return v.Field + ": " + v.Problem }

// Code is INVALID_ARGUMENT, or RESOURCE_EXHAUSTED for a size limit.
func (v *Violation) Code() codes.Code {
	if v.TooLarge {
		return codes.ResourceExhausted
	}
	return codes.InvalidArgument
}

// GRPCStatus makes a Violation a status error (status.FromError, status.Code).
func (v *Violation) GRPCStatus() *status.Status { return status.New(v.Code(), v.Error()) }

func (v *Violation) at(field string) *Violation { return &Violation{field, v.TooLarge, v.Problem} }

func (v *Violation) under(parent string) *Violation { return v.at(parent + "." + v.Field) }

// CheckID checks a required id: non-blank and at most MaxIDBytes.
func CheckID(value, field string) *Violation {
	if strings.TrimSpace(value) == "" {
		return invalid(field, "is required")
	}
	if len(value) > MaxIDBytes {
		return tooLarge(field, fmt.Sprintf("is %d bytes, the limit is %d", len(value), MaxIDBytes))
	}
	return nil
}

// ContentBytes is the summed size of a message's content parts, in bytes.
func ContentBytes(m *pb.AgentMessage) int {
	n := 0
	for _, p := range m.GetContent() {
		switch part := p.GetPart().(type) {
		case *pb.ContentPart_Text:
			n += len(part.Text)
		case *pb.ContentPart_Thinking:
			n += len(part.Thinking.GetText()) + len(part.Thinking.GetSignature())
		case *pb.ContentPart_Image:
			n += len(part.Image.GetUri()) + len(part.Image.GetMimeType())
		case *pb.ContentPart_ToolCall:
			c := part.ToolCall
			n += len(c.GetId()) + len(c.GetName()) + len(c.GetArgumentsJson())
		case *pb.ContentPart_ToolResult:
			r := part.ToolResult
			n += len(r.GetToolCallId()) + len(r.GetToolName()) + len(r.GetText())
		}
	}
	return n
}

// checkMessage checks one message with paths relative to it; nothing is
// allocated unless something is wrong (it runs on every message).
func checkMessage(m *pb.AgentMessage) *Violation {
	if v := CheckID(m.GetId(), "id"); v != nil {
		return v
	}
	role := m.GetRole()
	if role == pb.Role_ROLE_UNSPECIFIED {
		return invalid("role", "is required")
	}
	if _, known := pb.Role_name[int32(role)]; !known {
		return invalid("role", fmt.Sprintf("unknown role %d", int32(role)))
	}
	for i, p := range m.GetContent() {
		at := func(rest string) string { return fmt.Sprintf("content[%d]%s", i, rest) }
		switch part := p.GetPart().(type) {
		case nil:
			return invalid(at(""), "has no part set")
		case *pb.ContentPart_ToolCall:
			if v := CheckID(part.ToolCall.GetId(), ""); v != nil {
				return v.at(at(".tool_call.id"))
			}
			if strings.TrimSpace(part.ToolCall.GetName()) == "" {
				return invalid(at(".tool_call.name"), "is required")
			}
		case *pb.ContentPart_ToolResult:
			if v := CheckID(part.ToolResult.GetToolCallId(), ""); v != nil {
				return v.at(at(".tool_result.tool_call_id"))
			}
		}
	}
	md := m.GetMetadata()
	if len(md) > MaxMetadataEntries {
		return tooLarge("metadata", fmt.Sprintf("has %d entries, the limit is %d", len(md), MaxMetadataEntries))
	}
	for k, v := range md {
		if len(k) > MaxMetadataKeyBytes {
			return tooLarge("metadata", fmt.Sprintf("has a %d-byte key, the limit is %d", len(k), MaxMetadataKeyBytes))
		}
		if len(v) > MaxMetadataValueBytes {
			return tooLarge("metadata", fmt.Sprintf("[%s] is %d bytes, the limit is %d", truncate(k, 64), len(v), MaxMetadataValueBytes))
		}
	}
	if size := ContentBytes(m); size > MaxMessageContentBytes {
		return tooLarge("content", fmt.Sprintf("is %d bytes, the limit is %d", size, MaxMessageContentBytes))
	}
	return nil
}

func truncate(s string, runes int) string {
	if utf8.RuneCountInString(s) <= runes {
		return s
	}
	return string([]rune(s)[:runes])
}

// CheckMessage checks one well-formed message: id, known role, parts set,
// tool ids present, content within MaxMessageContentBytes.
func CheckMessage(m *pb.AgentMessage, field string) *Violation {
	if v := checkMessage(m); v != nil {
		return v.under(field)
	}
	return nil
}

// CheckMessages checks a list of well-formed messages with unique ids, at
// most MaxMessages.
func CheckMessages(list []*pb.AgentMessage, field string) *Violation {
	if len(list) > MaxMessages {
		return tooLarge(field, fmt.Sprintf("has %d messages, the limit is %d", len(list), MaxMessages))
	}
	seen := make(map[string]struct{}, len(list))
	for i, m := range list {
		if v := checkMessage(m); v != nil {
			return v.under(fmt.Sprintf("%s[%d]", field, i))
		}
		if _, dup := seen[m.GetId()]; dup {
			return invalid(fmt.Sprintf("%s[%d].id", field, i), fmt.Sprintf("duplicates message id %q", m.GetId()))
		}
		seen[m.GetId()] = struct{}{}
	}
	return nil
}

// FirstOrphanResult finds the first tool result in list (message index,
// part index) whose tool call does not precede it; ok is false when none.
func FirstOrphanResult(list []*pb.AgentMessage) (msg, part int, ok bool) {
	calls := map[string]struct{}{}
	for i, m := range list {
		for j, p := range m.GetContent() {
			switch x := p.GetPart().(type) {
			case *pb.ContentPart_ToolCall:
				calls[x.ToolCall.GetId()] = struct{}{}
			case *pb.ContentPart_ToolResult:
				if _, called := calls[x.ToolResult.GetToolCallId()]; !called {
					return i, j, true
				}
			}
		}
	}
	return 0, 0, false
}

// CheckToolPairs checks that every tool result is preceded, in list, by
// the tool call it answers.
func CheckToolPairs(list []*pb.AgentMessage, field string) *Violation {
	i, j, orphan := FirstOrphanResult(list)
	if !orphan {
		return nil
	}
	id := list[i].GetContent()[j].GetToolResult().GetToolCallId()
	return invalid(fmt.Sprintf("%s[%d].content[%d].tool_result", field, i, j),
		fmt.Sprintf("answers tool call %q, which does not precede it", id))
}

// CheckToolName checks a tool name: 1 to 64 of [a-zA-Z0-9_-].
func CheckToolName(name, field string) *Violation {
	ok := len(name) >= 1 && len(name) <= MaxToolNameBytes
	for i := 0; ok && i < len(name); i++ {
		b := name[i]
		ok = b >= 'a' && b <= 'z' || b >= 'A' && b <= 'Z' || b >= '0' && b <= '9' || b == '_' || b == '-'
	}
	if !ok {
		return invalid(field, fmt.Sprintf("%q is not 1 to 64 of [a-zA-Z0-9_-]", name))
	}
	return nil
}

// CheckTools checks an engine's tool declarations: at most MaxTools, names
// valid and unique, descriptions and schemas within their limits, each
// schema a JSON object.
func CheckTools(list []*pb.ToolDefinition, field string) *Violation {
	if len(list) > MaxTools {
		return tooLarge(field, fmt.Sprintf("declares %d tools, the limit is %d", len(list), MaxTools))
	}
	names := map[string]struct{}{}
	for i, t := range list {
		at := fmt.Sprintf("%s[%d]", field, i)
		if v := CheckToolName(t.GetName(), at+".name"); v != nil {
			return v
		}
		if _, dup := names[t.GetName()]; dup {
			return invalid(at+".name", fmt.Sprintf("%q is declared twice", t.GetName()))
		}
		names[t.GetName()] = struct{}{}
		if n := len(t.GetDescription()); n > MaxToolDescriptionBytes {
			return tooLarge(at+".description", fmt.Sprintf("is %d bytes, the limit is %d", n, MaxToolDescriptionBytes))
		}
		schema := t.GetParametersJsonSchema()
		if len(schema) > MaxToolSchemaBytes {
			return tooLarge(at+".parameters_json_schema", fmt.Sprintf("is %d bytes, the limit is %d", len(schema), MaxToolSchemaBytes))
		}
		if strings.TrimSpace(schema) != "" && !isJSONObject(schema) {
			return invalid(at+".parameters_json_schema", "is not a JSON object")
		}
		if _, known := pb.ToolAudience_name[int32(t.GetAudience())]; !known {
			return invalid(at+".audience", fmt.Sprintf("%d is not a ToolAudience", int32(t.GetAudience())))
		}
	}
	return nil
}

func isJSONObject(s string) bool {
	var v any
	if err := json.Unmarshal([]byte(s), &v); err != nil {
		return false
	}
	_, ok := v.(map[string]any)
	return ok
}
