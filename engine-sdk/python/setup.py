"""Generates the contract's Python code from ../../proto while the package is
built (pip install, pip wheel): the generated code is never committed."""

import os
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO = os.path.join(HERE, "..", "..", "proto")
GEN = os.path.join(HERE, "gen")


class GenerateThenBuild(build_py):
    def run(self) -> None:
        os.makedirs(GEN, exist_ok=True)
        package = os.path.join(PROTO, "contextengine", "v1")
        files = sorted(os.path.join(package, f) for f in os.listdir(package) if f.endswith(".proto"))
        subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO}", f"--python_out={GEN}",
                        f"--pyi_out={GEN}", f"--grpc_python_out={GEN}", *files], check=True)
        for d in ("contextengine", os.path.join("contextengine", "v1")):
            open(os.path.join(GEN, d, "__init__.py"), "a").close()
        super().run()


setup(cmdclass={"build_py": GenerateThenBuild})
