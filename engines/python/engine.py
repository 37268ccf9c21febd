"""A ctxgate context engine in Python (grpcio): the recency engine.

It keeps the newest turns that fit the token budget, plus an extractive
summary of what compaction folded away. Its state -- each session's messages
in arrival order, its summary and its committed turn keys -- is one SQLite
file, STATE_DIR/recency.sqlite (WAL with synchronous=FULL, one transaction per
RPC), so a restart loses nothing and a COMMITTED CommitTurn survives a crash or
a power cut.

History delivery is DELTA: Assemble carries a cursor (what the engine is
assumed to hold) and only the messages after it. The engine assembles from
the messages it holds plus the request's messages it does not hold yet, and
answers FAILED_PRECONDITION with a HistoryGap detail (grpc-status-details-bin)
when it does not hold the cursor; the gateway then resends the history with
IngestBatch. Without a cursor, the request's messages are the whole history.
Ingest, IngestBatch, AfterTurn and CommitTurn store what they receive
(idempotent by message id); ForgetSession deletes everything of a session.

It owns its compaction (the gateway calls its Compact and never compacts the
transcript itself), as a DELTA engine should: a host compaction would change
what the engine is assumed to hold and force a resync.

It serves grpc.health.v1 and reflection like every ctxgate engine, validates
every request against the contract, and stops work when a call is cancelled.

    engines/python/run.sh --listen 127.0.0.1:0 [--state-dir ./python-engine-state]
"""

import argparse
import collections
import contextlib
import os
import signal
import sqlite3
import sys
import threading
import time
from concurrent import futures

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gen"))

import grpc  # noqa: E402
from grpc_health.v1 import health, health_pb2, health_pb2_grpc  # noqa: E402
from grpc_reflection.v1alpha import reflection, reflection_pb2  # noqa: E402

from contextengine.v1 import engine_pb2 as pb  # noqa: E402
from contextengine.v1 import engine_pb2_grpc as pb_grpc  # noqa: E402
from contextengine.v1 import types_pb2 as types  # noqa: E402

SERVICE = "contextengine.v1.ContextEngine"
CONTRACT_VERSION = "1.0"
# Contract limits (docs/contract.md).
MAX_GRPC_MESSAGE_BYTES = 16 * 1024 * 1024
MAX_MESSAGE_CONTENT_BYTES = 1024 * 1024
MAX_METADATA_ENTRIES = 64
MAX_METADATA_KEY_BYTES = 256
MAX_METADATA_VALUE_BYTES = 16 * 1024
MAX_ID_BYTES = 256
MAX_MESSAGES = 20_000
KEEP_TURNS = 2
MAX_SUMMARY_CHARS = 12_000

IMPLEMENTED = ["GetInfo", "Ingest", "IngestBatch", "Assemble", "Compact", "AfterTurn", "CommitTurn",
               "ForgetSession"]


class Invalid(Exception):
    """A request field breaks the contract."""

    def __init__(self, field, problem, code=grpc.StatusCode.INVALID_ARGUMENT):
        super().__init__(f"{field}: {problem}")
        self.code = code


# --- validation (the same rules as ctxgate_proto::validate) -----------------

def check_id(value, field):
    if not value.strip():
        raise Invalid(field, "is required")
    if len(value.encode()) > MAX_ID_BYTES:
        raise Invalid(field, f"is over {MAX_ID_BYTES} bytes", grpc.StatusCode.RESOURCE_EXHAUSTED)


def content_bytes(m):
    total = 0
    for p in m.content:
        kind = p.WhichOneof("part")
        if kind == "text":
            total += len(p.text.encode())
        elif kind == "thinking":
            total += len(p.thinking.text.encode()) + len(p.thinking.signature.encode())
        elif kind == "image":
            total += len(p.image.uri.encode()) + len(p.image.mime_type.encode())
        elif kind == "tool_call":
            c = p.tool_call
            total += len(c.id.encode()) + len(c.name.encode()) + len(c.arguments_json.encode())
        elif kind == "tool_result":
            r = p.tool_result
            total += len(r.tool_call_id.encode()) + len(r.tool_name.encode()) + len(r.text.encode())
    return total


