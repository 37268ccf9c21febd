"""Spans over OTLP/gRPC (`engine-sdk/runtime/src/otlp.rs`): each traced engine
method is a span of its caller's trace, sent to a collector in batches (every
second, or 512 spans). Bounded: at most 4096 spans wait; more are dropped and
counted, so telemetry never slows a call or grows without limit. A collector
that fails or stalls loses that batch (said once until it works again)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.resource.v1 import resource_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from .endpoint import BadEndpoint, Endpoint
from .trace import TraceParent

log = logging.getLogger("ctxgate_engine.otlp")

QUEUE = 4096
BATCH = 512
EVERY = 1.0
EXPORT_TIMEOUT = 5.0


@dataclass
class Span:
    name: str
    this: TraceParent
    parent: bytes | None
    start_ns: int
    end_ns: int = 0
    attributes: list[tuple[str, str]] = field(default_factory=list)
    error: str | None = None


def _kv(key: str, value: str) -> common_pb2.KeyValue:
    return common_pb2.KeyValue(key=key, value=common_pb2.AnyValue(string_value=value))


def _wire(s: Span) -> trace_pb2.Span:
    status = trace_pb2.Status(
        code=trace_pb2.Status.STATUS_CODE_ERROR if s.error is not None else trace_pb2.Status.STATUS_CODE_OK,
        message=s.error or "")
    return trace_pb2.Span(
        trace_id=s.this.trace_id, span_id=s.this.parent_id, parent_span_id=s.parent or b"", flags=s.this.flags,
        name=s.name, kind=trace_pb2.Span.SPAN_KIND_SERVER, start_time_unix_nano=s.start_ns,
        end_time_unix_nano=s.end_ns, attributes=[_kv(k, v) for k, v in s.attributes], status=status)


class Exporter:
    """Sends spans to one OTLP/gRPC collector (`http://HOST:PORT`) as
    `service`, from a thread of its own."""

    def __init__(self, endpoint: str, service: str) -> None:
        try:
            parsed = Endpoint.parse(endpoint)
        except BadEndpoint as e:
            raise ValueError(str(e)) from None
        if parsed.unix is not None:
            raise ValueError(f"{endpoint!r}: OTLP goes to http://HOST:PORT")
        self._channel = grpc.insecure_channel(parsed.grpc_target())
        self._export = self._channel.unary_unary(
            "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
            request_serializer=trace_service_pb2.ExportTraceServiceRequest.SerializeToString,
            response_deserializer=trace_service_pb2.ExportTraceServiceResponse.FromString)
        self._resource = resource_pb2.Resource(attributes=[_kv("service.name", service)])
        self._queue: queue.Queue[Span] = queue.Queue(QUEUE)
        self._endpoint = endpoint
        self._dropped_lock = threading.Lock()
        self.dropped = 0
        threading.Thread(target=self._loop, name="otlp", daemon=True).start()

    def record(self, span: Span) -> None:
        """Queues a finished span; drops it (counted) when the queue is full.
        A trace its caller did not sample is not exported."""
        if not span.this.sampled:
            return
        try:
            self._queue.put_nowait(span)
        except queue.Full:
            with self._dropped_lock:
                self.dropped += 1

    def _loop(self) -> None:
        failing = False
        while True:
            batch = [self._queue.get()]
            until = time.monotonic() + EVERY
            while len(batch) < BATCH:
                left = until - time.monotonic()
                if left <= 0:
                    break
                try:
                    batch.append(self._queue.get(timeout=left))
                except queue.Empty:
                    break
            req = trace_service_pb2.ExportTraceServiceRequest(resource_spans=[trace_pb2.ResourceSpans(
                resource=self._resource,
                scope_spans=[trace_pb2.ScopeSpans(scope=common_pb2.InstrumentationScope(name="ctxgate-engine-python"),
                                                  spans=[_wire(s) for s in batch])])])
            try:
                self._export(req, timeout=EXPORT_TIMEOUT)
                if failing:
                    log.info("OTLP export to %s works again", self._endpoint)
                failing = False
            except Exception as e:  # noqa: BLE001 -- nothing may stop the export thread
                if not failing:
                    why = e.code().name if isinstance(e, grpc.RpcError) else repr(e)
                    log.warning("OTLP export to %s failed (%s); spans dropped until it works", self._endpoint, why)
                failing = True
