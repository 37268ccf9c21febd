"""An engine whose methods misbehave on request, keyed by the session id:
"wait" blocks until cancelled, "raise" raises, "slow" answers after 300 ms,
"read" reads the transcript through the host, "gap" is a history gap. It
records what it saw. Run as a script, it serves with the SDK's command line."""

from __future__ import annotations

import asyncio
import sys
import time

from ctxgate_engine import (
    CallContext,
    CompactOutcome,
    ContextEngine,
    DelegateToHost,
    Done,
    EngineError,
    HistoryGap,
    Progress,
    ServeArgs,
    pb,
    run,
    tool,
    tool_error,
    tool_text,
)


class Probe(ContextEngine):
    def __init__(self) -> None:
        self.seen: list[str] = []
        self.deadlines: list[float | None] = []
        self.started = asyncio.Event()
        self.cancelled_at: float | None = None
        self.ctx_cancelled: bool = False
        self.read: list[str] = []
        self.spans: list[str] = []

    async def get_info(self, ctx: CallContext) -> pb.EngineInfo:
        return pb.EngineInfo(id="probe", name="probe", contract_version="1.0",
                             implemented_methods=["GetInfo", "Ingest", "Assemble", "Compact"])

    async def ingest(self, ctx: CallContext, req: pb.IngestRequest) -> pb.IngestResult:
        self.seen.append(f"Ingest {req.session_id}")
        return pb.IngestResult(ingested=True)

    async def assemble(self, ctx: CallContext, req: pb.AssembleRequest) -> pb.AssembleResult:
        self.seen.append(f"Assemble {req.session_id}")
        self.deadlines.append(ctx.remaining())
        if ctx.span is not None:
            self.spans.append(str(ctx.span))
        sid = req.session_id
        if sid == "wait":
            self.started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled_at = time.monotonic()
                self.ctx_cancelled = ctx.cancelled.is_set()
                raise
        elif sid == "raise":
            raise RuntimeError("engine bug with a secret")
        elif sid == "slow":
            self.started.set()
            await asyncio.sleep(0.3)
        elif sid == "gap":
            raise HistoryGap(held=pb.HistoryCursor(message_id="m7", seq=7, message_count=7, tokens=70))
        elif sid == "read":
            if ctx.host is None:
                self.read.append("no host")
            else:
                try:
                    self.read.append(f"{len(await ctx.host.read_transcript(ctx))} entries")
                except EngineError as e:
                    code, message, _ = e.status()
                    self.read.append(f"{code.name}: {message}")
        return pb.AssembleResult(messages=req.messages, estimated_tokens=1)

    async def compact(self, ctx: CallContext, req: pb.CompactRequest, progress: Progress) -> CompactOutcome:
        await progress.report("one", 1, 2, "half")
        if req.session_id == "raise":
            raise RuntimeError("compaction bug")
        if req.session_id == "delegate":
            return DelegateToHost(pb.DelegateToHost(reason="use yours"))
        return Done(pb.CompactResult(ok=True, compacted=True, tokens_before=10))


class ProbeWithTools(Probe):
    def tools(self) -> list[pb.ToolDefinition]:
        return [tool("echo", "Echoes its arguments.", '{"type":"object"}')]

    async def call_tool(self, ctx: CallContext, req: pb.CallToolRequest) -> pb.CallToolResult:
        return tool_text(req.arguments_json) if req.name == "echo" else tool_error("unknown tool")


class BadTools(Probe):
    def tools(self) -> list[pb.ToolDefinition]:
        return [tool("no spaces allowed", "", "")]


if __name__ == "__main__":
    def make(args: ServeArgs) -> Probe:
        return Probe()

    sys.exit(run(make))
