"""What an engine method can fail with, and the one mapping of each failure to
a gRPC status (`engine-sdk/rust/src/error.rs`). Internal detail is logged,
never sent."""

from __future__ import annotations

import grpc

from .pb import pb


class EngineError(Exception):
    """An engine failure with the status code the contract prescribes."""

    code = grpc.StatusCode.INTERNAL

    def status(self) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str | bytes], ...]]:
        """(code, message, trailing metadata) as the caller sees it."""
        return self.code, str(self), ()


class FailedPrecondition(EngineError):
    """The request is well-formed but the engine's state does not allow it."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class NotFound(EngineError):
    """Something the request names does not exist."""

    code = grpc.StatusCode.NOT_FOUND


class Unimplemented(EngineError):
    """The optional method (or host callback) is not implemented."""

    code = grpc.StatusCode.UNIMPLEMENTED

    def __init__(self, what: str) -> None:
        super().__init__(f"{what} is not implemented")


class Cancelled(EngineError):
    """The call was cancelled by the caller."""

    code = grpc.StatusCode.CANCELLED

    def __init__(self) -> None:
        super().__init__("the call was cancelled")


class DeadlineExceeded(EngineError):
    """The call's deadline passed."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED

    def __init__(self) -> None:
        super().__init__("the call's deadline passed")


class Unavailable(EngineError):
    """A passing failure (a busy store, a full disk): the caller may retry."""

    code = grpc.StatusCode.UNAVAILABLE


class ResourceExhausted(EngineError):
    """A limit was reached (a host callback's read cap, say)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class NotGranted(EngineError):
    """The grant does not allow a host callback."""

    code = grpc.StatusCode.FAILED_PRECONDITION

    def __init__(self, operation: str) -> None:
        super().__init__(f"the grant does not allow {operation}")


class HostError(EngineError):
    """A host callback (ReadTranscript, LlmComplete) failed: UNAVAILABLE,
    unless it was cancelled or ran out of time."""

    def __init__(self, operation: str, code: grpc.StatusCode) -> None:
        super().__init__(f"host callback {operation} failed ({code.name})")
        self.host_code = code
        self.code = code if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED) \
            else grpc.StatusCode.UNAVAILABLE


HISTORY_GAP_TYPE_URL = "type.googleapis.com/contextengine.v1.HistoryGap"
HISTORY_GAP_MESSAGE = "history gap: the engine does not hold the cursor; resend the history"


class HistoryGap(EngineError):
    """A DELTA engine does not hold the request's cursor: FAILED_PRECONDITION
    with the typed HistoryGap detail in `grpc-status-details-bin` (the gateway
    resyncs through IngestBatch, never quarantines). `held` is what the
    engine does hold, when it knows."""

    code = grpc.StatusCode.FAILED_PRECONDITION

    def __init__(self, held: pb.HistoryCursor | None = None, why: str | None = None) -> None:
        super().__init__(f"history gap: {why}; resend the history" if why else HISTORY_GAP_MESSAGE)
        self.held = held

    def status(self) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str | bytes], ...]]:
        message = str(self)
        gap = pb.HistoryGap(held=self.held) if self.held is not None else pb.HistoryGap()
        rich = pb.RpcStatus(code=self.code.value[0], message=message, details=[
            pb.AnyDetail(type_url=HISTORY_GAP_TYPE_URL, value=gap.SerializeToString())])
        return self.code, message, (("grpc-status-details-bin", rich.SerializeToString()),)


def gap_of(code: grpc.StatusCode | None, details_bin: bytes | None) -> pb.HistoryGap | None:
    """The HistoryGap a status carries, if it is one (the message text is
    never looked at)."""
    if code != grpc.StatusCode.FAILED_PRECONDITION or not details_bin:
        return None
    try:
        status = pb.RpcStatus.FromString(details_bin)
        for d in status.details:
            if d.type_url == HISTORY_GAP_TYPE_URL:
                return pb.HistoryGap.FromString(d.value)
    except Exception:  # noqa: BLE001 -- a malformed detail is no gap
        return None
    return None
