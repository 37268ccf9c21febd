#!/usr/bin/env bash
# Assemble p50/p99 at 1k and 10k messages, lossless-claw under the host
# beside the window engine (docs/benchmarks.md):
#   engines/openclaw-host/bench/run.sh --window target/release/ctxgate-engine-window
set -euo pipefail
host="$(cd "$(dirname "$0")/.." && pwd)"
PATH="$("$host/../../engine-sdk/typescript/scripts/node.sh" 22.15 "$host/.cache"):$PATH"
export PATH
"$host/scripts/setup.sh" >&2
exec node "$host/bench/assemble.mjs" --host "$host/run.sh" "$@"
