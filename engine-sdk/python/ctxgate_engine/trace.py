"""W3C Trace Context (`traceparent`, `proto/src/trace.rs`): an engine method
continues its caller's trace as a child span, and its host callbacks carry
that span as their parent."""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, replace

HEADER = "traceparent"
_FORM = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


@dataclass(frozen=True)
class TraceParent:
    trace_id: bytes
    parent_id: bytes
    flags: int

    @staticmethod
    def parse(value: str | None) -> TraceParent | None:
        """A valid version-00 header with non-zero ids, else None."""
        m = _FORM.fullmatch((value or "").strip())
        if m is None:
            return None
        trace_id, parent_id = bytes.fromhex(m.group(1)), bytes.fromhex(m.group(2))
        if not any(trace_id) or not any(parent_id):
            return None
        return TraceParent(trace_id, parent_id, int(m.group(3), 16))

    def child(self) -> TraceParent:
        """The same trace with a new span id: what this hop sends onwards."""
        return replace(self, parent_id=secrets.token_bytes(8))

    @property
    def sampled(self) -> bool:
        return bool(self.flags & 1)

    def __str__(self) -> str:
        return f"00-{self.trace_id.hex()}-{self.parent_id.hex()}-{self.flags:02x}"
