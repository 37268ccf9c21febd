"""`ctxgate-engine` is a pip package: built as pip builds it, with the
contract's code generated from proto/ at build time, the type information
and the example's console entry point inside."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from helpers import REPO, SDK


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


def test_a_fresh_clone_builds_without_the_generated_folder(tmp_path: Path) -> None:
    """A fresh clone has no gen/: the build makes it before setuptools reads
    the layout that names it (`pip install engine-sdk/python` failed there
    with "package directory 'gen/contextengine' does not exist")."""
    clone = tmp_path / "clone"
    shutil.copytree(Path(REPO) / "proto" / "contextengine", clone / "proto" / "contextengine")
    ignore = shutil.ignore_patterns("gen", ".venv", "build", "*.egg-info", ".mypy_cache", ".pytest_cache",
                                    "__pycache__", ".setup.lock")
    shutil.copytree(SDK, clone / "engine-sdk" / "python", ignore=ignore)
    assert not (clone / "engine-sdk" / "python" / "gen").exists()
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-build-isolation", "--no-deps",
                            "--wheel-dir", str(tmp_path / "wheels"), str(clone / "engine-sdk" / "python")],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    wheels = list((tmp_path / "wheels").glob("ctxgate_engine-*.whl"))
    with zipfile.ZipFile(wheels[0]) as z:
        assert "contextengine/v1/engine_pb2.py" in z.namelist()
