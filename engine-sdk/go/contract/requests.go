package contract

import (
	"fmt"

	"google.golang.org/protobuf/proto"

	"github.com/ctxgate/ctxgate/engine-sdk/go/pb"
)

// CheckRequest applies the checks an engine server runs before engine code
// sees a request (proto/src/validate.rs, request::*): nil when it is
// acceptable, else a *Violation. Messages with nothing to check (GetInfo,
// Dispose) and types outside the contract are accepted.
func CheckRequest(req proto.Message) error {
	if v := checkRequest(req); v != nil {
		return v
	}
	return nil
}

func checkRequest(req proto.Message) *Violation {
	switch r := req.(type) {
	case *pb.BootstrapRequest:
		return CheckID(r.GetSessionId(), "session_id")
	case *pb.IngestRequest:
		return first(CheckID(r.GetSessionId(), "session_id"), func() *Violation {
			if r.GetMessage() == nil {
				return invalid("message", "is required")
			}
			return CheckMessage(r.GetMessage(), "message")
		})
	case *pb.IngestBatchRequest:
		return first(CheckID(r.GetSessionId(), "session_id"), func() *Violation {
			return CheckMessages(r.GetMessages(), "messages")
		})
	case *pb.AssembleRequest:
		return first(CheckID(r.GetSessionId(), "session_id"), func() *Violation {
			return CheckMessages(r.GetMessages(), "messages")
		})
	case *pb.CompactRequest:
		return first(CheckID(r.GetSessionId(), "session_id"), func() *Violation {
			return CheckID(r.GetSessionKey(), "session_key")
		})
	case *pb.AfterTurnRequest:
		return first(CheckID(r.GetSessionId(), "session_id"), func() *Violation {
			if v := CheckMessages(r.GetMessages(), "messages"); v != nil {
				return v
			}
			if r.GetPrePromptMessageCount() > uint64(len(r.GetMessages())) {
				return invalid("pre_prompt_message_count", fmt.Sprintf("is %d but there are only %d messages",
					r.GetPrePromptMessageCount(), len(r.GetMessages())))
			}
			return nil
		})
	case *pb.CommitTurnRequest:
		return checkCommitTurn(r)
	case *pb.MaintainRequest:
		return CheckID(r.GetSessionId(), "session_id")
	case *pb.PrepareSubagentSpawnRequest:
		if v := CheckID(r.GetParentSessionKey(), "parent_session_key"); v != nil {
			return v
		}
		if v := CheckID(r.GetChildSessionKey(), "child_session_key"); v != nil {
			return v
		}
		if r.GetParentSessionKey() == r.GetChildSessionKey() {
			return invalid("child_session_key", "must differ from parent_session_key")
		}
		return nil
	case *pb.RollbackSubagentSpawnRequest:
		return CheckID(r.GetRollbackToken(), "rollback_token")
	case *pb.OnSubagentEndedRequest:
		return CheckID(r.GetChildSessionKey(), "child_session_key")
	case *pb.ForgetSessionRequest:
		return CheckID(r.GetSessionId(), "session_id")
	case *pb.CallToolRequest:
		if v := CheckID(r.GetSessionId(), "session_id"); v != nil {
			return v
		}
		if v := CheckID(r.GetToolCallId(), "tool_call_id"); v != nil {
			return v
		}
		if v := CheckToolName(r.GetName(), "name"); v != nil {
			return v
		}
		if n := len(r.GetArgumentsJson()); n > MaxToolArgumentsBytes {
			return tooLarge("arguments_json", fmt.Sprintf("is %d bytes, the limit is %d", n, MaxToolArgumentsBytes))
		}
		return nil
	}
	return nil
}

func checkCommitTurn(r *pb.CommitTurnRequest) *Violation {
	if v := CheckID(r.GetSessionId(), "session_id"); v != nil {
		return v
	}
	if v := CheckID(r.GetAdvancementKey(), "advancement_key"); v != nil {
		return v
	}
	if r.GetAdmission() == nil {
		return invalid("admission", "is required")
	}
	if r.GetAdmission().GetLogicalTurnId() != r.GetAdvancementKey() {
		return invalid("admission.logical_turn_id", "must equal advancement_key")
	}
	if r.GetTerminal() == nil {
		return invalid("terminal", "is required")
	}
	if v := checkGeneration(r.GetAdmission().GetAnchor().GetGeneration(), "admission.anchor.generation"); v != nil {
		return v
	}
	if v := checkGeneration(r.GetTerminal().GetGeneration(), "terminal.generation"); v != nil {
		return v
	}
	return CheckMessages(r.GetMessages(), "messages")
}

// checkGeneration checks an anchor's generation: opaque, possibly empty, at
// most an id's size.
func checkGeneration(value, field string) *Violation {
	if len(value) > MaxIDBytes {
		return tooLarge(field, fmt.Sprintf("is %d bytes, the limit is %d", len(value), MaxIDBytes))
	}
	return nil
}

// first is v, or then's violation when v is nil.
func first(v *Violation, then func() *Violation) *Violation {
	if v != nil {
		return v
	}
	return then()
}
