"""What the tests share: running a coroutine test, an engine served
in-process, typed callers of its methods, and engine processes."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

import grpc
import grpc.aio
from google.protobuf.message import Message

from ctxgate_engine import ContextEngine, ServeArgs, Server
from ctxgate_engine.methods import ENGINE_SERVICE
from ctxgate_engine.pb import pb

HERE = os.path.dirname(os.path.abspath(__file__))
SDK = os.path.dirname(HERE)
REPO = os.path.dirname(os.path.dirname(SDK))

R = TypeVar("R", bound=Message)

def deadline_bound(seconds: float) -> float:
    """The most time left a server may report for a client's deadline
    `seconds` away. gRPC carries a deadline as a timeout header, which its
    core rounds up to a few significant digits (a 10 s deadline arrived as
    10.099 s: ~1 %), and the server turns it back into a deadline on its own
    clock (0.4006 s for 0.4 s was seen) -- never the seconds more a call
    without that deadline would get."""
    return seconds * 1.01 + 0.05


def run_async(f: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """A coroutine test, run on a fresh event loop."""
    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        asyncio.run(f(*args, **kwargs))
    return wrapper


@contextlib.asynccontextmanager
async def serving(engine: ContextEngine, args: ServeArgs | None = None) -> AsyncIterator[tuple[Server, grpc.aio.Channel]]:
    """`engine` served on a loopback port, and a channel to it."""
    server = Server(engine, args or ServeArgs())
    local = await server.bind()
    task = asyncio.create_task(server.serve())
    channel = grpc.aio.insecure_channel(str(local))
    try:
        yield server, channel
    finally:
        await channel.close()
        server.stop.set()
        await task


def serialize(m: Message) -> bytes:
    return m.SerializeToString()


def unary(channel: grpc.aio.Channel, method: str, reply: type[R]) -> grpc.aio.UnaryUnaryMultiCallable[Message, R]:
    return channel.unary_unary(f"/{ENGINE_SERVICE}/{method}", request_serializer=serialize,
                               response_deserializer=reply.FromString)


def compact(channel: grpc.aio.Channel) -> grpc.aio.UnaryStreamMultiCallable[Message, pb.CompactEvent]:
    return channel.unary_stream(f"/{ENGINE_SERVICE}/Compact", request_serializer=serialize,
                                response_deserializer=pb.CompactEvent.FromString)


REPLIES: dict[str, type[Message]] = {
    "GetInfo": pb.EngineInfo, "Bootstrap": pb.BootstrapResult, "Ingest": pb.IngestResult,
    "IngestBatch": pb.IngestBatchResult, "Assemble": pb.AssembleResult, "AfterTurn": pb.AfterTurnResult,
    "CommitTurn": pb.CommitTurnResult, "Maintain": pb.MaintainResult,
    "PrepareSubagentSpawn": pb.PrepareSubagentSpawnResult, "RollbackSubagentSpawn": pb.RollbackSubagentSpawnResult,
    "OnSubagentEnded": pb.OnSubagentEndedResult, "Dispose": pb.DisposeResult,
    "ForgetSession": pb.ForgetSessionResult, "CallTool": pb.CallToolResult,
}

REQUESTS: dict[str, type[Message]] = {
    "GetInfo": pb.GetInfoRequest, "Bootstrap": pb.BootstrapRequest, "Ingest": pb.IngestRequest,
    "IngestBatch": pb.IngestBatchRequest, "Assemble": pb.AssembleRequest, "Compact": pb.CompactRequest,
    "AfterTurn": pb.AfterTurnRequest, "CommitTurn": pb.CommitTurnRequest, "Maintain": pb.MaintainRequest,
    "PrepareSubagentSpawn": pb.PrepareSubagentSpawnRequest, "RollbackSubagentSpawn": pb.RollbackSubagentSpawnRequest,
    "OnSubagentEnded": pb.OnSubagentEndedRequest, "Dispose": pb.DisposeRequest,
    "ForgetSession": pb.ForgetSessionRequest, "CallTool": pb.CallToolRequest,
}


def user(i: str, text: str) -> Any:
    from ctxgate_engine.pb import types
    return types.AgentMessage(id=i, role=types.ROLE_USER, content=[types.ContentPart(text=text)])


def assemble_request(session: str, *messages: Any) -> pb.AssembleRequest:
    return pb.AssembleRequest(session_id=session, messages=list(messages) or [user("m", "hi")])


class EngineProcess:
    """An engine run as a process; `endpoint` is what it printed after
    `listening on`."""

    def __init__(self, argv: list[str]) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("listening on "):
            self.proc.kill()
            raise AssertionError(f"unexpected first line {line!r}: {self.proc.stderr.read() if self.proc.stderr else ''}")
        self.endpoint = line.removeprefix("listening on ").strip()

    @staticmethod
    def python(*args: str) -> EngineProcess:
        return EngineProcess([sys.executable, *args])

    def stop(self, timeout: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        return self.proc.wait(timeout)

    def stderr(self) -> str:
        return self.proc.stderr.read() if self.proc.stderr else ""


async def serializer_free_health(channel: grpc.aio.Channel, service: str) -> Any:
    """One grpc.health.v1 Check."""
    from grpc_health.v1 import health_pb2
    check = channel.unary_unary("/grpc.health.v1.Health/Check",
                                request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                response_deserializer=health_pb2.HealthCheckResponse.FromString)
    return await check(health_pb2.HealthCheckRequest(service=service), timeout=5)
