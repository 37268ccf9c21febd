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

from helpers import EngineProcess

PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "probe.py")


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def ca(d: Path, name: str) -> tuple[Path, Path]:
    pem, key = d / f"{name}.pem", d / f"{name}.key"
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
            str(key), "-out", str(pem), "-days", "2", "-subj", f"/CN={name}")
    return pem, key


def leaf(d: Path, name: str, signer: tuple[Path, Path]) -> tuple[Path, Path]:
    pem, key, csr, ext = d / f"{name}.pem", d / f"{name}.key", d / f"{name}.csr", d / f"{name}.ext"
    ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
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
