#!/usr/bin/env bash
# Installs and builds the OpenClaw host (and the TypeScript SDK it runs on)
# when something changed, under a lock so two callers cannot race. Expects
# a Node >= 22.15 with npm on PATH (run.sh puts it there).
set -euo pipefail
host="$(cd "$(dirname "$0")/.." && pwd)"
"$host/../../engine-sdk/typescript/scripts/setup.sh"
cd "$host"
exec 7>"$host/.setup.lock"
flock 7
want="$(sha256sum package-lock.json | cut -c1-16)"
if [ ! -d node_modules ] || [ "$(cat node_modules/.install-stamp 2>/dev/null)" != "$want" ]; then
  echo "setup: npm ci ($host)" >&2
  npm ci --no-audit --no-fund --loglevel=error >&2
  echo "$want" > node_modules/.install-stamp
fi
sources=$(find src test openclaw-sdk tsconfig.json package.json -type f -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)
if [ ! -f dist/.build-stamp ] || [ "$(cat dist/.build-stamp)" != "$sources" ]; then
  echo "setup: build ($host)" >&2
  npx tsc -p tsconfig.json >&2
  echo "$sources" > dist/.build-stamp
fi