def check_message(m, field):
    check_id(m.id, f"{field}.id")
    if m.role == types.ROLE_UNSPECIFIED:
        raise Invalid(f"{field}.role", "is required")
    if m.role not in types.Role.values():
        raise Invalid(f"{field}.role", f"unknown role {m.role}")
    for i, p in enumerate(m.content):
        at = f"{field}.content[{i}]"
        kind = p.WhichOneof("part")
        if kind is None:
            raise Invalid(at, "has no part set")
        if kind == "tool_call":
            check_id(p.tool_call.id, f"{at}.tool_call.id")
            if not p.tool_call.name.strip():
                raise Invalid(f"{at}.tool_call.name", "is required")
        if kind == "tool_result":
            check_id(p.tool_result.tool_call_id, f"{at}.tool_result.tool_call_id")
    if len(m.metadata) > MAX_METADATA_ENTRIES:
        raise Invalid(f"{field}.metadata", f"has {len(m.metadata)} entries, the limit is {MAX_METADATA_ENTRIES}",
                      grpc.StatusCode.RESOURCE_EXHAUSTED)
    for k, v in m.metadata.items():
        if len(k.encode()) > MAX_METADATA_KEY_BYTES or len(v.encode()) > MAX_METADATA_VALUE_BYTES:
            raise Invalid(f"{field}.metadata", f"[{k[:64]}] is over the key ({MAX_METADATA_KEY_BYTES}) or value "
                          f"({MAX_METADATA_VALUE_BYTES}) byte limit", grpc.StatusCode.RESOURCE_EXHAUSTED)
    size = content_bytes(m)
    if size > MAX_MESSAGE_CONTENT_BYTES:
        raise Invalid(f"{field}.content", f"is {size} bytes, the limit is {MAX_MESSAGE_CONTENT_BYTES}",
                      grpc.StatusCode.RESOURCE_EXHAUSTED)


def check_messages(messages, field):
    if len(messages) > MAX_MESSAGES:
        raise Invalid(field, f"has {len(messages)} messages", grpc.StatusCode.RESOURCE_EXHAUSTED)
    seen = set()
    for i, m in enumerate(messages):
        check_message(m, f"{field}[{i}]")
        if m.id in seen:
            raise Invalid(f"{field}[{i}].id", f"duplicates message id {m.id!r}")
        seen.add(m.id)


# --- tokens and turns ---------------------------------------------------------

def _is_cjk(ch):
    o = ord(ch)
    return (0x3040 <= o <= 0x30FF or 0x3400 <= o <= 0x4DBF or 0x4E00 <= o <= 0x9FFF
            or 0xAC00 <= o <= 0xD7AF or 0xF900 <= o <= 0xFAFF or 0x20000 <= o <= 0x2FA1F)


def text_tokens(text):
    cjk = sum(1 for ch in text if _is_cjk(ch))
    other = len(text) - cjk
    return (other + 3) // 4 + cjk


def message_tokens(m):
    if m.HasField("usage") and m.usage.HasField("output_tokens"):
        return m.usage.output_tokens
    total = 0
    for p in m.content:
        kind = p.WhichOneof("part")
        if kind == "text":
            total += text_tokens(p.text)
        elif kind == "thinking":
            total += text_tokens(p.thinking.text)
        elif kind == "image":
            total += 2000
        elif kind == "tool_call":
            total += text_tokens(p.tool_call.name) + text_tokens(p.tool_call.arguments_json)
        elif kind == "tool_result":
            total += text_tokens(p.tool_result.text)
    return total


def tokens(messages):
    return sum(message_tokens(m) for m in messages)


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


# --- state: one SQLite file ----------------------------------------------------

HISTORY_GAP_TYPE_URL = "type.googleapis.com/contextengine.v1.HistoryGap"

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
PRAGMA user_version = 1;
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
    summarising of Compact) runs under the lock.
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
        self._db.executescript(SCHEMA)
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


class Status(collections.namedtuple("Status", ("code", "details", "trailing_metadata")), grpc.Status):
    """A status with trailing metadata, for context.abort_with_status."""


