"""`ctxgate-engine` is a pip package: built as pip builds it, with the
contract's code generated from proto/ at build time, the type information
and the example's console entry point inside."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from helpers import SDK


def test_the_wheel_carries_the_sdk_the_generated_contract_and_the_entry_point(tmp_path: Path) -> None:
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-build-isolation", "--no-deps",
                            "--wheel-dir", str(tmp_path), SDK], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    wheels = list(tmp_path.glob("ctxgate_engine-*.whl"))
    assert len(wheels) == 1, wheels
    with zipfile.ZipFile(wheels[0]) as z:
        names = set(z.namelist())
        entry_points = next(z.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    for want in ("ctxgate_engine/server.py", "ctxgate_engine/py.typed", "contextengine/v1/engine_pb2.py",
                 "contextengine/v1/engine_pb2.pyi", "contextengine/v1/host_pb2.py"):
        assert want in names, f"{want} not in {sorted(names)}"
    assert "ctxgate-engine-example = ctxgate_engine.example:main" in entry_points
