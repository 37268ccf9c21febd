"""Serving an engine (`engine-sdk/rust/src/server.rs`): the shared command
line, binding (TCP or a unix socket made mode 0600), health with drain,
reflection, TLS with reload on SIGHUP, span export, the `listening on` line,
and SIGTERM / Ctrl-C drain."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

from . import health as health_command
from . import validate
from .context import CallContext
from .endpoint import BadEndpoint, Endpoint
from .engine import ContextEngine
from .host import HostChannels, HostEndpoint, HostPolicy, HostTls
from .limits import MAX_GRPC_MESSAGE_BYTES
from .methods import ENGINE_SERVICE
from .otlp import Exporter
from .service import DEFAULT_MAX_CONCURRENT_CALLS, EngineService, client_name_problem, info_with_tools
from .tls import LiveServerTls, Pem, ServerFiles, TlsError

log = logging.getLogger("ctxgate_engine")


class ServeError(Exception):
    """The engine cannot start, as a sentence (bad options, a port in use)."""


@dataclass
class ServeArgs:
    """Command-line options every engine shares (`ServeArgs` of the Rust SDK)."""

    listen: Endpoint = field(default_factory=lambda: Endpoint.parse("127.0.0.1:0"))
    state_dir: str | None = None
    drain_seconds: float = 10.0
    max_concurrent_calls: int = DEFAULT_MAX_CONCURRENT_CALLS
    host_allow: list[HostEndpoint] = field(default_factory=list)
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    tls_client_names: list[str] = field(default_factory=list)
    health_listen: Endpoint | None = None
    host_ca: str | None = None
    otlp_endpoint: str | None = None
    otlp_service_name: str = "ctxgate-engine"
    # The engine's own options, when it added any to the parser.
    extra: argparse.Namespace = field(default_factory=argparse.Namespace)


def _endpoint(s: str) -> Endpoint:
    try:
        return Endpoint.parse(s)
    except BadEndpoint as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _host_endpoint(s: str) -> HostEndpoint:
    try:
        return HostEndpoint.parse(s)
    except BadEndpoint as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_serve_arguments(parser: argparse.ArgumentParser, *, state_dir: str | None = None,
                        service_name: str = "ctxgate-engine") -> None:
    """Adds the shared options to an engine's own parser."""
    a = parser.add_argument
    a("--listen", type=_endpoint, default=Endpoint.parse("127.0.0.1:0"),
      help="where to listen: HOST:PORT (port 0 picks one) or unix:///PATH (made mode 0600)")
    a("--state-dir", default=state_dir, help="where the engine keeps its state (created if missing)")
    a("--drain-seconds", type=float, default=10.0, help="how long in-flight calls may finish after SIGTERM or Ctrl-C")
    a("--max-concurrent-calls", type=int, default=DEFAULT_MAX_CONCURRENT_CALLS,
      help="engine calls served at once; one more is answered RESOURCE_EXHAUSTED with a retry pushback "
           "(GetInfo is never refused)")
    a("--host-allow", dest="host_allow", type=_host_endpoint, action="append", default=[], metavar="ENDPOINT",
      help="a host endpoint this engine may call back (HOST:PORT, http://, https:// or unix:///PATH), "
           "repeatable; none: only the address of the peer that made the call")
    a("--tls-cert", help="serve TLS with this certificate (PEM), with --tls-key")
    a("--tls-key", help="the certificate's private key (PEM)")
    a("--tls-client-ca", help="with TLS: only clients presenting a certificate this CA (PEM) signed are served")
    a("--tls-client-name", dest="tls_client_names", action="append", default=[], metavar="NAME",
      help="with --tls-client-ca: serve engine calls only from a client whose certificate names NAME "
           "(a DNS subjectAltName), such as the gateway's service name; repeatable")
    a("--health-listen", type=_endpoint, metavar="ADDR",
      help="also serve grpc.health.v1, and nothing else, in plaintext here: a loopback HOST:PORT or "
           "unix:///PATH, for a container's own health check when --tls-client-ca serves only the gateway")
    a("--host-ca", help="the CA (PEM) an https:// host endpoint's certificate must chain to "
                        "(default: the system roots); callbacks present --tls-cert when given")
    a("--otlp-endpoint", help="export a span per traced engine method over OTLP/gRPC to this collector "
                              "(http://HOST:PORT), continuing the caller's traceparent")
    a("--otlp-service-name", default=os.environ.get("OTEL_SERVICE_NAME", service_name),
      help="the service.name of those spans")


_SHARED = ("listen", "state_dir", "drain_seconds", "max_concurrent_calls", "host_allow", "tls_cert", "tls_key",
           "tls_client_ca", "tls_client_names", "health_listen", "host_ca", "otlp_endpoint", "otlp_service_name")