def history_gap_status(why, held):
    """FAILED_PRECONDITION with a HistoryGap detail in `grpc-status-details-bin`
    (an RpcStatus, wire-compatible with google.rpc.Status)."""
    code = grpc.StatusCode.FAILED_PRECONDITION
    message = f"history gap: {why}; resend the history"
    rich = pb.RpcStatus(code=code.value[0], message=message, details=[
        pb.AnyDetail(type_url=HISTORY_GAP_TYPE_URL, value=pb.HistoryGap(held=held).SerializeToString())])
    return Status(code, message, (("grpc-status-details-bin", rich.SerializeToString()),))


def store_status(e):
    # Busy, locked, I/O or disk full may pass: UNAVAILABLE (a CommitTurn stays
    # queued and is retried). Anything else is a bug: INTERNAL.
    if isinstance(e, sqlite3.OperationalError):
        return grpc.StatusCode.UNAVAILABLE, f"state store: {e}"
    return grpc.StatusCode.INTERNAL, f"state store: {e}"


# --- the engine ----------------------------------------------------------------

class RecencyEngine(pb_grpc.ContextEngineServicer):
    def __init__(self, store):
        self._store = store

    # Every handler goes through here: contract and store errors become statuses.
    def _guard(self, context, fn):
        try:
            return fn()
        except Invalid as e:
            context.abort(e.code, str(e))
        except sqlite3.Error as e:
            context.abort(*store_status(e))

    def _ingest(self, session_id, messages):
        with self._store.write() as db:
            return add_messages(db, session_id, messages)

    def GetInfo(self, request, context):
        return pb.EngineInfo(
            id="py-recency", name="Python recency engine", version="0.2.0",
            contract_version=CONTRACT_VERSION, owns_compaction=True,
            turn_maintenance_mode=pb.TURN_MAINTENANCE_MODE_FOREGROUND,
            implemented_methods=IMPLEMENTED,
            history_delivery=pb.HISTORY_DELIVERY_DELTA,
            # Each replica keeps its own sessions: a session's calls go to one.
            replica_affinity=pb.REPLICA_AFFINITY_SESSION)

    def Ingest(self, request, context):
        def run():
            check_id(request.session_id, "session_id")
            if not request.HasField("message"):
                raise Invalid("message", "is required")
            check_message(request.message, "message")
            return pb.IngestResult(ingested=self._ingest(request.session_id, [request.message]) > 0)
        return self._guard(context, run)

    def IngestBatch(self, request, context):
        def run():
            check_id(request.session_id, "session_id")
            check_messages(request.messages, "messages")
            return pb.IngestBatchResult(ingested_count=self._ingest(request.session_id, request.messages))
        return self._guard(context, run)

    def AfterTurn(self, request, context):
        def run():
            check_id(request.session_id, "session_id")
            check_messages(request.messages, "messages")
            if request.pre_prompt_message_count > len(request.messages):
                raise Invalid("pre_prompt_message_count", "is larger than the message count")
            self._ingest(request.session_id, request.messages)
            return pb.AfterTurnResult()
        return self._guard(context, run)

    def CommitTurn(self, request, context):
        def run():
            check_id(request.session_id, "session_id")
            check_id(request.advancement_key, "advancement_key")
            if not request.HasField("admission"):
                raise Invalid("admission", "is required")
            if request.admission.logical_turn_id != request.advancement_key:
                raise Invalid("admission.logical_turn_id", "must equal advancement_key")
            if not request.HasField("terminal"):
                raise Invalid("terminal", "is required")
            check_messages(request.messages, "messages")
            # One transaction: the key check, the messages and the key. It is
            # synced (synchronous=FULL) before COMMITTED is answered.
            with self._store.write() as db:
                if db.execute("SELECT 1 FROM commits WHERE session_id = ? AND advancement_key = ?",
                              (request.session_id, request.advancement_key)).fetchone():
                    return pb.CommitTurnResult(status=pb.COMMIT_STATUS_DUPLICATE)
                add_messages(db, request.session_id, request.messages)
                db.execute("INSERT INTO commits (session_id, advancement_key, committed_at_ms) VALUES (?, ?, ?)",
                           (request.session_id, request.advancement_key, now_ms()))
            return pb.CommitTurnResult(status=pb.COMMIT_STATUS_COMMITTED)
        return self._guard(context, run)

    def ForgetSession(self, request, context):
        # The session was deleted: its messages, summary and commit keys go.
        def run():
            check_id(request.session_id, "session_id")
            with self._store.write() as db:
                for table in ("messages", "summaries", "commits", "sessions"):
                    db.execute(f"DELETE FROM {table} WHERE session_id = ?", (request.session_id,))
            return pb.ForgetSessionResult()
        return self._guard(context, run)

    def Assemble(self, request, context):
        def run():
            sid = request.session_id
            check_id(sid, "session_id")
            check_messages(request.messages, "messages")
            gap = None
            with self._store.read() as db:
                summary, upto = summary_of(db, sid)
                if not request.HasField("cursor"):
                    # FULL: the request's messages are the whole history.
                    summarised = set()
                    if upto:
                        summarised = {i for (i,) in db.execute(
                            "SELECT id FROM messages WHERE session_id = ? AND seq <= ?", (sid, upto))}
                    tail = [m for m in request.messages if m.id not in summarised]
                else:
                    # DELTA: what is held (past the summary), then what is new.
                    why = cursor_gap(db, sid, request.cursor)
                    if why is not None:
                        gap = history_gap_status(why, held_cursor(db, sid))
                    else:
                        tail = [m for _, m in messages_after(db, sid, upto)]
                        tail += [m for m in request.messages if not holds(db, sid, m.id)]
            if gap is not None:
                context.abort_with_status(gap)
            tail = tail[safe_cut(tail, 0):]
            head = []
            if summary:
                head = [types.AgentMessage(id=f"py-summary:{sid}", role=types.ROLE_USER,
                                           content=[types.ContentPart(text=summary)])]
            if request.HasField("token_budget"):
                while tokens(head) + tokens(tail) > request.token_budget:
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
        return self._guard(context, run)

    def Compact(self, request, context):
        try:
            check_id(request.session_id, "session_id")
            check_id(request.session_key, "session_key")
        except Invalid as e:
            context.abort(e.code, str(e))
        try:
            yield from self._compact(request, context)
        except sqlite3.Error as e:
            context.abort(*store_status(e))

    def _compact(self, request, context):
        sid = request.session_id
        with self._store.read() as db:
            summary, upto = summary_of(db, sid)
            rows = messages_after(db, sid, upto)
        pending = [m for _, m in rows]
        before = text_tokens(summary) + tokens(pending)
        starts = turn_starts(pending)
        cut = safe_cut(pending, starts[-KEEP_TURNS] if len(starts) >= KEEP_TURNS else 0)
        if cut == 0:
            yield pb.CompactEvent(result=pb.CompactResult(ok=True, compacted=False, tokens_before=before,
                                                          reason="nothing older than the kept turns"))
            return
        older = pending[:cut]
        lines = summary.splitlines() if summary else ["Summary of the earlier conversation (python recency engine)"]
        step = 20
        total = (len(older) + step - 1) // step
        for n in range(total):
            if not context.is_active():  # cancelled or past the deadline: stop, change nothing
                return
            yield pb.CompactEvent(progress=pb.CompactProgress(stage="summarising", done=n, total=total,
                                                               message=f"messages {n * step}..{(n + 1) * step}"))
            for m in older[n * step:(n + 1) * step]:
                snippet = text_of(m)[:200]
                if snippet:
                    lines.append(f"- {types.Role.Name(m.role)[5:].lower()}: {snippet}")
        new_summary = "\n".join(lines)
        while len(new_summary) > MAX_SUMMARY_CHARS and len(lines) > 2:
            del lines[1]
            new_summary = "\n".join(lines)
        if not context.is_active():
            return
        last_seq = rows[cut - 1][0]
        with self._store.write() as db:
            # Write only onto the state the summary was made from: not after a
            # concurrent compaction or a ForgetSession.
            now = db.execute("SELECT id FROM messages WHERE session_id = ? AND seq = ?", (sid, last_seq)).fetchone()
            unchanged = summary_of(db, sid)[1] == upto and now is not None and now[0] == older[-1].id
            if unchanged:
                db.execute(
                    "INSERT INTO summaries (session_id, summary, summarised_upto, updated_at_ms) VALUES (?, ?, ?, ?)"
                    " ON CONFLICT (session_id) DO UPDATE SET summary = excluded.summary,"
                    " summarised_upto = excluded.summarised_upto, updated_at_ms = excluded.updated_at_ms",
                    (sid, new_summary, last_seq, now_ms()))
        if not unchanged:
            yield pb.CompactEvent(result=pb.CompactResult(
                ok=False, compacted=False, tokens_before=before,
                reason="the session changed during compaction (compacted again or forgotten); nothing written"))
            return
        after = text_tokens(new_summary) + tokens(pending[cut:])
        yield pb.CompactEvent(result=pb.CompactResult(
            ok=True, compacted=True, summary=new_summary, first_kept_entry_id=pending[cut].id if cut < len(pending) else None,
            tokens_before=before, tokens_after=after))


