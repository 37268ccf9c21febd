#!/usr/bin/env bash
# Starts the Python context engine:  engines/python/run.sh --listen ADDR
# On first use it creates a venv (.venv) with the pinned packages and
# generates the gRPC code (gen/) from ../../proto; both are git-ignored. The
# engine runs on the Python engine SDK (../../engine-sdk/python), put on the
# venv's import path.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
"$here/../../proto/python-setup.sh" "$here" --path ../../engine-sdk/python contextengine/v1 >&2
exec "$here/.venv/bin/python" "$here/engine.py" "$@"
