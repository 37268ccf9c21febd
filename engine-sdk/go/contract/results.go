package contract

import (
	"fmt"
	"strings"
	"unicode"

	"github.com/ctxgate/ctxgate/engine-sdk/go/pb"
)

// CheckInfo checks an engine's GetInfo reply (proto/src/validate.rs,
// result::info): nil when acceptable, else a *Violation under "info.".
func CheckInfo(i *pb.EngineInfo) error { return errOf(checkInfo(i)) }

func checkInfo(i *pb.EngineInfo) *Violation {
	if strings.TrimSpace(i.GetId()) == "" {
		return invalid("info.id", "is blank")
	}
	if strings.TrimSpace(i.GetName()) == "" {
		return invalid("info.name", "is blank")
	}
	// They become log fields, metric labels and an audit caller.
	for _, f := range [...]struct{ field, v string }{
		{"info.id", i.GetId()}, {"info.name", i.GetName()}, {"info.version", i.GetVersion()},
	} {
		if len(f.v) > MaxIDBytes {
			return tooLarge(f.field, fmt.Sprintf("is %d bytes, the limit is %d", len(f.v), MaxIDBytes))
		}
		// unicode.IsControl is category Cc, as Rust's char::is_control.
		if strings.IndexFunc(f.v, unicode.IsControl) >= 0 {
			return invalid(f.field, "contains a control character")
		}
	}
	if major, _, _ := strings.Cut(i.GetContractVersion(), "."); major != "1" {
		return invalid("info.contract_version", fmt.Sprintf("is %q, this side speaks 1.x", i.GetContractVersion()))
	}
	for _, m := range AllMethods {
		if m.Required() && !m.ListedIn(i.GetImplementedMethods()) {
			return invalid("info.implemented_methods", fmt.Sprintf("lacks required method %s", m))
		}
	}
	seen := map[Method]bool{}
	for _, name := range i.GetImplementedMethods() {
		m := Method(name)
		if !m.Known() {
			return invalid("info.implemented_methods", fmt.Sprintf("names unknown method %q", name))
		}
		if seen[m] {
			return invalid("info.implemented_methods", fmt.Sprintf("lists %s twice", m))
		}
		seen[m] = true
	}
	if i.GetTranscriptSemantics().GetTurnAdvancementIdempotency() != 0 && !seen[CommitTurn] {
		return invalid("info.transcript_semantics.turn_advancement_idempotency",
			"is declared but CommitTurn is not implemented")
	}
	if len(i.GetTools()) > 0 && !seen[CallTool] {
		return invalid("info.tools", "are declared but CallTool is not implemented")
	}
	if v := CheckTools(i.GetTools(), "info.tools"); v != nil {
		return v
	}
	// A DELTA engine is resynced through IngestBatch after a gap.
	if i.GetHistoryDelivery() == pb.HistoryDelivery_HISTORY_DELIVERY_DELTA && !seen[IngestBatch] {
		return invalid("info.history_delivery",
			"is DELTA but IngestBatch (the resync after a history gap) is not implemented")
	}
	return nil
}

// CheckAssembleResult checks an Assemble reply for a request of
// requestMessages messages: messages present when there was history,
// well-formed, and no tool result split from its call.
func CheckAssembleResult(r *pb.AssembleResult, requestMessages int) error {
	if len(r.GetMessages()) == 0 && requestMessages > 0 {
		return invalid("messages", "is empty although the request had history")
	}
	if v := CheckMessages(r.GetMessages(), "messages"); v != nil {
		return v
	}
	if v := CheckToolPairs(r.GetMessages(), "messages"); v != nil {
		return v
	}
	if p := r.GetProjection(); p != nil && p.GetMode() == pb.ProjectionMode_PROJECTION_MODE_THREAD_BOOTSTRAP &&
		strings.TrimSpace(p.GetEpoch()) == "" {
		return invalid("projection.epoch", "is required for thread_bootstrap")
	}
	return nil
}

// CheckCommitTurnResult checks a CommitTurn reply: COMMITTED or DUPLICATE.
func CheckCommitTurnResult(r *pb.CommitTurnResult) error {
	switch r.GetStatus() {
	case pb.CommitStatus_COMMIT_STATUS_COMMITTED, pb.CommitStatus_COMMIT_STATUS_DUPLICATE:
		return nil
	}
	return invalid("status", fmt.Sprintf("invalid commitTurn result status: %d", int32(r.GetStatus())))
}

// CheckCallToolResult checks a tool's result: text parts only (what the
// model is shown). Its size is not refused: the gateway cuts and says so.
func CheckCallToolResult(r *pb.CallToolResult) error {
	for i, p := range r.GetContent() {
		if _, text := p.GetPart().(*pb.ContentPart_Text); !text {
			return invalid(fmt.Sprintf("content[%d]", i), "a tool's result carries text parts only")
		}
	}
	return nil
}

// CheckMaintainResult checks a Maintain reply's replacements.
func CheckMaintainResult(r *pb.MaintainResult) error {
	for i, rep := range r.GetReplacements() {
		at := fmt.Sprintf("replacements[%d]", i)
		m := rep.GetMessage()
		if m == nil {
			return invalid(at+".message", "is required")
		}
		if v := CheckMessage(m, at+".message"); v != nil {
			return v
		}
		if m.GetId() != rep.GetEntryId() {
			return invalid(at+".message.id", "must equal entry_id")
		}
	}
	return nil
}

// errOf turns a *Violation into an error without the typed-nil trap.
func errOf(v *Violation) error {
	if v == nil {
		return nil
	}
	return v
}
