#!/usr/bin/env bash
# OpenClaw's time in its context engine per turn: the plugin through
# `ctxgate serve` to the window engine against OpenClaw's in-process legacy
# engine, side by side in one run (docs/benchmarks.md). Release builds:
#   cargo build --release -p ctxgate -p ctxgate-engine-window
#   engines/openclaw-plugin/bench/run.sh [--bin target/release] [--turns 300]
set -euo pipefail
plugin="$(cd "$(dirname "$0")/.." && pwd)"
repo="$(cd "$plugin/../.." && pwd)"
PATH="$("$repo/tests/openclaw-probe/setup-openclaw.sh"):$PATH"
export PATH
"$plugin/scripts/setup.sh" >&2
bin="$repo/target/release"
[[ " $* " == *" --bin "* ]] || set -- --bin "$bin" "$@"
exec node "$plugin/bench/overhead.mjs" --openclaw-dist "$repo/target/openclaw-probe/openclaw/node_modules/openclaw/dist" "$@"
