"""ctxgate-engine: write a ctxgate context engine in Python.

Subclass `ContextEngine`, implement `get_info`, `ingest`, `assemble` and
`compact` (the rest answer UNIMPLEMENTED until you override them), and hand
it to `run` (an engine's `main`, with the shared command line) or `serve`
(a coroutine). The SDK validates every request before your code runs, gives
each call a `CallContext` (deadline, cancellation, host callbacks, trace),
and serves health, reflection, TLS, per-call limits and a graceful drain."""

from .context import CallContext
from .endpoint import Endpoint
from .engine import CompactOutcome, ContextEngine, DelegateToHost, Done, Progress, tool, tool_error, tool_text
from .estimate import fit_budget
from .errors import (
    Cancelled,
    DeadlineExceeded,
    EngineError,
    FailedPrecondition,
    HistoryGap,
    NotFound,
    NotGranted,
    ResourceExhausted,
    Unavailable,
    Unimplemented,
)
from .host import LLM_COMPLETE, READ_TRANSCRIPT, HostClient, HostEndpoint, HostPolicy
from .pb import host, pb, types
from .server import ServeArgs, Server, ServeError, add_serve_arguments, run, serve
from .validate import Violation

__all__ = [
    "CallContext", "Endpoint", "CompactOutcome", "ContextEngine", "DelegateToHost", "Done", "Progress", "tool",
    "tool_error", "tool_text", "Cancelled", "DeadlineExceeded", "EngineError", "FailedPrecondition", "HistoryGap",
    "NotFound", "NotGranted", "ResourceExhausted", "Unavailable", "Unimplemented", "LLM_COMPLETE",
    "READ_TRANSCRIPT", "HostClient", "HostEndpoint", "HostPolicy", "host", "pb", "types", "ServeArgs", "Server",
    "ServeError", "add_serve_arguments", "run", "serve", "Violation", "fit_budget",
]
