"""The `ContextEngine` gRPC service over an engine (`engine-sdk/rust/src/
service.rs`): each call is validated, admitted under the concurrent-call cap,
given its `CallContext` (deadline, cancellation, host client, trace) and run
as an asyncio task of its own; a cancelled call cancels that task and sets
the context's event; a failure is a status for that call only."""

from __future__ import annotations

import asyncio
import re
import json
import ipaddress
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import Any, NoReturn

import grpc
import grpc.aio

from . import validate
from .context import CallContext
from .engine import CompactOutcome, ContextEngine, DelegateToHost, Done, Progress
from .errors import EngineError
from .host import HostChannels, parse_peer
from .methods import ENGINE_SERVICE
from .otlp import Exporter, Span
from .pb import pb
from .trace import HEADER, TraceParent

log = logging.getLogger("ctxgate_engine")

# How long a refused caller is asked to wait (`grpc-retry-pushback-ms`).
PUSHBACK_MS = 50
DEFAULT_MAX_CONCURRENT_CALLS = 1024

Metadata = tuple[tuple[str, str | bytes], ...]
Call = Callable[[ContextEngine, CallContext, Any], Awaitable[Any]]

# method: (request type, response type, the engine method, whether the request carries host access)
UNARY: dict[str, tuple[Any, Any, Call, bool]] = {
    "GetInfo": (pb.GetInfoRequest, pb.EngineInfo, lambda e, c, r: e.get_info(c), False),
    "Bootstrap": (pb.BootstrapRequest, pb.BootstrapResult, lambda e, c, r: e.bootstrap(c, r), True),
    "Ingest": (pb.IngestRequest, pb.IngestResult, lambda e, c, r: e.ingest(c, r), False),
    "IngestBatch": (pb.IngestBatchRequest, pb.IngestBatchResult, lambda e, c, r: e.ingest_batch(c, r), False),
    "Assemble": (pb.AssembleRequest, pb.AssembleResult, lambda e, c, r: e.assemble(c, r), True),
    "AfterTurn": (pb.AfterTurnRequest, pb.AfterTurnResult, lambda e, c, r: e.after_turn(c, r), True),
    "CommitTurn": (pb.CommitTurnRequest, pb.CommitTurnResult, lambda e, c, r: e.commit_turn(c, r), True),
    "Maintain": (pb.MaintainRequest, pb.MaintainResult, lambda e, c, r: e.maintain(c, r), True),
    "PrepareSubagentSpawn": (pb.PrepareSubagentSpawnRequest, pb.PrepareSubagentSpawnResult,
                             lambda e, c, r: e.prepare_subagent_spawn(c, r), True),
    "RollbackSubagentSpawn": (pb.RollbackSubagentSpawnRequest, pb.RollbackSubagentSpawnResult,
                              lambda e, c, r: e.rollback_subagent_spawn(c, r), False),
    "OnSubagentEnded": (pb.OnSubagentEndedRequest, pb.OnSubagentEndedResult,
                        lambda e, c, r: e.on_subagent_ended(c, r), False),
    "Dispose": (pb.DisposeRequest, pb.DisposeResult, lambda e, c, r: e.dispose(c), False),
    "ForgetSession": (pb.ForgetSessionRequest, pb.ForgetSessionResult, lambda e, c, r: e.forget_session(c, r), False),
    "CallTool": (pb.CallToolRequest, pb.CallToolResult, lambda e, c, r: e.call_tool(c, r), True),
}


class _Refusal(Exception):
    """A status to answer instead of running the method."""

    def __init__(self, code: grpc.StatusCode, message: str, trailers: Metadata = ()) -> None:
        super().__init__(message)
        self.code, self.message, self.trailers = code, message, trailers


async def _abort(context: grpc.aio.ServicerContext[Any, Any], r: _Refusal) -> NoReturn:
    await context.abort(r.code, r.message, r.trailers)
    raise AssertionError("abort returns by raising")


def failed_inside(method: str) -> _Refusal:
    return _Refusal(grpc.StatusCode.INTERNAL, f"{method} failed inside the engine")


def info_with_tools(engine: ContextEngine, info: pb.EngineInfo) -> pb.EngineInfo:
    """GetInfo's answer with the tools declared through `tools()` joined
    (and CallTool listed), when `get_info` declares none itself."""
    if not info.tools:
        declared = engine.tools()
        if declared:
            info.tools.extend(declared)
            if "CallTool" not in info.implemented_methods:
                info.implemented_methods.append("CallTool")
    return info


