"""Generates the contract's Python code from ../../proto while the package is
built (pip install, pip wheel): the generated code is never committed. It is
generated before setuptools reads the package layout, which names the
generated folder (pyproject.toml's package-dir), so a fresh clone installs
with `pip install engine-sdk/python`."""

import os
import subprocess
import sys

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO = os.path.join(HERE, "..", "..", "proto")
GEN = os.path.join(HERE, "gen")


def generate() -> None:
    package = os.path.join(PROTO, "contextengine", "v1")
    if not os.path.isdir(package):
        sys.exit(f"the contract's .proto files are not at {package}: build from a clone of the repository")
    os.makedirs(GEN, exist_ok=True)
    files = sorted(os.path.join(package, f) for f in os.listdir(package) if f.endswith(".proto"))
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO}", f"--python_out={GEN}",
                    f"--pyi_out={GEN}", f"--grpc_python_out={GEN}", *files], check=True)
    for d in ("contextengine", os.path.join("contextengine", "v1")):
        open(os.path.join(GEN, d, "__init__.py"), "a").close()


generate()
setup()
