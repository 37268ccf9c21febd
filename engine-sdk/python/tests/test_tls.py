"""TLS and mTLS: the engine serves only clients whose certificate the client
CA signed, and SIGHUP re-reads its certificate for new connections (a
mistake keeps the running one). Certificates are made here with openssl."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from ctxgate_engine.pb import pb
from ctxgate_engine.service import client_named
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import EngineProcess

PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "probe.py")


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def ca(d: Path, name: str) -> tuple[Path, Path]:
    pem, key = d / f"{name}.pem", d / f"{name}.key"
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
            str(key), "-out", str(pem), "-days", "2", "-subj", f"/CN={name}")
    return pem, key


def leaf(d: Path, name: str, signer: tuple[Path, Path],
         san: str = "DNS:localhost,IP:127.0.0.1") -> tuple[Path, Path]:
    pem, key, csr, ext = d / f"{name}.pem", d / f"{name}.key", d / f"{name}.csr", d / f"{name}.ext"
    ext.write_text(f"subjectAltName={san}\nextendedKeyUsage=serverAuth,clientAuth\n")
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key),
            "-out", str(csr), "-subj", f"/CN={name}")
    openssl("x509", "-req", "-in", str(csr), "-CA", str(signer[0]), "-CAkey", str(signer[1]), "-CAcreateserial",
            "-out", str(pem), "-days", "2", "-extfile", str(ext))
    return pem, key


def check(endpoint: str, ca_pem: Path, client: tuple[Path, Path] | None) -> subprocess.CompletedProcess[str]:
    extra = ["--tls-cert", str(client[0]), "--tls-key", str(client[1])] if client else []
    return subprocess.run([sys.executable, PROBE, "health", "--endpoint", endpoint, "--tls-ca", str(ca_pem),
                           "--timeout-seconds", "3", *extra], capture_output=True, text=True, timeout=30)


def test_mtls_serves_only_signed_clients_and_sighup_reloads_the_certificate(tmp_path: Path) -> None:
    first, second = ca(tmp_path, "ca-1"), ca(tmp_path, "ca-2")
    cert, key = leaf(tmp_path, "engine", first)
    client = leaf(tmp_path, "client", first)
    engine = EngineProcess.python(PROBE, "--listen", "127.0.0.1:0", "--tls-cert", str(cert), "--tls-key", str(key),
                                  "--tls-client-ca", str(first[0]))
    endpoint = f"https://localhost:{engine.endpoint.rsplit(':', 1)[1]}"
    ok = check(endpoint, first[0], client)
    assert ok.returncode == 0, ok.stderr
    assert check(endpoint, first[0], None).returncode == 1, "no client certificate: nothing is served"

    # A new certificate (another CA) in the same files, then SIGHUP.
    new_cert, new_key = leaf(tmp_path, "engine-2", second)
    cert.write_bytes(new_cert.read_bytes())
    key.write_bytes(new_key.read_bytes())
    engine.proc.send_signal(signal.SIGHUP)
    for _ in range(50):
        if check(endpoint, second[0], client).returncode == 0:
            break
        time.sleep(0.1)
    assert check(endpoint, second[0], client).returncode == 0, "new connections get the new certificate"
    assert check(endpoint, first[0], client).returncode == 1

    # A mistake keeps the running certificate.
    cert.write_text("not a certificate")
    engine.proc.send_signal(signal.SIGHUP)
    time.sleep(0.3)
    assert check(endpoint, second[0], client).returncode == 0
    assert engine.proc.poll() is None, "still serving"
    assert engine.stop() == 0
    assert "not re-read; keeping the running one" in engine.stderr()


def get_info(endpoint: str, ca_pem: Path, client: tuple[Path, Path]) -> grpc.StatusCode:
    """One GetInfo over mTLS with `client`'s certificate: its status."""
    creds = grpc.ssl_channel_credentials(ca_pem.read_bytes(), client[1].read_bytes(), client[0].read_bytes())
    with grpc.secure_channel(endpoint, creds, options=[("grpc.ssl_target_name_override", "localhost")]) as channel:
        call = channel.unary_unary("/contextengine.v1.ContextEngine/GetInfo",
                                   request_serializer=pb.GetInfoRequest.SerializeToString,
                                   response_deserializer=pb.EngineInfo.FromString)
        try:
            call(pb.GetInfoRequest(), timeout=10)
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def test_tls_client_name_serves_only_the_named_client_and_health_listen_serves_health_alone(tmp_path: Path) -> None:
    signer = ca(tmp_path, "ca")
    cert, key = leaf(tmp_path, "engine", signer)
    gateway = leaf(tmp_path, "gateway", signer, "DNS:gateway")
    other = leaf(tmp_path, "engine-lossless", signer, "DNS:engine-lossless")
    health_at = f"unix://{tmp_path / 'health.sock'}"
    engine = EngineProcess.python(PROBE, "--listen", "127.0.0.1:0", "--tls-cert", str(cert), "--tls-key", str(key),
                                  "--tls-client-ca", str(signer[0]), "--tls-client-name", "gateway",
                                  "--health-listen", health_at)
    endpoint = f"127.0.0.1:{engine.endpoint.rsplit(':', 1)[1]}"
    assert get_info(endpoint, signer[0], gateway) == grpc.StatusCode.OK
    assert get_info(endpoint, signer[0], other) == grpc.StatusCode.UNAUTHENTICATED, \
        "a certificate naming another service is refused"
    with grpc.insecure_channel(f"unix:{tmp_path / 'health.sock'}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="contextengine.v1.ContextEngine"), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        call = channel.unary_unary("/contextengine.v1.ContextEngine/GetInfo",
                                   request_serializer=pb.GetInfoRequest.SerializeToString,
                                   response_deserializer=pb.EngineInfo.FromString)
        try:
            call(pb.GetInfoRequest(), timeout=10)
            raise AssertionError("an engine call was served where health is served alone")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNIMPLEMENTED
    assert os.stat(tmp_path / "health.sock").st_mode & 0o777 == 0o600, "the health socket is its owner's only"
    assert engine.stop() == 0

    refused = subprocess.run([sys.executable, PROBE, "--listen", "127.0.0.1:0", "--health-listen", "0.0.0.0:0"],
                             capture_output=True, text=True, timeout=30)
    assert refused.returncode != 0 and "only on a loopback address" in refused.stderr, refused.stderr
    for bad in ("*.example", "127.0.0.1", "gate way"):
        refused = subprocess.run([sys.executable, PROBE, "--listen", "127.0.0.1:0", "--tls-cert", str(cert),
                                  "--tls-key", str(key), "--tls-client-ca", str(signer[0]), "--tls-client-name", bad],
                                 capture_output=True, text=True, timeout=30)
        assert refused.returncode != 0 and "expected a DNS name" in refused.stderr, (bad, refused.stderr)


def test_a_client_name_matches_a_dns_name_exactly() -> None:
    assert client_named({"peer_dns": [b"gateway"], "x509_subject_alternative_name": [b"gateway"]}, ("gateway",))
    assert client_named({"peer_dns": [b"GATEWAY"]}, ("gateway",)), "case aside"
    assert not client_named({"peer_dns": [b"*.internal"]}, ("gateway.internal",)), "a wildcard names no one"
    assert not client_named({"x509_subject_alternative_name": [b"gateway"], "peer_uri": [b"gateway"]}, ("gateway",)), \
        "a URI or e-mail name is not a DNS name"
