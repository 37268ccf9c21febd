"""`health.py HOST:PORT [--tls-ca F [--tls-cert F --tls-key F]]`: one
grpc.health.v1 check of the engine; exit 0 when it is SERVING, 1 otherwise
(the container's health check). With --tls-ca the check speaks TLS, with
the client certificate when the engine requires one. The SDK's `health`
subcommand (`engine.py health --endpoint ADDR`) does the check."""

import argparse
import sys

from ctxgate_engine import health


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("address", nargs="?", default="127.0.0.1:7402")
    parser.add_argument("--tls-ca", help="check over TLS, trusting this CA (PEM)")
    parser.add_argument("--tls-cert", help="the client certificate (PEM), with --tls-key")
    parser.add_argument("--tls-key")
    args = parser.parse_args()
    if bool(args.tls_cert) != bool(args.tls_key) or (args.tls_cert and not args.tls_ca):
        parser.error("--tls-cert and --tls-key go together, and need --tls-ca")
    argv = ["--endpoint", f"https://{args.address}" if args.tls_ca else args.address]
    for flag in ("tls_ca", "tls_cert", "tls_key"):
        if getattr(args, flag):
            argv += [f"--{flag.replace('_', '-')}", getattr(args, flag)]
    sys.exit(health.main(argv, "health.py"))


if __name__ == "__main__":
    main()
