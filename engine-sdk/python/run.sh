#!/usr/bin/env bash
# Starts the SDK's example engine:  engine-sdk/python/run.sh --listen ADDR [--state-dir DIR]
# Or any engine written on the SDK:  engine-sdk/python/run.sh python my_engine.py --listen ADDR
# On first use it creates a venv (.venv) with the pinned packages and generates
# the contract's code (gen/) from ../../proto; both are git-ignored.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
"$here/../../proto/python-setup.sh" "$here" --requirements requirements-dev.txt --path . contextengine/v1 >&2
if [ "${1:-}" = python ]; then
  shift
  exec "$here/.venv/bin/python" "$@"
fi
exec "$here/.venv/bin/python" -m ctxgate_engine.example "$@"
