"""The SDK's example engine: small, but real. It keeps each session's
messages in SQLite under `--state-dir` (so a restart loses nothing), takes
history as DELTA (Assemble carries a cursor and only what follows it; a
cursor it does not hold is the typed history gap, and the gateway resends
with IngestBatch), assembles the newest whole turns that fit the budget, and
offers the model one tool, `find_messages`.

    engine-sdk/python/run.sh --listen 127.0.0.1:0 --state-dir ./example-state
    ctxgate-engine-example --listen 127.0.0.1:0     (installed with pip)
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import sys
import threading

from ctxgate_engine import (
    CallContext,
    CompactOutcome,
    ContextEngine,
    Done,
    HistoryGap,
    Progress,
    ServeArgs,
    pb,
    run,
    tool,
    tool_error,
    tool_text,
    types,
)
from ctxgate_engine.estimate import message_tokens, messages_tokens

FIND = tool("find_messages", "Finds the messages of this conversation that contain a text, oldest first.",
            '{"type":"object","properties":{"text":{"type":"string"}},"required":["text"]}')


class Messages:
    """Each session's messages in arrival order, in DIR/example.sqlite."""

    def __init__(self, state_dir: str) -> None:
        os.makedirs(state_dir, exist_ok=True)
        self._db = sqlite3.connect(os.path.join(state_dir, "example.sqlite"), isolation_level=None,
                                   check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS messages (session_id TEXT, seq INTEGER, id TEXT, body BLOB,"
                         " text TEXT, PRIMARY KEY (session_id, seq), UNIQUE (session_id, id))")
        self._lock = threading.Lock()

    def add(self, session_id: str, messages: list[types.AgentMessage]) -> int:
        with self._lock, self._db:
            self._db.execute("BEGIN IMMEDIATE")
            seq = self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM messages WHERE session_id = ?",
                                   (session_id,)).fetchone()[0]
            added = 0
            for m in messages:
                text = " ".join(p.text or p.tool_result.text for p in m.content)
                cur = self._db.execute("INSERT OR IGNORE INTO messages VALUES (?, ?, ?, ?, ?)",
                                       (session_id, seq + 1, m.id, m.SerializeToString(), text))
                seq, added = seq + cur.rowcount, added + cur.rowcount
            return added

    def held(self, session_id: str) -> list[types.AgentMessage]:
        with self._lock:
            rows = self._db.execute("SELECT body FROM messages WHERE session_id = ? ORDER BY seq", (session_id,))
            return [types.AgentMessage.FromString(body) for (body,) in rows]

    def find(self, session_id: str, text: str) -> list[tuple[int, str]]:
        with self._lock:
            rows = self._db.execute("SELECT seq, text FROM messages WHERE session_id = ? AND instr(text, ?) > 0"
                                    " ORDER BY seq LIMIT 20", (session_id, text))
            return [(seq, t) for seq, t in rows]

    def forget(self, session_id: str) -> None:
        with self._lock, self._db:
            self._db.execute("DELETE FROM messages WHERE session_id = ?", (session_id,))


def cursor_of(held: list[types.AgentMessage]) -> pb.HistoryCursor:
    if not held:
        return pb.HistoryCursor()
    n = len(held)
    return pb.HistoryCursor(message_id=held[-1].id, seq=n, message_count=n, tokens=messages_tokens(held))


def newest_turns(messages: list[types.AgentMessage], budget: int | None) -> tuple[list[types.AgentMessage], int]:
    """The newest whole turns (from a user message on) within `budget`, and
    their tokens; a turn is never split, so no tool result loses its call."""
    tokens = [message_tokens(m) for m in messages]
    start = 0
    if budget is not None:
        starts = [i for i, m in enumerate(messages) if m.role == types.ROLE_USER] or [0]
        start, total = starts[-1], sum(tokens[starts[-1]:])
        for s, e in zip(reversed(starts[:-1]), reversed(starts[1:])):
            total += sum(tokens[s:e])
            if total > budget:
                break
            start = s
    return messages[start:], sum(tokens[start:])


class ExampleEngine(ContextEngine):
    def __init__(self, state_dir: str) -> None:
        self.store = Messages(state_dir)

    async def get_info(self, ctx: CallContext) -> pb.EngineInfo:
        return pb.EngineInfo(
            id="py-example", name="Python SDK example engine", version="0.1.0", contract_version="1.0",
            history_delivery=pb.HISTORY_DELIVERY_DELTA, replica_affinity=pb.REPLICA_AFFINITY_SESSION,
            implemented_methods=["GetInfo", "Ingest", "IngestBatch", "Assemble", "Compact", "ForgetSession"])

    async def ingest(self, ctx: CallContext, req: pb.IngestRequest) -> pb.IngestResult:
        added = await asyncio.to_thread(self.store.add, req.session_id, [req.message])
        return pb.IngestResult(ingested=added > 0)

    async def ingest_batch(self, ctx: CallContext, req: pb.IngestBatchRequest) -> pb.IngestBatchResult:
        added = await asyncio.to_thread(self.store.add, req.session_id, list(req.messages))
        return pb.IngestBatchResult(ingested_count=added)

    async def assemble(self, ctx: CallContext, req: pb.AssembleRequest) -> pb.AssembleResult:
        messages = list(req.messages)  # FULL: the request is the whole history
        if req.HasField("cursor"):  # DELTA: what is held, then what is new
            held = await asyncio.to_thread(self.store.held, req.session_id)
            ids = {m.id for m in held}
            if req.cursor.message_id and (req.cursor.message_id not in ids
                                          or len(held) < req.cursor.message_count):
                raise HistoryGap(held=cursor_of(held))
            messages = held + [m for m in messages if m.id not in ids]
        out, tokens = newest_turns(messages, req.token_budget if req.HasField("token_budget") else None)
        return pb.AssembleResult(messages=out, estimated_tokens=tokens)

    async def compact(self, ctx: CallContext, req: pb.CompactRequest, progress: Progress) -> CompactOutcome:
        await progress.report("checking", 1, 1)
        return Done(pb.CompactResult(ok=True, compacted=False, reason="this engine trims at Assemble instead"))

    async def forget_session(self, ctx: CallContext, req: pb.ForgetSessionRequest) -> pb.ForgetSessionResult:
        await asyncio.to_thread(self.store.forget, req.session_id)
        return pb.ForgetSessionResult()

    def tools(self) -> list[pb.ToolDefinition]:
        return [FIND]

    async def call_tool(self, ctx: CallContext, req: pb.CallToolRequest) -> pb.CallToolResult:
        if req.name != FIND.name:
            return tool_error(f"unknown tool {req.name!r}")
        try:
            args = json.loads(req.arguments_json)
        except ValueError:
            return tool_error("the arguments are not JSON")
        text = args.get("text") if isinstance(args, dict) else None
        if not isinstance(text, str) or not text:
            return tool_error('expected {"text": "what to find"}')
        found = await asyncio.to_thread(self.store.find, req.session_id, text)
        return tool_text("\n".join(f"#{seq}: {t[:200]}" for seq, t in found) or f"no message contains {text!r}")


def main() -> None:
    def make(args: ServeArgs) -> ExampleEngine:
        return ExampleEngine(args.state_dir or "./example-state")

    sys.exit(run(make, description="The ctxgate Python SDK's example engine", service_name="ctxgate-engine-example"))


if __name__ == "__main__":
    main()
