"""W3C trace context: the incoming `traceparent` is continued (the method's
span is a child of the caller's) and the span is exported over OTLP/gRPC."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import grpc.aio
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from ctxgate_engine import ServeArgs
from ctxgate_engine.pb import pb
from ctxgate_engine.trace import TraceParent
from helpers import assemble_request, run_async, serving, unary
from probe import Probe

TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class Collector:
    def __init__(self) -> None:
        self.spans: list[tuple[str, trace_pb2.Span]] = []
        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "opentelemetry.proto.collector.trace.v1.TraceService", {
                "Export": grpc.unary_unary_rpc_method_handler(
                    self.export, request_deserializer=trace_service_pb2.ExportTraceServiceRequest.FromString,
                    response_serializer=trace_service_pb2.ExportTraceServiceResponse.SerializeToString)}),))
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    async def export(self, req: trace_service_pb2.ExportTraceServiceRequest,
                     context: grpc.aio.ServicerContext[Any, Any]) -> trace_service_pb2.ExportTraceServiceResponse:
        for rs in req.resource_spans:
            service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
            self.spans.extend((service, s) for ss in rs.scope_spans for s in ss.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


def test_traceparent_parsing_follows_the_w3c_rules() -> None:
    t = TraceParent.parse(TRACE)
    assert t is not None and str(t) == TRACE
    c = t.child()
    assert (c.trace_id, c.flags) == (t.trace_id, t.flags) and c.parent_id != t.parent_id
    for bad in ["", "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
                "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra"]:
        assert TraceParent.parse(bad) is None, bad


@run_async
async def test_a_traced_call_is_a_child_span_exported_over_otlp() -> None:
    collector = Collector()
    await collector.server.start()
    engine = Probe()
    args = ServeArgs(otlp_endpoint=f"http://127.0.0.1:{collector.port}", otlp_service_name="probe-engine")
    async with serving(engine, args) as (_, channel):
        await unary(channel, "Assemble", pb.AssembleResult)(assemble_request("traced"),
                                                           metadata=(("traceparent", TRACE),))
        await unary(channel, "Assemble", pb.AssembleResult)(assemble_request("untraced"))
        for _ in range(50):
            if collector.spans:
                break
            await asyncio.sleep(0.1)
    await collector.server.stop(None)
    assert len(collector.spans) == 1, "only the traced call is a span"
    service, span = collector.spans[0]
    assert service == "probe-engine" and span.name == "contextengine.v1.ContextEngine/Assemble"
    assert span.trace_id.hex() == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert span.parent_span_id.hex() == "00f067aa0ba902b7", "a child of the caller's span"
    assert f"-{span.span_id.hex()}-" in engine.spans[0], "the span the method's callbacks send"
