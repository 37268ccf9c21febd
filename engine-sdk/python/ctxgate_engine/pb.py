"""The contract's generated messages (`proto/contextengine/v1/`, generated at
build time into `contextengine.v1`): `pb` is engine.proto, `types` is
types.proto, `host` is host.proto."""

from contextengine.v1 import engine_pb2 as pb
from contextengine.v1 import host_pb2 as host
from contextengine.v1 import types_pb2 as types

__all__ = ["pb", "types", "host"]
