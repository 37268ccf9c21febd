#!/usr/bin/env bash
# Installs (npm ci, only when package-lock.json or Node changed) and builds
# (types generated from ../../proto, then tsc --strict, only when a source
# changed) the TypeScript SDK, under a lock so two callers cannot race.
# Expects `node` and `npm` on PATH (scripts/node.sh finds them).
set -euo pipefail
sdk="$(cd "$(dirname "$0")/.." && pwd)"
cd "$sdk"
exec 8>"$sdk/.setup.lock"
flock 8
want="$(sha256sum package-lock.json | cut -c1-16)"
if [ ! -d node_modules ] || [ "$(cat node_modules/.install-stamp 2>/dev/null)" != "$want" ]; then
  echo "setup: npm ci ($sdk)" >&2
  npm ci --no-audit --no-fund --loglevel=error >&2
  echo "$want" > node_modules/.install-stamp
fi
sources=$(find src example test scripts otlp ../../proto/contextengine tsconfig.json package.json \
  -type f -not -path 'src/gen/*' -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)
if [ ! -f dist/.build-stamp ] || [ "$(cat dist/.build-stamp)" != "$sources" ]; then
  echo "setup: build ($sdk)" >&2
  npm run --silent build >&2
  echo "$sources" > dist/.build-stamp
fi
