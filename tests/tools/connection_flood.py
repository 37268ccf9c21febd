"""A connection flood against a running gateway (docs/benchmarks.md, "Connection floods").

    python3 tests/tools/connection_flood.py PORT N [PAYLOAD] [CTXGATE]

Opens N connections to 127.0.0.1:PORT that each send PAYLOAD (default `P`, the first byte of
the HTTP/2 preface) and wait; then times one `ctxgate chat -m hello` from a new client (CTXGATE:
default target/release/ctxgate); then counts the flood's connections the gateway still holds.
Loopback only, bounded by N and by a 0.5 s connect timeout each; it closes everything it opened.
"""

import resource
import socket
import subprocess
import sys
import time


def still_open(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(1) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def main() -> None:
    port, n = int(sys.argv[1]), int(sys.argv[2])
    payload = (sys.argv[3] if len(sys.argv) > 3 else "P").encode()
    ctxgate = sys.argv[4] if len(sys.argv) > 4 else "target/release/ctxgate"
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 100_000), hard))
    socks, failed = [], 0
    for _ in range(n):
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=0.5)
            if payload:
                s.sendall(payload)
            socks.append(s)
        except OSError:
            failed += 1
    print(f"{len(socks)} connected, {failed} failed", flush=True)
    started = time.time()
    chat = [ctxgate, "chat", "--gateway", f"http://127.0.0.1:{port}", "-m", "hello"]
    r = subprocess.run(chat, capture_output=True, text=True, timeout=60)
    took = time.time() - started
    print(f"client turn: exit {r.returncode} in {took:.2f} s; {r.stdout.strip()[:80]!r} {r.stderr.strip()[:200]!r}")
    print(f"{sum(still_open(s) for s in socks)} of them still open right after")
    for s in socks:
        s.close()


if __name__ == "__main__":
    main()
