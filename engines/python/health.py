"""`health.py HOST:PORT [--tls-ca F [--tls-cert F --tls-key F]]`: one
grpc.health.v1 check of the engine; exit 0 when it is SERVING, 1 otherwise
(the container's health check). With --tls-ca the check speaks TLS, with
the client certificate when the engine requires one."""

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def channel(args):
    if not args.tls_ca:
        return grpc.insecure_channel(args.address)

    def read(path):
        with open(path, "rb") as f:
            return f.read()
    creds = grpc.ssl_channel_credentials(
        root_certificates=read(args.tls_ca),
        private_key=read(args.tls_key) if args.tls_key else None,
        certificate_chain=read(args.tls_cert) if args.tls_cert else None)
    return grpc.secure_channel(args.address, creds)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("address", nargs="?", default="127.0.0.1:7402")
    parser.add_argument("--tls-ca", help="check over TLS, trusting this CA (PEM)")
    parser.add_argument("--tls-cert", help="the client certificate (PEM), with --tls-key")
    parser.add_argument("--tls-key")
    args = parser.parse_args()
    if bool(args.tls_cert) != bool(args.tls_key) or (args.tls_cert and not args.tls_ca):
        parser.error("--tls-cert and --tls-key go together, and need --tls-ca")
    addr = args.address
    try:
        with channel(args) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=3)
    except grpc.RpcError as e:
        print(f"health.py: the engine at {addr} cannot be checked: {e.code().name}", file=sys.stderr)
        sys.exit(1)
    except OSError as e:
        print(f"health.py: {e}", file=sys.stderr)
        sys.exit(1)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"health.py: the engine at {addr} reports {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}",
              file=sys.stderr)
        sys.exit(1)
    print("SERVING")


if __name__ == "__main__":
    main()