def reflection_v1_handler(servicer):
    """grpcio-reflection serves only v1alpha; v1 is the same wire format under
    another name, so the same servicer answers both (tonic and grpcurl try v1)."""
    return grpc.method_handlers_generic_handler("grpc.reflection.v1.ServerReflection", {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString),
    })


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT (port 0 picks one) or unix:///PATH")
    parser.add_argument("--state-dir", default="./python-engine-state",
                        help="where the state lives (DIR/recency.sqlite); created if missing")
    parser.add_argument("--drain-seconds", type=float, default=10.0)
    parser.add_argument("--tls-cert", help="serve TLS with this certificate (PEM), with --tls-key")
    parser.add_argument("--tls-key", help="the certificate's private key (PEM)")
    parser.add_argument("--tls-client-ca",
                        help="with TLS: serve only clients (the gateway) whose certificate this CA (PEM) signed")
    parser.add_argument("--otlp-endpoint",
                        help="export a span per engine method (continuing the caller's traceparent) to this "
                             "OTLP/gRPC collector, http://HOST:PORT")
    parser.add_argument("--otlp-service-name", default=os.environ.get("OTEL_SERVICE_NAME", "ctxgate-engine-python"))
    args = parser.parse_args()
    if bool(args.tls_cert) != bool(args.tls_key) or (args.tls_client_ca and not args.tls_cert):
        parser.error("--tls-cert and --tls-key go together, and --tls-client-ca needs them")
    store = Store(args.state_dir)

    options = [("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_BYTES),
               ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_BYTES)]
    interceptors = []
    if args.otlp_endpoint:
        if not args.otlp_endpoint.startswith("http://"):
            parser.error(f"--otlp-endpoint {args.otlp_endpoint!r}: expected http://HOST:PORT")
        try:
            import otlp  # only then: it needs the opentelemetry-proto package
        except ImportError as e:
            parser.error(f"--otlp-endpoint needs the opentelemetry-proto package ({e})")
        interceptors.append(otlp.Interceptor(otlp.Exporter(args.otlp_endpoint, args.otlp_service_name), SERVICE))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=options, interceptors=interceptors)
    pb_grpc.add_ContextEngineServicer_to_server(RecencyEngine(store), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME, "grpc.reflection.v1.ServerReflection")
    reflection.enable_server_reflection(names, server)
    server.add_generic_rpc_handlers((reflection_v1_handler(reflection.ReflectionServicer(names)),))

    add_port = server.add_insecure_port
    if args.tls_cert:
        def read(path):
            with open(path, "rb") as f:
                return f.read()
        ca = read(args.tls_client_ca) if args.tls_client_ca else None
        creds = grpc.ssl_server_credentials([(read(args.tls_key), read(args.tls_cert))],
                                            root_certificates=ca, require_client_auth=ca is not None)
        add_port = lambda addr: server.add_secure_port(addr, creds)  # noqa: E731
    if args.listen.startswith("unix://"):
        add_port(args.listen)
        shown = args.listen
    else:
        host, _, port = args.listen.removeprefix("http://").rpartition(":")
        bound = add_port(f"{host}:{port}")
        shown = f"{host}:{bound}"
    server.start()
    for name in ("", SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    print(f"listening on {shown}", flush=True)

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    health_servicer.enter_graceful_shutdown()  # NOT_SERVING for every service, then drain
    server.stop(args.drain_seconds).wait()
    store.close()


if __name__ == "__main__":
    main()
