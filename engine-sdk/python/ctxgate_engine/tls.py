"""TLS from PEM files (`engine-sdk/runtime/src/tls.rs`): a file that cannot be
read or is not what it should be is an error naming the option it came
from; a server's certificate can be re-read while it serves (SIGHUP), and a
mistake then keeps the running one."""

from __future__ import annotations

import logging
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import grpc

log = logging.getLogger("ctxgate_engine.tls")


class TlsError(Exception):
    """TLS settings that could not be made, as a sentence naming the option."""


@dataclass(frozen=True)
class Pem:
    """A PEM file and the option that named it."""

    option: str
    path: str

    def read(self) -> bytes:
        try:
            with open(self.path, "rb") as f:
                return f.read()
        except OSError as e:
            raise TlsError(f"{self.option} {self.path}: {e.strerror or e}") from None


@dataclass(frozen=True)
class ServerFiles:
    cert: Pem
    key: Pem
    client_ca: Pem | None = None


@dataclass(frozen=True)
class ServerPems:
    cert: bytes
    key: bytes
    client_ca: bytes | None


def read_server(files: ServerFiles) -> ServerPems:
    """Reads and checks `files` now: a certificate, a private key that matches
    it, a client CA that is one. grpcio would only find out at the first
    handshake."""
    cert, key = files.cert.read(), files.key.read()
    if b"-----BEGIN CERTIFICATE-----" not in cert:
        raise TlsError(f"{files.cert.option} {files.cert.path} holds no PEM certificate")
    if b"PRIVATE KEY-----" not in key:
        raise TlsError(f"{files.key.option} {files.key.path} holds no PEM private key")
    check = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        check.load_cert_chain(files.cert.path, files.key.path)
    except (ssl.SSLError, OSError) as e:
        raise TlsError(f"{files.cert.option} and {files.key.option}: {e}") from None
    ca = None
    if files.client_ca is not None:
        ca = files.client_ca.read()
        if b"-----BEGIN CERTIFICATE-----" not in ca:
            raise TlsError(f"{files.client_ca.option} {files.client_ca.path} holds no PEM certificate")
        try:
            check.load_verify_locations(cadata=ca.decode("ascii", "replace"))
        except (ssl.SSLError, ValueError) as e:
            raise TlsError(f"{files.client_ca.option} {files.client_ca.path}: {e}") from None
    return ServerPems(cert, key, ca)


class LiveServerTls:
    """A server's TLS that `reload()` can replace while it serves:
    connections accepted afterwards use the new certificate, those open keep
    theirs."""

    def __init__(self, files: ServerFiles) -> None:
        self.files = files
        self._current = read_server(files)
        self._pending: grpc.ServerCertificateConfiguration | None = None
        self._lock = threading.Lock()

    @staticmethod
    def _config(p: ServerPems) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(p.key, p.cert)], root_certificates=p.client_ca)

    def credentials(self) -> grpc.ServerCredentials:
        # grpcio takes None from the fetcher as "keep the current one"; its
        # type stubs do not say so.
        fetch = cast(Callable[[], grpc.ServerCertificateConfiguration], self._fetch)
        return grpc.dynamic_ssl_server_credentials(
            self._config(self._current), fetch,
            require_client_authentication=self._current.client_ca is not None)

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        # Called by grpcio before each new handshake: None keeps the current.
        with self._lock:
            pending, self._pending = self._pending, None
        return pending

    def reload(self) -> None:
        """Re-reads the files; on a mistake raises TlsError and the running
        certificate stays."""
        pems = read_server(self.files)
        with self._lock:
            self._current = pems
            self._pending = self._config(pems)


def client_credentials(ca: Pem | None, cert: Pem | None, key: Pem | None) -> grpc.ChannelCredentials:
    """A client's TLS: trusts `ca` (default: the system roots) and presents
    `cert` and `key` when given (mTLS)."""
    return grpc.ssl_channel_credentials(
        root_certificates=ca.read() if ca else None,
        private_key=key.read() if key else None,
        certificate_chain=cert.read() if cert else None)
