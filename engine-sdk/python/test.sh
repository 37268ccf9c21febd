#!/usr/bin/env bash
# The Python SDK's checks, as CI runs them (tests/engines/sdk_python.rs):
# the venv (made from PyPI on first use), mypy --strict over the SDK and its
# tests, pytest, and the package built as pip builds it (the contract's code
# generated at build time).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cd "$here"
"$here/../../proto/python-setup.sh" "$here" --requirements requirements-dev.txt --path . contextengine/v1
echo "== mypy (strict)"
.venv/bin/python -m mypy
echo "== mypy (strict): the minimal engine of docs/engines-in-python.md"
doc="$(mktemp -d)"
trap 'rm -rf "$doc"' EXIT
.venv/bin/python tests/doc_engine.py >"$doc/my_engine.py"
.venv/bin/python -m mypy --strict --no-incremental "$doc/my_engine.py"
echo "== pytest"
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
