"""`health.py HOST:PORT`: one grpc.health.v1 check of the engine; exit 0 when
it is SERVING, 1 otherwise (the container's health check)."""

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main():
    addr = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:7402"
    try:
        with grpc.insecure_channel(addr) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=3)
    except grpc.RpcError as e:
        print(f"health.py: the engine at {addr} cannot be checked: {e.code().name}", file=sys.stderr)
        sys.exit(1)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"health.py: the engine at {addr} reports {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}",
              file=sys.stderr)
        sys.exit(1)
    print("SERVING")


if __name__ == "__main__":
    main()
