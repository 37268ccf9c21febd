"""The server's guarantees for each call, seen from a real gRPC client:
cancellation and deadlines reach the method, a failing method is INTERNAL
for that call only, Compact streams end with one terminal event, the
history gap is typed, the per-call limit answers with a pushback, and
health and reflection are served."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2

from ctxgate_engine import ServeArgs, Server, ServeError, tool
from ctxgate_engine.errors import gap_of
from ctxgate_engine.methods import ENGINE_SERVICE
from ctxgate_engine.pb import pb
from helpers import assemble_request, compact, deadline_bound, run_async, serializer_free_health, serving, unary
from probe import BadTools, Probe, ProbeWithTools


@run_async
async def test_a_client_cancel_reaches_the_method_within_50_ms() -> None:
    """Five cancels; the median within 50 ms (each within 500 ms: CI runs
    this beside other test binaries on two cores)."""
    took = []
    for _ in range(5):
        engine = Probe()
        async with serving(engine) as (_, channel):
            call = unary(channel, "Assemble", pb.AssembleResult)(assemble_request("wait"))
            await asyncio.wait_for(engine.started.wait(), 10)
            assert engine.deadlines == [None], "no grpc-timeout, no deadline"
            cancelled = time.monotonic()
            call.cancel()
            for _ in range(400):
                if engine.cancelled_at is not None:
                    break
                await asyncio.sleep(0.005)
            assert engine.cancelled_at is not None, "the method saw no cancellation"
            assert engine.ctx_cancelled, "ctx.cancelled is set when the method is cancelled"
            took.append(engine.cancelled_at - cancelled)
    took.sort()
    shown = ", ".join(f"{t * 1000:.1f}" for t in took)
    assert took[2] < 0.05 and took[-1] < 0.5, f"the method saw the cancel after {shown} ms"
    print(f"cancel reached the method after {shown} ms")


@run_async
async def test_a_call_over_its_deadline_is_deadline_exceeded_and_the_method_sees_it() -> None:
    engine = Probe()
    async with serving(engine) as (_, channel):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await unary(channel, "Assemble", pb.AssembleResult)(assemble_request("wait"), timeout=0.4)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        left = engine.deadlines[0]
        assert left is not None and 0 < left <= deadline_bound(0.4), left
        for _ in range(100):
            if engine.cancelled_at is not None:
                break
            await asyncio.sleep(0.01)
        assert engine.cancelled_at is not None and engine.ctx_cancelled, "the method saw the deadline"


@run_async
async def test_a_failing_method_is_internal_and_the_connection_keeps_serving() -> None:
    async with serving(Probe()) as (_, channel):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await unary(channel, "Assemble", pb.AssembleResult)(assemble_request("raise"))
        assert e.value.code() == grpc.StatusCode.INTERNAL
        assert e.value.details() == "Assemble failed inside the engine", "internal detail is never sent"
        events = []
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for event in compact(channel)(pb.CompactRequest(session_id="raise", session_key="k")):
                events.append(event)
        assert [ev.WhichOneof("event") for ev in events] == ["progress"]
        assert (e.value.code(), e.value.details()) == (grpc.StatusCode.INTERNAL, "Compact failed inside the engine")
        await unary(channel, "GetInfo", pb.EngineInfo)(pb.GetInfoRequest())


@run_async
async def test_compact_streams_progress_then_one_terminal_event() -> None:
    async with serving(Probe()) as (_, channel):
        for session, terminal in [("ok", "result"), ("delegate", "delegate_to_host")]:
            events = [e async for e in compact(channel)(pb.CompactRequest(session_id=session, session_key="k"))]
            assert [e.WhichOneof("event") for e in events] == ["progress", terminal]
            assert (events[0].progress.done, events[0].progress.total) == (1, 2)


@run_async
async def test_a_history_gap_is_failed_precondition_with_the_typed_detail() -> None:
    async with serving(Probe()) as (_, channel):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await unary(channel, "Assemble", pb.AssembleResult)(assemble_request("gap"))
        details = dict(e.value.trailing_metadata() or ()).get("grpc-status-details-bin")
        assert isinstance(details, bytes)
        gap = gap_of(e.value.code(), details)
        assert gap is not None, e.value
        assert (gap.held.message_id, gap.held.message_count) == ("m7", 7)
        assert gap_of(grpc.StatusCode.FAILED_PRECONDITION, None) is None, "text is not a detail"


@run_async
async def test_a_call_over_the_limit_is_resource_exhausted_with_a_pushback() -> None:
    engine = Probe()
    async with serving(engine, ServeArgs(max_concurrent_calls=1)) as (_, channel):
        slow = asyncio.ensure_future(unary(channel, "Assemble", pb.AssembleResult)(assemble_request("slow")))
        await asyncio.wait_for(engine.started.wait(), 10)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await unary(channel, "Ingest", pb.IngestResult)(pb.IngestRequest(session_id="s", message=assemble_request(
                "s").messages[0]))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(e.value.trailing_metadata() or ()).get("grpc-retry-pushback-ms") == "50"
        info = await unary(channel, "GetInfo", pb.EngineInfo)(pb.GetInfoRequest())
        assert info.id == "probe", "GetInfo is always admitted"
        await slow
        await unary(channel, "Ingest", pb.IngestResult)(pb.IngestRequest(session_id="s", message=assemble_request(
            "s").messages[0]))


@run_async
async def test_health_serves_both_names_and_reflection_lists_the_services() -> None:
    async with serving(Probe()) as (_, channel):
        for service in ("", ENGINE_SERVICE):
            reply = await serializer_free_health(channel, service)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        from grpc_reflection.v1alpha import reflection_pb2
        for name in ("grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"):
            stream = channel.stream_stream(f"/{name}/ServerReflectionInfo",
                                           request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                           response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
            call = stream(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            answer = await call.read()
            assert isinstance(answer, reflection_pb2.ServerReflectionResponse), answer
            names = [s.name for s in answer.list_services_response.service]
            assert ENGINE_SERVICE in names and "grpc.health.v1.Health" in names, names
            call.cancel()


@run_async
async def test_declared_tools_join_get_info_with_call_tool() -> None:
    async with serving(ProbeWithTools()) as (_, channel):
        info = await unary(channel, "GetInfo", pb.EngineInfo)(pb.GetInfoRequest())
        assert [t.name for t in info.tools] == ["echo"] and "CallTool" in info.implemented_methods
        r = await unary(channel, "CallTool", pb.CallToolResult)(pb.CallToolRequest(
            session_id="s", tool_call_id="c1", name="echo", arguments_json='{"x":1}'))
        assert (r.is_error, r.content[0].text) == (False, '{"x":1}')


@run_async
async def test_a_bad_tool_declaration_is_a_clear_error_at_start() -> None:
    with pytest.raises(ServeError) as e:
        await Server(BadTools()).bind()
    assert "info.tools[0].name" in str(e.value) and "[a-zA-Z0-9_-]" in str(e.value), e.value


def test_a_tool_schema_is_a_dict_or_its_json_text_and_anything_else_names_the_tool() -> None:
    schema = {"type": "object", "properties": {"q": {"type": "string"}}}
    assert json.loads(tool("find", "finds", schema).parameters_json_schema) == schema
    assert tool("find", "finds", json.dumps(schema)).parameters_json_schema == json.dumps(schema)
    with pytest.raises(TypeError) as e:
        tool("find", "finds", ["not", "a", "schema"])  # type: ignore[arg-type]
    assert "tool 'find'" in str(e.value) and "dict or its JSON text" in str(e.value)
