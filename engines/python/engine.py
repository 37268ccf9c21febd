"""A ctxgate context engine in Python (grpcio): the recency engine.

It keeps the newest turns that fit the token budget, plus an extractive
summary of what compaction folded away. State is in memory, per session.
It serves grpc.health.v1 and reflection like every ctxgate engine, validates
every request against the contract, and stops work when a call is cancelled.

    engines/python/run.sh --listen 127.0.0.1:0
"""

import argparse
import os
import signal
import sys
import threading
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


# --- the engine ----------------------------------------------------------------

class Session:
    def __init__(self):
        self.messages = {}   # id -> AgentMessage, insertion ordered
        self.summarised = set()
        self.summary = ""
        self.commits = set()


class RecencyEngine(pb_grpc.ContextEngineServicer):
    def __init__(self):
        self._lock = threading.Lock()
        self._sessions = {}

    def _session(self, session_id):
        return self._sessions.setdefault(session_id, Session())

    def _ingest(self, session_id, messages):
        with self._lock:
            s = self._session(session_id)
            added = 0
            for m in messages:
                if m.id not in s.messages:
                    s.messages[m.id] = m
                    added += 1
            return added

    # Every handler goes through here: contract errors become statuses.
    def _guard(self, context, fn):
        try:
            return fn()
        except Invalid as e:
            context.abort(e.code, str(e))

    def GetInfo(self, request, context):
        return pb.EngineInfo(
            id="py-recency", name="Python recency engine", version="0.1.0",
            contract_version=CONTRACT_VERSION, owns_compaction=False,
            turn_maintenance_mode=pb.TURN_MAINTENANCE_MODE_FOREGROUND,
            implemented_methods=IMPLEMENTED)

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
            with self._lock:  # one lock: the key check and the write are atomic
                s = self._session(request.session_id)
                if request.advancement_key in s.commits:
                    return pb.CommitTurnResult(status=pb.COMMIT_STATUS_DUPLICATE)
                for m in request.messages:
                    s.messages.setdefault(m.id, m)
                s.commits.add(request.advancement_key)
            return pb.CommitTurnResult(status=pb.COMMIT_STATUS_COMMITTED)
        return self._guard(context, run)

    def ForgetSession(self, request, context):
        # The session was deleted: its messages, summary and commit keys go.
        def run():
            check_id(request.session_id, "session_id")
            with self._lock:
                self._sessions.pop(request.session_id, None)
            return pb.ForgetSessionResult()
        return self._guard(context, run)

    def Assemble(self, request, context):
        def run():
            check_id(request.session_id, "session_id")
            check_messages(request.messages, "messages")
            with self._lock:
                s = self._session(request.session_id)
                summary, summarised = s.summary, set(s.summarised)
            tail = [m for m in request.messages if m.id not in summarised]
            tail = tail[safe_cut(tail, 0):]
            head = []
            if summary:
                head = [types.AgentMessage(id=f"py-summary:{request.session_id}", role=types.ROLE_USER,
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
        with self._lock:
            s = self._session(request.session_id)
            pending = [m for m in s.messages.values() if m.id not in s.summarised]
            summary = s.summary
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
        with self._lock:
            s.summary = new_summary
            s.summarised.update(m.id for m in older)
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
    parser.add_argument("--drain-seconds", type=float, default=10.0)
    args = parser.parse_args()

    options = [("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_BYTES),
               ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_BYTES)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=options)
    pb_grpc.add_ContextEngineServicer_to_server(RecencyEngine(), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME, "grpc.reflection.v1.ServerReflection")
    reflection.enable_server_reflection(names, server)
    server.add_generic_rpc_handlers((reflection_v1_handler(reflection.ReflectionServicer(names)),))

    if args.listen.startswith("unix://"):
        server.add_insecure_port(args.listen)
        shown = args.listen
    else:
        host, _, port = args.listen.removeprefix("http://").rpartition(":")
        bound = server.add_insecure_port(f"{host}:{port}")
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


if __name__ == "__main__":
    main()
