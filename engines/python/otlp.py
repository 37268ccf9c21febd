"""Spans over OTLP/gRPC for the Python engine: each engine method is a span
of the caller's W3C trace (`traceparent`, a child of the gateway's call), and
finished spans go to a collector in batches (every second, or 512 spans).

Bounded: at most 4096 spans wait; more are dropped and counted, so
telemetry never slows a call or grows without limit. A collector that fails
or stalls loses that batch (said once on stderr until it works again).
"""

import queue
import re
import secrets
import sys
import threading
import time

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.resource.v1 import resource_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

QUEUE = 4096
BATCH = 512
EVERY = 1.0
EXPORT_TIMEOUT = 5.0
TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


def parse_traceparent(value):
    """(trace_id, parent_id, flags) as bytes, bytes, int; None if invalid."""
    m = TRACEPARENT.match((value or "").strip())
    if not m or set(m.group(1)) == {"0"} or set(m.group(2)) == {"0"}:
        return None
    return bytes.fromhex(m.group(1)), bytes.fromhex(m.group(2)), int(m.group(3), 16)


def _kv(key, value):
    return common_pb2.KeyValue(key=key, value=common_pb2.AnyValue(string_value=value))


class Exporter:
    def __init__(self, endpoint, service):
        target = endpoint.removeprefix("http://").rstrip("/")
        self._stub = trace_service_pb2_grpc.TraceServiceStub(grpc.insecure_channel(target))
        self._resource = resource_pb2.Resource(attributes=[_kv("service.name", service)])
        self._queue = queue.Queue(QUEUE)
        self._endpoint = endpoint
        self._dropped_lock = threading.Lock()
        self.dropped = 0
        threading.Thread(target=self._loop, name="otlp", daemon=True).start()

    def record(self, span):
        try:
            self._queue.put_nowait(span)
        except queue.Full:
            with self._dropped_lock:
                self.dropped += 1

    def _loop(self):
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
                                                  spans=batch)])])
            try:
                self._stub.Export(req, timeout=EXPORT_TIMEOUT)
                if failing:
                    print(f"otlp: export to {self._endpoint} works again", file=sys.stderr, flush=True)
                failing = False
            except Exception as e:  # noqa: BLE001 -- nothing may stop the export thread
                if not failing:
                    why = e.code().name if isinstance(e, grpc.RpcError) else repr(e)
                    print(f"otlp: export to {self._endpoint} failed ({why}); spans dropped until it works",
                          file=sys.stderr, flush=True)
                failing = True


class Interceptor(grpc.ServerInterceptor):
    """Wraps every method of `service` in a span exported by `exporter`."""

    def __init__(self, exporter, service):
        self._exporter = exporter
        self._prefix = f"/{service}/"

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or not details.method.startswith(self._prefix):
            return handler
        method = details.method.rsplit("/", 1)[1]
        incoming = parse_traceparent(dict(details.invocation_metadata or ()).get("traceparent"))
        # Only a traced, sampled call is a span (not an attach's GetInfo).
        if incoming is None or not incoming[2] & 1:
            return handler
        name = details.method.lstrip("/")

        def start():
            trace_id, parent, flags = incoming
            return trace_pb2.Span(trace_id=trace_id, span_id=secrets.token_bytes(8), parent_span_id=parent,
                                  flags=flags, name=name, kind=trace_pb2.Span.SPAN_KIND_SERVER,
                                  start_time_unix_nano=time.time_ns(),
                                  attributes=[_kv("rpc.system", "grpc"), _kv("rpc.method", method)])

        def finish(span, context, error):
            code = context.code() if hasattr(context, "code") else None
            if error is None and code not in (None, grpc.StatusCode.OK):
                error = code.name
            span.end_time_unix_nano = time.time_ns()
            span.status.code = trace_pb2.Status.STATUS_CODE_ERROR if error else trace_pb2.Status.STATUS_CODE_OK
            span.status.message = error or ""
            self._exporter.record(span)

        if handler.unary_unary:
            inner = handler.unary_unary

            def unary(request, context):
                span, error = start(), None
                try:
                    return inner(request, context)
                except Exception as e:
                    error = str(e) or type(e).__name__
                    raise
                finally:
                    finish(span, context, error)
            return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=handler.request_deserializer,
                                                       response_serializer=handler.response_serializer)
        if handler.unary_stream:
            inner = handler.unary_stream

            def stream(request, context):
                span, error = start(), None
                try:
                    yield from inner(request, context)
                except GeneratorExit:  # the caller went away mid-stream
                    error = "cancelled"
                    raise
                except Exception as e:
                    error = str(e) or type(e).__name__
                    raise
                finally:
                    finish(span, context, error)
            return grpc.unary_stream_rpc_method_handler(stream, request_deserializer=handler.request_deserializer,
                                                        response_serializer=handler.response_serializer)
        return handler