def parse_serve_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> ServeArgs:
    ns = parser.parse_args(argv)
    if bool(ns.tls_cert) != bool(ns.tls_key):
        parser.error("--tls-cert and --tls-key go together")
    if ns.tls_client_ca and not ns.tls_cert:
        parser.error("--tls-client-ca needs --tls-cert")
    if ns.tls_client_names and not ns.tls_client_ca:
        parser.error("--tls-client-name needs --tls-client-ca")
    for name in ns.tls_client_names:
        if (problem := client_name_problem(name)) is not None:
            parser.error(problem)
    if ns.health_listen is not None and not ns.health_listen.is_local():
        parser.error(f"--health-listen {ns.health_listen}: health is served there without TLS or "
                     "authentication, so only on a loopback address or a unix socket")
    shared = {k: getattr(ns, k) for k in _SHARED}
    extra = argparse.Namespace(**{k: v for k, v in vars(ns).items() if k not in _SHARED})
    return ServeArgs(**shared, extra=extra)


def reflection_v1_handler(servicer: Any) -> grpc.GenericRpcHandler:
    """grpcio-reflection serves only v1alpha; v1 is the same wire format under
    another name, so the same servicer answers both (tonic and grpcurl try v1)."""
    return grpc.method_handlers_generic_handler("grpc.reflection.v1.ServerReflection", {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString),
    })


