"""The class an engine subclasses, and helpers for its answers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any
from dataclasses import dataclass

from .context import CallContext
from .errors import Cancelled, Unimplemented
from .pb import pb, types


@dataclass(frozen=True)
class Done:
    """Compact's outcome: the engine compacted (or decided not to)."""

    result: pb.CompactResult


@dataclass(frozen=True)
class DelegateToHost:
    """Compact's outcome: the gateway should run its built-in compaction."""

    delegate: pb.DelegateToHost


CompactOutcome = Done | DelegateToHost


class Progress:
    """Sends `CompactProgress` events to the caller while Compact runs. Waits
    while the caller is slow to read (the stream is bounded)."""

    def __init__(self, queue: asyncio.Queue[pb.CompactEvent], ctx: CallContext) -> None:
        self._queue = queue
        self._ctx = ctx

    async def report(self, stage: str, done: int, total: int, message: str = "") -> None:
        if self._ctx.cancelled.is_set():
            raise Cancelled()
        await self._queue.put(pb.CompactEvent(progress=pb.CompactProgress(
            stage=stage, done=done, total=total, message=message)))


class ContextEngine:
    """A context engine. `get_info`, `ingest`, `assemble` and `compact` are
    required; every other method answers UNIMPLEMENTED unless overridden,
    which the gateway reads as "not implemented". List what you implement in
    `EngineInfo.implemented_methods` (CallTool is added for you when `tools()`
    declares any).

    Requests reach these methods already validated against the contract.
    Each call runs as its own asyncio task: when the caller cancels or the
    deadline passes the task is cancelled (`asyncio.CancelledError` at its
    next await) and `ctx.cancelled` is set. An exception other than an
    `EngineError` is INTERNAL for that call only ("<Method> failed inside
    the engine"), logged, never sent. Blocking work (a database) belongs in
    `asyncio.to_thread`, so other calls and cancellations are not held up."""

    async def get_info(self, ctx: CallContext) -> pb.EngineInfo:
        raise NotImplementedError

    async def ingest(self, ctx: CallContext, req: pb.IngestRequest) -> pb.IngestResult:
        raise NotImplementedError

    async def assemble(self, ctx: CallContext, req: pb.AssembleRequest) -> pb.AssembleResult:
        raise NotImplementedError

    async def compact(self, ctx: CallContext, req: pb.CompactRequest, progress: Progress) -> CompactOutcome:
        raise NotImplementedError

    async def bootstrap(self, ctx: CallContext, req: pb.BootstrapRequest) -> pb.BootstrapResult:
        raise Unimplemented("Bootstrap")

    async def ingest_batch(self, ctx: CallContext, req: pb.IngestBatchRequest) -> pb.IngestBatchResult:
        raise Unimplemented("IngestBatch")

    async def after_turn(self, ctx: CallContext, req: pb.AfterTurnRequest) -> pb.AfterTurnResult:
        raise Unimplemented("AfterTurn")

    async def commit_turn(self, ctx: CallContext, req: pb.CommitTurnRequest) -> pb.CommitTurnResult:
        raise Unimplemented("CommitTurn")

    async def maintain(self, ctx: CallContext, req: pb.MaintainRequest) -> pb.MaintainResult:
        raise Unimplemented("Maintain")

    async def prepare_subagent_spawn(self, ctx: CallContext,
                                     req: pb.PrepareSubagentSpawnRequest) -> pb.PrepareSubagentSpawnResult:
        raise Unimplemented("PrepareSubagentSpawn")

    async def rollback_subagent_spawn(self, ctx: CallContext,
                                      req: pb.RollbackSubagentSpawnRequest) -> pb.RollbackSubagentSpawnResult:
        raise Unimplemented("RollbackSubagentSpawn")

    async def on_subagent_ended(self, ctx: CallContext, req: pb.OnSubagentEndedRequest) -> pb.OnSubagentEndedResult:
        raise Unimplemented("OnSubagentEnded")

    async def dispose(self, ctx: CallContext) -> pb.DisposeResult:
        raise Unimplemented("Dispose")

    async def forget_session(self, ctx: CallContext, req: pb.ForgetSessionRequest) -> pb.ForgetSessionResult:
        """The session was deleted: drop everything held for it before
        answering. Idempotent (an unknown session is OK)."""
        raise Unimplemented("ForgetSession")

    def tools(self) -> list[pb.ToolDefinition]:
        """The tools the engine offers the model; joined to GetInfo's `tools`
        (with CallTool in its implemented methods) when `get_info` declares
        none itself."""
        return []

    async def call_tool(self, ctx: CallContext, req: pb.CallToolRequest) -> pb.CallToolResult:
        """Runs one of `tools()`. A tool that cannot help -- unknown, bad
        arguments, nothing found -- answers `tool_error(...)`, which the model
        reads; it never raises for that."""
        raise Unimplemented("CallTool")


def tool(name: str, description: str, parameters_json_schema: str | Mapping[str, Any],
         audience: pb.ToolAudience = pb.TOOL_AUDIENCE_MAIN) -> pb.ToolDefinition:
    """A tool declaration: its name, what it does, its arguments' JSON Schema
    (a dict, or its JSON text)."""
    if isinstance(parameters_json_schema, Mapping):
        parameters_json_schema = json.dumps(parameters_json_schema)
    elif not isinstance(parameters_json_schema, str):
        raise TypeError(f"tool {name!r}: parameters_json_schema is a dict or its JSON text, "
                        f"not {type(parameters_json_schema).__name__}")
    return pb.ToolDefinition(name=name, description=description, parameters_json_schema=parameters_json_schema,
                             audience=audience)


def tool_text(text: str) -> pb.CallToolResult:
    """A tool's result: `text` for the model."""
    return pb.CallToolResult(content=[types.ContentPart(text=text)], is_error=False)


def tool_error(text: str) -> pb.CallToolResult:
    """A tool's failure, for the model: why it could not help."""
    return pb.CallToolResult(content=[types.ContentPart(text=text)], is_error=True)
