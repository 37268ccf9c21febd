#!/usr/bin/env bash
# Installs and builds the ctxgate plugin for OpenClaw (and the TypeScript
# SDK it converts messages with) when something changed, under a lock so
# two callers cannot race. Expects Node >= 22.15 with npm on PATH.
set -euo pipefail
plugin="$(cd "$(dirname "$0")/.." && pwd)"
"$plugin/../../engine-sdk/typescript/scripts/setup.sh"
cd "$plugin"
exec 7>"$plugin/.setup.lock"
flock 7
want="$(sha256sum package-lock.json | cut -c1-16)"
if [ ! -d node_modules ] || [ "$(cat node_modules/.install-stamp 2>/dev/null)" != "$want" ]; then
  echo "setup: npm ci ($plugin)" >&2
  npm ci --no-audit --no-fund --loglevel=error >&2
  echo "$want" > node_modules/.install-stamp
fi
sources=$( (find src test scripts tsconfig.json package.json -type f -not -path 'src/gen/*' -print0; find ../../proto/ctxgate -name '*.proto' -print0) | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)
if [ ! -f dist/.build-stamp ] || [ "$(cat dist/.build-stamp)" != "$sources" ]; then
  echo "setup: build ($plugin)" >&2
  npm run --silent build >&2
  echo "$sources" > dist/.build-stamp
fi
