"""An engine as a process, as a container runs it: one `listening on` line
on stdout, SIGTERM drains (health NOT_SERVING, in-flight calls finish, new
ones are refused, exit 0), the `health` subcommand, a unix socket made mode
0600, and the example engine's state surviving a restart."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2

from ctxgate_engine.methods import ENGINE_SERVICE
from ctxgate_engine.pb import pb, types
from helpers import HERE, EngineProcess, assemble_request, run_async, unary, user

PROBE = os.path.join(HERE, "probe.py")


def health(endpoint: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, PROBE, "health", "--endpoint", endpoint, *extra], capture_output=True,
                          text=True, timeout=30)


@run_async
async def test_sigterm_drains_in_flight_calls_refuses_new_ones_and_exits_0() -> None:
    engine = EngineProcess.python(PROBE, "--listen", "127.0.0.1:0", "--drain-seconds", "5")
    async with grpc.aio.insecure_channel(engine.endpoint) as channel:
        watch = channel.unary_stream("/grpc.health.v1.Health/Watch",
                                     request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                     response_deserializer=health_pb2.HealthCheckResponse.FromString)
        statuses = watch(health_pb2.HealthCheckRequest(service=ENGINE_SERVICE))
        first = await statuses.read()
        assert isinstance(first, health_pb2.HealthCheckResponse) and first.status == first.SERVING
        assemble = unary(channel, "Assemble", pb.AssembleResult)
        in_flight = asyncio.ensure_future(assemble(assemble_request("slow"), timeout=10))
        await asyncio.sleep(0.1)
        engine.proc.send_signal(signal.SIGTERM)
        second = await statuses.read()
        assert isinstance(second, health_pb2.HealthCheckResponse) and second.status == second.NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await assemble(assemble_request("new"), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
        reply = await in_flight
        assert reply.messages[0].id == "m", "the in-flight call finished during the drain"
    assert engine.proc.wait(20) == 0
    assert engine.proc.stdout is not None and engine.proc.stdout.read() == "", "stdout carries one line only"


def test_the_health_subcommand_exits_0_when_serving_and_1_otherwise() -> None:
    engine = EngineProcess.python(PROBE, "--listen", "127.0.0.1:0")
    ok = health(engine.endpoint)
    assert (ok.returncode, ok.stdout.strip()) == (0, "SERVING"), ok.stderr
    endpoint = engine.endpoint
    assert engine.stop() == 0
    down = health(endpoint, "--timeout-seconds", "1")
    assert down.returncode == 1 and f"the engine at {endpoint}" in down.stderr, down


@run_async
async def test_a_unix_socket_is_made_mode_0600_and_serves(tmp_path: Path) -> None:
    socket = tmp_path / "engine.sock"
    engine = EngineProcess.python(PROBE, "--listen", f"unix://{socket}")
    assert engine.endpoint == f"unix://{socket}"
    assert stat.S_IMODE(os.stat(socket).st_mode) == 0o600
    async with grpc.aio.insecure_channel(f"unix:{socket}") as channel:
        info = await unary(channel, "GetInfo", pb.EngineInfo)(pb.GetInfoRequest(), timeout=5)
    assert info.id == "probe"
    assert health(engine.endpoint).returncode == 0
    assert engine.stop() == 0
    assert not socket.exists(), "the socket file is removed on exit"


def test_bad_options_are_a_sentence_naming_the_option(tmp_path: Path) -> None:
    missing = tmp_path / "none.pem"
    r = subprocess.run([sys.executable, PROBE, "--tls-cert", str(missing), "--tls-key", str(missing)],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and f"--tls-cert {missing}:" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, PROBE, "--listen", "ftp://x"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "invalid endpoint" in r.stderr, r.stderr


@run_async
async def test_the_example_engine_keeps_its_state_across_a_restart_and_answers_its_tool(tmp_path: Path) -> None:
    argv = ["-m", "ctxgate_engine.example", "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path)]
    held = [user("e1", "the ticket is EX-42"), types.AgentMessage(id="e2", role=types.ROLE_ASSISTANT, content=[
        types.ContentPart(text="noted")])]
    cursor = pb.HistoryCursor(message_id="e2", seq=2, message_count=2, tokens=4)
    engine = EngineProcess.python(*argv)
    async with grpc.aio.insecure_channel(engine.endpoint) as channel:
        r = await unary(channel, "IngestBatch", pb.IngestBatchResult)(
            pb.IngestBatchRequest(session_id="s", messages=held), timeout=5)
        assert r.ingested_count == 2
    assert engine.stop() == 0
    engine = EngineProcess.python(*argv)
    async with grpc.aio.insecure_channel(engine.endpoint) as channel:
        request = pb.AssembleRequest(session_id="s", messages=[user("e3", "where were we?")], cursor=cursor)
        out = await unary(channel, "Assemble", pb.AssembleResult)(request, timeout=5)
        assert [m.id for m in out.messages] == ["e1", "e2", "e3"]
        found = await unary(channel, "CallTool", pb.CallToolResult)(pb.CallToolRequest(
            session_id="s", tool_call_id="c", name="find_messages", arguments_json='{"text": "EX-42"}'), timeout=5)
        assert not found.is_error and "#1: the ticket is EX-42" in found.content[0].text, found
        bad = await unary(channel, "CallTool", pb.CallToolResult)(pb.CallToolRequest(
            session_id="s", tool_call_id="c", name="find_messages", arguments_json="not json"), timeout=5)
        assert bad.is_error
    assert engine.stop() == 0
