package contract

import (
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/ctxgate/ctxgate/engine-sdk/go/pb"
)

// HistoryGapTypeURL is the Any type URL of pb.HistoryGap in the status
// details (what anypb gives it).
const HistoryGapTypeURL = "type.googleapis.com/contextengine.v1.HistoryGap"

// historyGapMessage is the status message of a gap, as the Rust SDK words it.
const historyGapMessage = "history gap: the engine does not hold the cursor; resend the history"

// GapStatus is DELTA history delivery's typed error: FAILED_PRECONDITION
// whose grpc-status-details-bin is a google.rpc.Status (wire-compatible
// with contextengine.v1.RpcStatus) holding one Any: a HistoryGap saying
// what the engine does hold (nil: it does not know). The gateway resyncs
// through IngestBatch and repeats the call; never a failure.
func GapStatus(held *pb.HistoryCursor) *status.Status {
	s, err := status.New(codes.FailedPrecondition, historyGapMessage).WithDetails(&pb.HistoryGap{Held: held})
	if err != nil {
		// WithDetails fails only for an unmarshalable message; a HistoryGap is not one.
		panic("contract: encoding a HistoryGap: " + err.Error())
	}
	return s
}

// GapOf returns the HistoryGap an error carries, if it is one
// (FAILED_PRECONDITION with the typed detail; the text is never looked at).
func GapOf(err error) (*pb.HistoryGap, bool) {
	s, ok := status.FromError(err)
	if !ok || s.Code() != codes.FailedPrecondition {
		return nil, false
	}
	for _, d := range s.Proto().GetDetails() {
		if d.GetTypeUrl() != HistoryGapTypeURL {
			continue
		}
		gap := &pb.HistoryGap{}
		if err := d.UnmarshalTo(gap); err == nil {
			return gap, true
		}
	}
	return nil, false
}
