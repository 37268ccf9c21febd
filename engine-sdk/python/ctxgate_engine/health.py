"""`<engine> health --endpoint ADDR`: one grpc.health.v1 check of the engine
service; exit 0 when it is SERVING, 1 otherwise (container health checks)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .endpoint import BadEndpoint
from .host import HostEndpoint
from .methods import ENGINE_SERVICE
from .tls import Pem, TlsError, client_credentials


def check(endpoint: HostEndpoint, timeout: float, ca: Pem | None = None, cert: Pem | None = None,
          key: Pem | None = None) -> str | None:
    """None when the engine at `endpoint` reports SERVING; else why not."""
    target = endpoint.endpoint.grpc_target()
    try:
        if endpoint.https:
            options = [("grpc.ssl_target_name_override", endpoint.host)]
            channel = grpc.secure_channel(target, client_credentials(ca, cert, key), options=options)
        else:
            channel = grpc.insecure_channel(target)
    except TlsError as e:
        return str(e)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=ENGINE_SERVICE), timeout=timeout)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return f"the engine at {endpoint} did not answer a health check within {timeout} s"
            return f"the engine at {endpoint} cannot be checked: {e.details() or e.code().name}"
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return f"the engine at {endpoint} reports {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
    return None


def main(argv: Sequence[str], prog: str = "engine") -> int:
    parser = argparse.ArgumentParser(prog=f"{prog} health",
                                     description="Checks a running engine: exit 0 when it is SERVING, 1 otherwise")
    parser.add_argument("--endpoint", required=True,
                        help="the engine to check: HOST:PORT, https://HOST:PORT (TLS) or unix:///PATH")
    parser.add_argument("--timeout-seconds", type=float, default=3.0)
    parser.add_argument("--tls-ca", help="with https://: the CA (PEM) the engine's certificate chains to")
    parser.add_argument("--tls-cert", help="with https://: a client certificate (PEM), with --tls-key")
    parser.add_argument("--tls-key")
    args = parser.parse_args(argv)
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("--tls-cert and --tls-key go together")
    try:
        endpoint = HostEndpoint.parse(args.endpoint)
    except BadEndpoint as e:
        parser.error(str(e))
    timeout = min(max(args.timeout_seconds, 0.1), 60.0) if args.timeout_seconds == args.timeout_seconds else 3.0
    why = check(endpoint, timeout,
                Pem("--tls-ca", args.tls_ca) if args.tls_ca else None,
                Pem("--tls-cert", args.tls_cert) if args.tls_cert else None,
                Pem("--tls-key", args.tls_key) if args.tls_key else None)
    if why is not None:
        print(f"{prog}: {why}", file=sys.stderr)
        return 1
    print("SERVING")
    return 0
