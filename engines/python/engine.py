"""A ctxgate context engine in Python, on the Python engine SDK
(engine-sdk/python, `ctxgate_engine`): the recency engine.

It keeps the newest turns that fit the token budget, plus an extractive
summary of what compaction folded away. Its state -- each session's messages
in arrival order, its summary and its committed turn keys -- is one SQLite
file, STATE_DIR/recency.sqlite (WAL with synchronous=FULL, one transaction per
RPC), so a restart loses nothing and a COMMITTED CommitTurn survives a crash or
a power cut.

History delivery is DELTA: Assemble carries a cursor (what the engine is
assumed to hold) and only the messages after it. The engine assembles from
the messages it holds plus the request's messages it does not hold yet, and
answers the typed history gap when it does not hold the cursor; the gateway
then resends the history with IngestBatch. Without a cursor, the request's
messages are the whole history. Ingest, IngestBatch, AfterTurn and CommitTurn
store what they receive (idempotent by message id); ForgetSession deletes
everything of a session.

It owns its compaction (the gateway calls its Compact and never compacts the
transcript itself), as a DELTA engine should: a host compaction would change
what the engine is assumed to hold and force a resync.

It offers the model one tool, `history_search`: a ranked full-text search
(SQLite FTS5) over every message it holds for the session.

The SDK serves it: health, reflection, request validation, cancellation,
TLS, spans over OTLP and the shared command line.

    engines/python/run.sh --listen 127.0.0.1:0 [--state-dir ./python-engine-state]
"""

import asyncio
import contextlib
import json
import os
import re
import sqlite3
import sys
import threading
import time

from ctxgate_engine import (
    ContextEngine,
    Done,
    EngineError,
    HistoryGap,
    Unavailable,
    pb,
    run,
    tool,
    tool_error,
    tool_text,
    types,
)
from ctxgate_engine.estimate import message_tokens, messages_tokens as tokens, text_tokens
from ctxgate_engine.limits import MAX_MESSAGES

KEEP_TURNS = 2
MAX_SUMMARY_CHARS = 12_000

IMPLEMENTED = ["GetInfo", "Ingest", "IngestBatch", "Assemble", "Compact", "AfterTurn", "CommitTurn",
               "ForgetSession"]

HISTORY_SEARCH = tool(
    "history_search",
    "Searches every message of this conversation the engine holds, compacted ones included, and returns the best "
    "matches first, each with its sequence number, role and a snippet.",
    json.dumps({"type": "object", "properties": {
        "query": {"type": "string", "description": "words to find"},
        "limit": {"type": "integer", "minimum": 1, "maximum": 50, "description": "most hits (default 10)"}},
        "required": ["query"]}))


# --- turns ---------------------------------------------------------------------

def turn_starts(messages):
    starts = [i for i, m in enumerate(messages) if m.role == types.ROLE_USER]
    if messages and (not starts or starts[0] != 0):
        starts.insert(0, 0)
    return starts


def splits_a_pair(tail):
    calls = set()
    for m in tail:
        for p in m.content:
            kind = p.WhichOneof("part")
            if kind == "tool_call":
                calls.add(p.tool_call.id)
            elif kind == "tool_result" and p.tool_result.tool_call_id not in calls:
                return True
    return False


def safe_cut(messages, cut):
    while cut < len(messages) and splits_a_pair(messages[cut:]):
        cut += 1
    return cut


def text_of(m):
    parts = []
    for p in m.content:
        kind = p.WhichOneof("part")
        if kind == "text":
            parts.append(p.text)
        elif kind == "tool_call":
            parts.append(f"called {p.tool_call.name}")
        elif kind == "tool_result":
            parts.append(f"result: {p.tool_result.text}")
    return " ".join(" ".join(parts).split())


def role_name(m):
    return types.Role.Name(m.role)[5:].lower()


# --- state: one SQLite file ----------------------------------------------------

SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    session_id    TEXT PRIMARY KEY,
    created_at_ms INTEGER NOT NULL
);
-- seq is dense, 1..n per session, in arrival order (messages are only ever
-- deleted a whole session at a time), so a session's message count is its
-- MAX(seq). body is the serialized AgentMessage.
CREATE TABLE IF NOT EXISTS messages (
    session_id TEXT NOT NULL,
    seq        INTEGER NOT NULL,
    id         TEXT NOT NULL,
    tokens     INTEGER NOT NULL,
    body       BLOB NOT NULL,
    PRIMARY KEY (session_id, seq),
    UNIQUE (session_id, id)
);
-- Compaction folds a prefix of the session into the summary: the summarised
-- messages are exactly those with seq <= summarised_upto.
CREATE TABLE IF NOT EXISTS summaries (
    session_id      TEXT PRIMARY KEY,
    summary         TEXT NOT NULL,
    summarised_upto INTEGER NOT NULL,
    updated_at_ms   INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS commits (
    session_id      TEXT NOT NULL,
    advancement_key TEXT NOT NULL,
    committed_at_ms INTEGER NOT NULL,
    PRIMARY KEY (session_id, advancement_key)
);
-- history_search: every held message's text, written with the message.
CREATE VIRTUAL TABLE IF NOT EXISTS messages_fts USING fts5(
    text, session_id UNINDEXED, seq UNINDEXED, role UNINDEXED
);
"""


def now_ms():
    return int(time.time() * 1000)


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Store:
    """The engine's state in DIR/recency.sqlite.

    One connection, used only under `self._lock`. SQLite takes one writer at a
    time anyway, so a connection per thread would only move the wait into
    SQLite's busy handler; the one lock also makes every check-then-write
    (CommitTurn's key check, the seq allocation of an ingest) atomic in this
    process, and BEGIN IMMEDIATE keeps it atomic against another process on
    the same file. Every RPC's write is one transaction (`write()`); reads that
    need several queries share one snapshot (`read()`). Nothing slow (the
    summarising of Compact) runs under the lock. Engine methods call it from
    a worker thread (`asyncio.to_thread`), never on the event loop.
    """

    def __init__(self, state_dir):
        os.makedirs(state_dir, exist_ok=True)
        path = os.path.join(state_dir, "recency.sqlite")
        self._lock = threading.Lock()
        # isolation_level=None: no implicit transactions, this class opens them.
        self._db = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
        mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode.lower() != "wal":
            raise RuntimeError(f"{path}: journal_mode is {mode!r}, not WAL")
        # FULL, not WAL's usual NORMAL: every commit syncs the WAL, so a commit
        # that was answered survives a power cut, not only a process crash.
        self._db.execute("PRAGMA synchronous=FULL")
        with self.write() as db:
            version = db.execute("PRAGMA user_version").fetchone()[0]
            for statement in SCHEMA.split(";"):
                if statement.strip():
                    db.execute(statement)
            if version < 2:  # a file from before history_search: index what it holds
                for session_id, seq, body in db.execute("SELECT session_id, seq, body FROM messages").fetchall():
                    index_message(db, session_id, seq, types.AgentMessage.FromString(body))
            db.execute("PRAGMA user_version = 2")
        # SQLite syncs a directory when it creates a journal or WAL file, not
        # when it creates the database file: make the file's entry durable.
        fsync_dir(state_dir)
        fsync_dir(os.path.dirname(os.path.abspath(state_dir)))
        self.path = path

    @contextlib.contextmanager
    def _tx(self, begin):
        with self._lock:
            db = self._db
            db.execute(begin)
            try:
                yield db
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        db.execute("ROLLBACK")
                raise

    def write(self):
        return self._tx("BEGIN IMMEDIATE")

    def read(self):
        return self._tx("BEGIN")

    def close(self):
        with self._lock:
            self._db.close()


def index_message(db, session_id, seq, m):
    db.execute("INSERT INTO messages_fts (text, session_id, seq, role) VALUES (?, ?, ?, ?)",
               (text_of(m), session_id, seq, role_name(m)))


def add_messages(db, session_id, messages):
    """Stores the messages not held yet (by id), in order; returns how many."""
    db.execute("INSERT INTO sessions (session_id, created_at_ms) VALUES (?, ?) ON CONFLICT DO NOTHING",
               (session_id, now_ms()))
    seq = db.execute("SELECT COALESCE(MAX(seq), 0) FROM messages WHERE session_id = ?", (session_id,)).fetchone()[0]
    added = 0
    for m in messages:
        cur = db.execute(
            "INSERT INTO messages (session_id, seq, id, tokens, body) VALUES (?, ?, ?, ?, ?)"
            " ON CONFLICT (session_id, id) DO NOTHING",
            (session_id, seq + 1, m.id, message_tokens(m), m.SerializeToString()))
        if cur.rowcount:
            seq += 1
            added += 1
            index_message(db, session_id, seq, m)
    return added


def summary_of(db, session_id):
    """(summary text, summarised_upto); ("", 0) when nothing was compacted."""
    row = db.execute("SELECT summary, summarised_upto FROM summaries WHERE session_id = ?", (session_id,)).fetchone()
    return (row[0], row[1]) if row else ("", 0)


def messages_after(db, session_id, seq):
    """The held messages with a seq above `seq`, oldest first, as (seq, AgentMessage)."""
    rows = db.execute("SELECT seq, body FROM messages WHERE session_id = ? AND seq > ? ORDER BY seq",
                      (session_id, seq))
    return [(s, types.AgentMessage.FromString(body)) for s, body in rows]


def holds(db, session_id, message_id):
    return db.execute("SELECT 1 FROM messages WHERE session_id = ? AND id = ?",
                      (session_id, message_id)).fetchone() is not None


def held_cursor(db, session_id):
    """What the engine holds of the session, as a HistoryCursor."""
    count, total = db.execute("SELECT COUNT(*), COALESCE(SUM(tokens), 0) FROM messages WHERE session_id = ?",
                              (session_id,)).fetchone()
    last = db.execute("SELECT id, seq FROM messages WHERE session_id = ? ORDER BY seq DESC LIMIT 1",
                      (session_id,)).fetchone()
    if last is None:
        return pb.HistoryCursor()
    return pb.HistoryCursor(message_id=last[0], seq=last[1], message_count=count, tokens=total)


def cursor_gap(db, session_id, cursor):
    """None when the engine holds the cursor, else why not."""
    if not cursor.message_id:
        return None  # the gateway assumes nothing is held
    if not holds(db, session_id, cursor.message_id):
        return f"message {cursor.message_id!r} is not held"
    count = db.execute("SELECT COALESCE(MAX(seq), 0) FROM messages WHERE session_id = ?",
                       (session_id,)).fetchone()[0]  # seq is dense: the count
    if count < cursor.message_count:
        return f"{count} messages are held, the cursor counts {cursor.message_count}"
    return None


def search(db, session_id, query, limit):
    """The best `limit` matches of `query`'s words, as (seq, role, snippet)."""
    words = re.findall(r"\w+", query)
    match = " OR ".join(f'"{w}"' for w in words)
    return db.execute(
        "SELECT seq, role, snippet(messages_fts, 0, '[', ']', '…', 16) FROM messages_fts"
        " WHERE messages_fts MATCH ? AND session_id = ? ORDER BY rank LIMIT ?", (match, session_id, limit)).fetchall()


def search_arguments(arguments_json):
    """(query, limit) from a tool call's arguments, or why they cannot be used."""
    try:
        args = json.loads(arguments_json)
    except ValueError:
        return "the arguments are not JSON; expected {\"query\": string, \"limit\"?: integer}"
    if not isinstance(args, dict):
        return "the arguments are not a JSON object; expected {\"query\": string, \"limit\"?: integer}"
    query, limit = args.get("query"), args.get("limit", 10)
    if not isinstance(query, str) or not re.search(r"\w", query):
        return "\"query\" must be a string with at least one word to search for"
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 50:
        return "\"limit\" must be an integer from 1 to 50"
    return query, limit


# --- the engine ----------------------------------------------------------------

class RecencyEngine(ContextEngine):
    def __init__(self, store):
        self._store = store

    # Every store access runs in a worker thread; busy, locked, I/O or disk
    # full may pass: UNAVAILABLE (a CommitTurn stays queued and is retried).
    # Anything else is a bug: INTERNAL.
    async def _db(self, fn, *args):
        try:
            return await asyncio.to_thread(fn, *args)
        except sqlite3.OperationalError as e:
            raise Unavailable(f"state store: {e}") from None
        except sqlite3.Error as e:
            raise EngineError(f"state store: {e}") from None

    def _ingest(self, session_id, messages):
        with self._store.write() as db:
            return add_messages(db, session_id, messages)

    async def get_info(self, ctx):
        return pb.EngineInfo(
            id="py-recency", name="Python recency engine", version="0.3.0",
            contract_version="1.0", owns_compaction=True,
            turn_maintenance_mode=pb.TURN_MAINTENANCE_MODE_FOREGROUND,
            implemented_methods=IMPLEMENTED,
            history_delivery=pb.HISTORY_DELIVERY_DELTA,
            # Each replica keeps its own sessions: a session's calls go to one.
            replica_affinity=pb.REPLICA_AFFINITY_SESSION)

    async def ingest(self, ctx, req):
        return pb.IngestResult(ingested=await self._db(self._ingest, req.session_id, [req.message]) > 0)

    async def ingest_batch(self, ctx, req):
        return pb.IngestBatchResult(ingested_count=await self._db(self._ingest, req.session_id, req.messages))

    async def after_turn(self, ctx, req):
        await self._db(self._ingest, req.session_id, req.messages)
        return pb.AfterTurnResult()

    def _commit(self, req):
        # One transaction: the key check, the messages and the key. It is
        # synced (synchronous=FULL) before COMMITTED is answered.
        with self._store.write() as db:
            if db.execute("SELECT 1 FROM commits WHERE session_id = ? AND advancement_key = ?",
                          (req.session_id, req.advancement_key)).fetchone():
                return pb.CommitTurnResult(status=pb.COMMIT_STATUS_DUPLICATE)
            add_messages(db, req.session_id, req.messages)
            db.execute("INSERT INTO commits (session_id, advancement_key, committed_at_ms) VALUES (?, ?, ?)",
                       (req.session_id, req.advancement_key, now_ms()))
        return pb.CommitTurnResult(status=pb.COMMIT_STATUS_COMMITTED)

    async def commit_turn(self, ctx, req):
        return await self._db(self._commit, req)

    def _forget(self, session_id):
        # The session was deleted: its messages, summary, commit keys and index go.
        with self._store.write() as db:
            for table in ("messages", "summaries", "commits", "sessions", "messages_fts"):
                db.execute(f"DELETE FROM {table} WHERE session_id = ?", (session_id,))

    async def forget_session(self, ctx, req):
        await self._db(self._forget, req.session_id)
        return pb.ForgetSessionResult()

    def _history(self, req):
        """(summary, the tail to assemble); a HistoryGap when the cursor is not held."""
        sid = req.session_id
        with self._store.read() as db:
            summary, upto = summary_of(db, sid)
            if not req.HasField("cursor"):
                # FULL: the request's messages are the whole history.
                summarised = set()
                if upto:
                    summarised = {i for (i,) in db.execute(
                        "SELECT id FROM messages WHERE session_id = ? AND seq <= ?", (sid, upto))}
                return summary, [m for m in req.messages if m.id not in summarised]
            # DELTA: what is held (past the summary), then what is new.
            why = cursor_gap(db, sid, req.cursor)
            if why is not None:
                raise HistoryGap(held=held_cursor(db, sid), why=why)
            tail = [m for _, m in messages_after(db, sid, upto)]
            return summary, tail + [m for m in req.messages if not holds(db, sid, m.id)]

    async def assemble(self, ctx, req):
        sid = req.session_id
        summary, tail = await self._db(self._history, req)
        tail = tail[safe_cut(tail, 0):]
        head = []
        if summary:
            head = [types.AgentMessage(id=f"py-summary:{sid}", role=types.ROLE_USER,
                                       content=[types.ContentPart(text=summary)])]
        if req.HasField("token_budget"):
            while tokens(head) + tokens(tail) > req.token_budget:
                starts = turn_starts(tail)
                if len(starts) < 2:
                    break
                cut = safe_cut(tail, starts[1])
                if cut >= len(tail):
                    break
                tail = tail[cut:]
        room = MAX_MESSAGES - len(head)  # held history can outgrow one result
        if len(tail) > room:
            tail = tail[safe_cut(tail, len(tail) - room):]
        out = head + tail
        return pb.AssembleResult(messages=out, estimated_tokens=tokens(out),
                                 prompt_authority=pb.PROMPT_AUTHORITY_ASSEMBLED)

    def _pending(self, sid):
        with self._store.read() as db:
            summary, upto = summary_of(db, sid)
            return summary, upto, messages_after(db, sid, upto)

    def _write_summary(self, sid, upto, last_seq, last_id, new_summary):
        with self._store.write() as db:
            # Write only onto the state the summary was made from: not after a
            # concurrent compaction or a ForgetSession.
            now = db.execute("SELECT id FROM messages WHERE session_id = ? AND seq = ?", (sid, last_seq)).fetchone()
            unchanged = summary_of(db, sid)[1] == upto and now is not None and now[0] == last_id
            if unchanged:
                db.execute(
                    "INSERT INTO summaries (session_id, summary, summarised_upto, updated_at_ms) VALUES (?, ?, ?, ?)"
                    " ON CONFLICT (session_id) DO UPDATE SET summary = excluded.summary,"
                    " summarised_upto = excluded.summarised_upto, updated_at_ms = excluded.updated_at_ms",
                    (sid, new_summary, last_seq, now_ms()))
            return unchanged

    async def compact(self, ctx, req, progress):
        # A cancelled call (or one past its deadline) stops at its next await
        # and changes nothing: the summary is written in one last step.
        sid = req.session_id
        summary, upto, rows = await self._db(self._pending, sid)
        pending = [m for _, m in rows]
        before = text_tokens(summary) + tokens(pending)
        starts = turn_starts(pending)
        cut = safe_cut(pending, starts[-KEEP_TURNS] if len(starts) >= KEEP_TURNS else 0)
        if cut == 0:
            return Done(pb.CompactResult(ok=True, compacted=False, tokens_before=before,
                                         reason="nothing older than the kept turns"))
        older = pending[:cut]
        lines = summary.splitlines() if summary else ["Summary of the earlier conversation (python recency engine)"]
        step = 20
        total = (len(older) + step - 1) // step
        for n in range(total):
            await progress.report("summarising", n, total, f"messages {n * step}..{(n + 1) * step}")
            for m in older[n * step:(n + 1) * step]:
                snippet = text_of(m)[:200]
                if snippet:
                    lines.append(f"- {role_name(m)}: {snippet}")
        new_summary = "\n".join(lines)
        while len(new_summary) > MAX_SUMMARY_CHARS and len(lines) > 2:
            del lines[1]
            new_summary = "\n".join(lines)
        ctx.check()
        if not await self._db(self._write_summary, sid, upto, rows[cut - 1][0], older[-1].id, new_summary):
            return Done(pb.CompactResult(
                ok=False, compacted=False, tokens_before=before,
                reason="the session changed during compaction (compacted again or forgotten); nothing written"))
        after = text_tokens(new_summary) + tokens(pending[cut:])
        return Done(pb.CompactResult(
            ok=True, compacted=True, summary=new_summary, first_kept_entry_id=pending[cut].id if cut < len(pending) else None,
            tokens_before=before, tokens_after=after))

    def tools(self):
        return [HISTORY_SEARCH]

    def _search(self, sid, query, limit):
        with self._store.read() as db:
            return search(db, sid, query, limit)

    async def call_tool(self, ctx, req):
        if req.name != HISTORY_SEARCH.name:
            return tool_error(f"unknown tool {req.name!r}; this engine offers {HISTORY_SEARCH.name}")
        args = search_arguments(req.arguments_json)
        if isinstance(args, str):
            return tool_error(args)
        hits = await self._db(self._search, req.session_id, *args)
        if not hits:
            return tool_text(f"no message of this conversation matches {args[0]!r}")
        return tool_text("\n".join(f"seq {seq} ({role}): {snippet}" for seq, role, snippet in hits))


def main():
    sys.exit(run(lambda args: RecencyEngine(Store(args.state_dir)), description=__doc__.splitlines()[0],
                 state_dir="./python-engine-state", service_name="ctxgate-engine-python"))


if __name__ == "__main__":
    main()