class Server:
    """An engine server bound to its address (`bind`), then serving until
    `stop` is set (`serve`)."""

    def __init__(self, engine: ContextEngine, args: ServeArgs | None = None) -> None:
        self.engine = engine
        self.args = args or ServeArgs()
        self.tls: LiveServerTls | None = None
        self.local: Endpoint | None = None
        self.health = health.aio.HealthServicer()
        self.stop = asyncio.Event()
        self._server: grpc.aio.Server | None = None
        # `--health-listen`: health alone, in plaintext.
        self._health_server: grpc.aio.Server | None = None
        self.health_local: Endpoint | None = None
        self.service: EngineService | None = None

    def _host_tls(self) -> HostTls:
        a = self.args
        ca = Pem("--host-ca", a.host_ca).read() if a.host_ca else None
        if a.tls_cert and a.tls_key:
            return HostTls(ca, Pem("--tls-key", a.tls_key).read(), Pem("--tls-cert", a.tls_cert).read())
        return HostTls(ca)

    async def bind(self) -> Endpoint:
        """Checks the options and the engine's GetInfo, binds, starts serving;
        returns the address actually bound (port 0 resolved)."""
        a = self.args
        try:
            if a.tls_cert and a.tls_key:
                client_ca = Pem("--tls-client-ca", a.tls_client_ca) if a.tls_client_ca else None
                self.tls = LiveServerTls(ServerFiles(Pem("--tls-cert", a.tls_cert), Pem("--tls-key", a.tls_key),
                                                     client_ca))
            host_tls = self._host_tls()
        except TlsError as e:
            raise ServeError(str(e)) from None
        if self.tls is not None and a.listen.unix is not None:
            raise ServeError("TLS is served over TCP only: --listen HOST:PORT with --tls-cert")
        spans = None
        if a.otlp_endpoint:
            try:
                spans = Exporter(a.otlp_endpoint, a.otlp_service_name)
            except ValueError as e:
                raise ServeError(f"--otlp-endpoint: {e}") from None
        # A bad declaration (a tool's name, a missing required method) is said
        # now, not at the gateway's first attach.
        info = info_with_tools(self.engine, await self.engine.get_info(CallContext.detached()))
        try:
            validate.result_info(info)
        except validate.Violation as v:
            raise ServeError(f"the engine's GetInfo answer breaks the contract: {v}") from None

        options = [("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_BYTES),
                   # A port another process holds is an error, not shared.
                   ("grpc.so_reuseport", 0)]
        server = grpc.aio.server(options=options)
        self.service = EngineService(self.engine, HostChannels(HostPolicy(a.host_allow), host_tls),
                                     a.max_concurrent_calls, spans, tuple(a.tls_client_names))
        server.add_generic_rpc_handlers((self.service.handler(),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = (ENGINE_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME, "grpc.reflection.v1.ServerReflection")
        reflection.enable_server_reflection(names, server)
        server.add_generic_rpc_handlers((reflection_v1_handler(reflection.aio.ReflectionServicer(names)),))
        for name in ("", ENGINE_SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

        listen = a.listen
        if listen.unix is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(listen.unix)
            # The socket is the engine's door: only its owner may connect.
            old = os.umask(0o177)
            try:
                server.add_insecure_port(listen.grpc_target())
                await server.start()
            finally:
                os.umask(old)
            os.chmod(listen.unix, 0o600)
            self.local = listen
        else:
            target = listen.grpc_target()
            try:
                port = server.add_secure_port(target, self.tls.credentials()) if self.tls \
                    else server.add_insecure_port(target)
            except RuntimeError as e:
                raise ServeError(f"cannot listen on {listen}: {e}") from None
            if port == 0:
                raise ServeError(f"cannot listen on {listen}")
            await server.start()
            self.local = Endpoint(host=listen.host, port=port, ip=listen.ip)
        self._server = server
        if a.health_listen is not None:
            try:
                await self._bind_health(a.health_listen)
            except ServeError:
                await server.stop(grace=0)
                if self.local.unix is not None:
                    with contextlib.suppress(OSError):
                        os.remove(self.local.unix)
                raise
        return self.local

    async def _bind_health(self, at: Endpoint) -> None:
        """Serves the same health statuses, and nothing else, in plaintext."""
        if not at.is_local():
            raise ServeError(f"--health-listen {at}: health is served there without TLS or authentication, "
                             "so only on a loopback address or a unix socket")
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        if at.unix is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(at.unix)
        # A unix socket is its owner's only, as the engine's own is.
        old = os.umask(0o177)
        try:
            port = server.add_insecure_port(at.grpc_target())
            if at.unix is None and port == 0:
                raise ServeError(f"cannot listen on {at} (--health-listen)")
            await server.start()
        except RuntimeError as e:
            raise ServeError(f"cannot listen on {at} (--health-listen): {e}") from None
        finally:
            os.umask(old)
        if at.unix is not None:
            os.chmod(at.unix, 0o600)
        self.health_local = at if at.unix is not None else Endpoint(host=at.host, port=port, ip=at.ip)
        self._health_server = server

    def reload_tls(self) -> None:
        """Re-reads the certificate files (SIGHUP): new connections use them;
        a mistake keeps the running certificate."""
        if self.tls is None:
            return
        try:
            self.tls.reload()
            log.info("SIGHUP: TLS certificate re-read; new connections use it")
        except TlsError as e:
            log.error("SIGHUP: TLS certificate not re-read; keeping the running one: %s", e)

    async def serve(self) -> None:
        """Serves until `stop` is set, then drains: health NOT_SERVING, new
        calls refused (UNAVAILABLE), in-flight calls given the drain time."""
        assert self._server is not None and self.service is not None, "bind() first"
        await self.stop.wait()
        log.info("shutdown requested, draining")
        await self.health.enter_graceful_shutdown()
        self.service.draining = True
        try:
            await asyncio.wait_for(self.service.idle.wait(), self.args.drain_seconds)
        except (asyncio.TimeoutError, TimeoutError):
            log.warning("drain timed out after %s s; dropping remaining calls", self.args.drain_seconds)
        # What is left are streams that never end by themselves (health Watch).
        await self._server.stop(grace=0.2)
        if self._health_server is not None:
            await self._health_server.stop(grace=0.2)
        for local in (self.local, self.health_local):
            if local is not None and local.unix is not None:
                with contextlib.suppress(OSError):
                    os.remove(local.unix)


async def serve(engine: ContextEngine, args: ServeArgs | None = None,
                on_listening: Callable[[Endpoint], None] | None = None) -> None:
    """Runs `engine` until SIGTERM or Ctrl-C, then drains. Prints exactly one
    line `listening on ADDR` to stdout when ready (or calls `on_listening`)."""
    server = Server(engine, args)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.stop.set)
    if (args or ServeArgs()).tls_cert:
        # Listened to from before `listening on`, so an early SIGHUP never
        # kills a TLS engine.
        loop.add_signal_handler(signal.SIGHUP, server.reload_tls)
    local = await server.bind()
    if on_listening is not None:
        on_listening(local)
    else:
        print(f"listening on {local}", flush=True)
    await server.serve()


def init_logging() -> None:
    """Logs go to stderr: stdout carries only the `listening on` line."""
    level = os.environ.get("CTXGATE_LOG", "INFO").upper()
    logging.basicConfig(stream=sys.stderr, level=getattr(logging, level, logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def run(make_engine: Callable[[ServeArgs], ContextEngine], *, description: str = "A ctxgate context engine",
        parser: argparse.ArgumentParser | None = None, state_dir: str | None = None,
        service_name: str = "ctxgate-engine", argv: Sequence[str] | None = None) -> int:
    """An engine's `main`: `<engine> health --endpoint ADDR` checks a running
    engine; otherwise the shared options (and any the engine added to
    `parser`) are parsed, `make_engine(args)` builds the engine, and it is
    served until SIGTERM. Returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "engine"
    if argv[:1] == ["health"]:
        return health_command.main(argv[1:], prog)
    init_logging()
    parser = parser or argparse.ArgumentParser(description=description)
    add_serve_arguments(parser, state_dir=state_dir, service_name=service_name)
    args = parse_serve_args(parser, argv)

    async def main() -> None:
        await serve(make_engine(args), args)

    try:
        asyncio.run(main())
    except ServeError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    return 0
