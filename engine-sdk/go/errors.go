package enginesdk

import (
	"context"
	"errors"
	"log/slog"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/ctxgate/ctxgate/engine-sdk/go/contract"
	"github.com/ctxgate/ctxgate/engine-sdk/go/pb"
)

// HistoryGap is the error of a DELTA engine that does not hold the
// request's cursor: FAILED_PRECONDITION with the typed HistoryGap detail
// (held: what the engine does hold, nil when it does not know). The
// gateway resends the history with IngestBatch and repeats the call.
func HistoryGap(held *pb.HistoryCursor) error { return contract.GapStatus(held).Err() }

// statusOf is the one mapping of an engine method's error to what the
// caller sees. Internal detail is logged, never sent.
func statusOf(m contract.Method, err error) error {
	if err == nil {
		return nil
	}
	var v *contract.Violation
	switch {
	case errors.As(err, &v):
		return v.GRPCStatus().Err()
	case errors.Is(err, context.DeadlineExceeded):
		return status.Error(codes.DeadlineExceeded, "the call's deadline passed")
	case errors.Is(err, context.Canceled):
		return status.Error(codes.Canceled, "the call was cancelled")
	}
	if s, ok := status.FromError(err); ok {
		return s.Err()
	}
	slog.Error("engine internal error", "method", string(m), "detail", err.Error())
	return status.Error(codes.Internal, "internal engine error")
}

func unimplemented(m contract.Method) error {
	return status.Errorf(codes.Unimplemented, "%s is not implemented", m)
}