def client_name_problem(name: str) -> str | None:
    """Why `name` cannot be a `--tls-client-name`, if it cannot: a DNS name
    (letters, digits, `-` and `.`), matched exactly, so no wildcard and no IP
    address (every SDK applies this rule)."""
    dns = 0 < len(name) <= 253 and all(_LABEL.fullmatch(label) for label in name.split("."))
    try:
        ipaddress.ip_address(name)
        ip = True
    except ValueError:
        ip = False
    if dns and not ip:
        return None
    return (f"--tls-client-name {json.dumps(name)}: expected a DNS name (matched exactly against a DNS "
            "subjectAltName of the client's certificate; no wildcard, no IP address)")


_LABEL = re.compile(r"[A-Za-z0-9-]+")


def client_named(auth: Mapping[str, Iterable[bytes]], names: tuple[str, ...]) -> bool:
    """Whether the verified client certificate in `auth` (grpcio's auth
    context) carries one of `names` as a DNS subjectAltName (`peer_dns`:
    not a URI, an e-mail or an address), exactly (case aside; a wildcard it
    presents matches nothing)."""
    presented = {p.decode("ascii", "replace").lower() for p in auth.get("peer_dns", [])}
    return any(n.lower() in presented for n in names)


class EngineService:
    """The generic handler serving `contextengine.v1.ContextEngine` over an
    engine; `draining` refuses new calls, `idle` is set while none runs."""

    def __init__(self, engine: ContextEngine, hosts: HostChannels, max_calls: int = DEFAULT_MAX_CONCURRENT_CALLS,
                 spans: Exporter | None = None, client_names: tuple[str, ...] = ()) -> None:
        self.engine = engine
        # `--tls-client-name`: grpcio has no hook in the handshake, so each
        # engine call checks the verified client certificate's names.
        self.client_names = client_names
        self.hosts = hosts
        self.max_calls = max(1, max_calls)
        self.spans = spans
        self.draining = False
        self._admitted = 0  # calls holding a slot (GetInfo takes none)
        self._active = 0  # every engine call running, for the drain
        self.idle = asyncio.Event()
        self.idle.set()

    def handler(self) -> grpc.GenericRpcHandler:
        handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
        for name, (req_type, res_type, _, _) in UNARY.items():
            handlers[name] = grpc.unary_unary_rpc_method_handler(
                self._unary_for(name), request_deserializer=req_type.FromString,
                response_serializer=res_type.SerializeToString)
        handlers["Compact"] = grpc.unary_stream_rpc_method_handler(
            self._compact, request_deserializer=pb.CompactRequest.FromString,
            response_serializer=pb.CompactEvent.SerializeToString)
        return grpc.method_handlers_generic_handler(ENGINE_SERVICE, handlers)

    # --- admission and context --------------------------------------------

    def _admit(self, method: str, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> bool:
        """Validates and takes a slot; raises the refusal. Returns whether a
        slot was taken (GetInfo is always admitted, without one)."""
        if self.client_names and not client_named(context.auth_context(), self.client_names):
            raise _Refusal(grpc.StatusCode.UNAUTHENTICATED,
                           "this engine serves only a client whose certificate names "
                           + " or ".join(self.client_names))
        if self.draining:
            raise _Refusal(grpc.StatusCode.UNAVAILABLE, "the engine is shutting down")
        try:
            validate.check_request(method, request)
        except validate.Violation as v:
            raise _Refusal(v.code, str(v)) from None
        if method == "GetInfo":
            return False
        if self._admitted >= self.max_calls:
            log.warning("engine call %s refused: at the concurrent-call limit", method)
            raise _Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"the engine is serving its limit of {self.max_calls} concurrent calls",
                           (("grpc-retry-pushback-ms", str(PUSHBACK_MS)),))
        self._admitted += 1
        return True

    def _enter(self) -> None:
        self._active += 1
        self.idle.clear()

    def _leave(self, slot: bool) -> None:
        if slot:
            self._admitted -= 1
        self._active -= 1
        if self._active == 0:
            self.idle.set()

    async def _context(self, request: Any, has_host: bool,
                       context: grpc.aio.ServicerContext[Any, Any]) -> tuple[CallContext, Span | None]:
        left = context.time_remaining()
        deadline = None if left is None else time.monotonic() + left
        metadata = dict(context.invocation_metadata() or ())
        raw = metadata.get(HEADER)
        incoming = TraceParent.parse(raw if isinstance(raw, str) else None)
        span = incoming.child() if incoming is not None else None
        peer = context.peer()
        client = None
        if has_host and request.HasField("host"):
            # The deadline is the caller's from its arrival; a name lookup for
            # the host endpoint spends from it.
            client = await self.hosts.client(request.host, parse_peer(peer), 2.0 if left is None else left)
        hop = None
        if incoming is not None and span is not None and self.spans is not None:
            hop = Span(name="", this=span, parent=incoming.parent_id, start_ns=time.time_ns())
        return CallContext(deadline, client, incoming, span, peer), hop

    def _finish(self, hop: Span | None, method: str, error: str | None) -> None:
        if hop is None or self.spans is None:
            return
        hop.name = f"{ENGINE_SERVICE}/{method}"
        hop.end_ns = time.time_ns()
        hop.attributes = [("rpc.system", "grpc"), ("rpc.method", method)]
        hop.error = error
        self.spans.record(hop)

    @staticmethod
    def _failure(method: str, e: BaseException) -> _Refusal:
        if isinstance(e, EngineError):
            code, message, trailers = e.status()
            if code == grpc.StatusCode.INTERNAL:
                log.error("%s: engine internal error: %s", method, e)
                return _Refusal(code, "internal engine error")
            return _Refusal(code, message, trailers)
        log.error("%s failed inside the engine", method, exc_info=e)
        return failed_inside(method)

    # --- unary methods ------------------------------------------------------

    def _unary_for(self, method: str) -> Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Any]]:
        async def handle(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            return await self._unary(method, request, context)
        return handle

    async def _unary(self, method: str, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        _, _, call, has_host = UNARY[method]
        try:
            slot = self._admit(method, request, context)
        except _Refusal as r:
            await _abort(context, r)
        self._enter()
        try:
            ctx, hop = await self._context(request, has_host, context)
            outcome = await self._run(method, call, ctx, request)
            if isinstance(outcome, _Refusal):
                self._finish(hop, method, outcome.message)
                await _abort(context, outcome)
            self._finish(hop, method, None)
            return outcome
        finally:
            self._leave(slot)

    async def _run(self, method: str, call: Call, ctx: CallContext, request: Any) -> Any:
        """The engine method as a task of its own, bounded by the deadline;
        its answer, or the refusal to send."""
        task = asyncio.ensure_future(call(self.engine, ctx, request))
        # Shielded: the task is cancelled here, after the context's event is
        # set, so a method that catches its cancellation finds it set.
        try:
            left = ctx.remaining()
            shielded = asyncio.shield(task)
            result = await (shielded if left is None else asyncio.wait_for(shielded, left))
        except (asyncio.TimeoutError, TimeoutError):
            ctx.cancelled.set()
            task.cancel()
            return _Refusal(grpc.StatusCode.DEADLINE_EXCEEDED, "the call's deadline passed")
        except asyncio.CancelledError:
            # The caller went away (or grpc ended the call at its deadline).
            ctx.cancelled.set()
            task.cancel()
            raise
        except Exception as e:  # noqa: BLE001 -- a failing method fails its call only
            return self._failure(method, e)
        if method == "GetInfo":
            info = info_with_tools(self.engine, result)
            try:
                validate.result_info(info)
            except validate.Violation as v:
                log.error("GetInfo: the engine's answer breaks the contract: %s", v)
                return _Refusal(grpc.StatusCode.INTERNAL, f"the engine's GetInfo answer breaks the contract: {v}")
            return info
        return result

    # --- Compact: progress events, then exactly one terminal event ----------

    async def _compact(self, request: pb.CompactRequest,
                       context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[pb.CompactEvent]:
        method = "Compact"
        try:
            slot = self._admit(method, request, context)
        except _Refusal as r:
            await _abort(context, r)
        self._enter()
        task: asyncio.Future[CompactOutcome] | None = None
        ctx: CallContext | None = None
        try:
            ctx, hop = await self._context(request, True, context)
            events: asyncio.Queue[pb.CompactEvent] = asyncio.Queue(16)
            task = asyncio.ensure_future(self.engine.compact(ctx, request, Progress(events, ctx)))
            deadline = ctx.deadline
            while True:
                if not events.empty():
                    yield events.get_nowait()
                    continue
                if task.done():
                    break
                getter = asyncio.ensure_future(events.get())
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                done, _ = await asyncio.wait({getter, task}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    yield getter.result()
                    continue
                getter.cancel()
                if not done:  # the deadline passed
                    ctx.cancelled.set()
                    task.cancel()
                    refusal = _Refusal(grpc.StatusCode.DEADLINE_EXCEEDED, "the call's deadline passed")
                    self._finish(hop, method, refusal.message)
                    await _abort(context, refusal)
            try:
                outcome = task.result()
            except Exception as e:  # noqa: BLE001 -- a failing method fails its call only
                refusal = self._failure(method, e)
                self._finish(hop, method, refusal.message)
                await _abort(context, refusal)
            self._finish(hop, method, None)
            if isinstance(outcome, Done):
                yield pb.CompactEvent(result=outcome.result)
            elif isinstance(outcome, DelegateToHost):
                yield pb.CompactEvent(delegate_to_host=outcome.delegate)
            else:
                log.error("Compact returned %r, not Done or DelegateToHost", outcome)
                await _abort(context, failed_inside(method))
        except (asyncio.CancelledError, GeneratorExit):
            if ctx is not None:
                ctx.cancelled.set()
            raise
        finally:
            if task is not None and not task.done():
                task.cancel()
            self._leave(slot)
