"""The per-call context an engine method receives (`CallContext`)."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from .errors import Cancelled, DeadlineExceeded
from .trace import TraceParent

if TYPE_CHECKING:
    from .host import HostClient


class CallContext:
    """What the server knows about one call: its deadline (from
    `grpc-timeout`), an event that is set when the caller cancels or the
    deadline passes, the host callback client built from the call's grant
    (when it has one and the host allow-list admits its endpoint), and the
    call's trace.

    The method itself runs as an asyncio task that is cancelled at that
    moment too (it sees `asyncio.CancelledError` at its next `await`); the
    event is for work it handed elsewhere (a thread, another task)."""

    def __init__(self, deadline: float | None = None, host: HostClient | None = None,
                 trace: TraceParent | None = None, span: TraceParent | None = None,
                 peer: str = "") -> None:
        self._deadline = deadline
        self.cancelled = asyncio.Event()
        self._host = host
        self._trace = trace
        self._span = span
        self.peer = peer

    @staticmethod
    def detached() -> CallContext:
        """A context with no deadline, no host and no trace (tests)."""
        return CallContext()

    @property
    def deadline(self) -> float | None:
        """When the caller stops waiting (`time.monotonic()` seconds), if it said."""
        return self._deadline

    def remaining(self) -> float | None:
        """Seconds left before the deadline (None: no deadline)."""
        if self._deadline is None:
            return None
        return max(0.0, self._deadline - time.monotonic())

    def check(self) -> None:
        """Raises Cancelled or DeadlineExceeded once the call has ended: a
        cheap check for loops that do not await."""
        left = self.remaining()
        if left is not None and left <= 0:
            raise DeadlineExceeded()
        if self.cancelled.is_set():
            raise Cancelled()

    @property
    def trace(self) -> TraceParent | None:
        """The caller's trace context as it sent it (`parent_id`: its span)."""
        return self._trace

    @property
    def span(self) -> TraceParent | None:
        """This method's own span: what its callbacks send as the parent."""
        return self._span

    @property
    def host(self) -> HostClient | None:
        """The host callback client, when the call carried a usable grant."""
        return self._host
