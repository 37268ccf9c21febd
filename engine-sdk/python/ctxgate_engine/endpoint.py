"""Endpoints (`engine-sdk/runtime/src/endpoint.rs`): where an engine listens and
how a client reaches it -- `http://HOST:PORT`, a bare `HOST:PORT`, or
`unix:///PATH`."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass


class BadEndpoint(ValueError):
    def __init__(self, given: str) -> None:
        super().__init__(f"invalid endpoint {given!r}: expected http://HOST:PORT, HOST:PORT or unix:///PATH")


_NAME = re.compile(r"[A-Za-z0-9.-]+")


@dataclass(frozen=True)
class Endpoint:
    """One of: an IP address and port (`ip` set), a host name and port
    (resolved when connecting), or a unix socket path (`unix` set)."""

    host: str = ""
    port: int = 0
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None = None
    unix: str | None = None

    @staticmethod
    def parse(s: str) -> Endpoint:
        if s.startswith("unix://"):
            path = s[len("unix://"):]
            if not path:
                raise BadEndpoint(s)
            return Endpoint(unix=path)
        hostport = s.removeprefix("http://").rstrip("/")
        if hostport.startswith("localhost:"):
            hostport = "127.0.0.1:" + hostport[len("localhost:"):]
        host, sep, port_text = hostport.rpartition(":")
        if not sep or not port_text.isdigit() or int(port_text) > 65535:
            raise BadEndpoint(s)
        port = int(port_text)
        if host.startswith("[") and host.endswith("]"):
            try:
                return Endpoint(host=host[1:-1], port=port, ip=ipaddress.IPv6Address(host[1:-1]))
            except ValueError:
                raise BadEndpoint(s) from None
        try:
            return Endpoint(host=host, port=port, ip=ipaddress.IPv4Address(host))
        except ValueError:
            pass
        if not host or not _NAME.fullmatch(host):
            raise BadEndpoint(s)
        return Endpoint(host=host, port=port)

    def __str__(self) -> str:
        """The form engines print after `listening on`."""
        if self.unix is not None:
            return f"unix://{self.unix}"
        if isinstance(self.ip, ipaddress.IPv6Address):
            return f"[{self.ip}]:{self.port}"
        return f"{self.host}:{self.port}"

    def is_local(self) -> bool:
        """Whether only this machine can reach it: a loopback address or a
        unix socket (a host name is not: it may resolve anywhere)."""
        return self.unix is not None or (self.ip is not None and self.ip.is_loopback)

    def grpc_target(self) -> str:
        """The address as grpcio takes it (dial or bind)."""
        if self.unix is not None:
            return f"unix:{self.unix}"
        return str(self)
