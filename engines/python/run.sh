#!/usr/bin/env bash
# Starts the Python context engine:  engines/python/run.sh --listen ADDR
# On first use it creates a venv (.venv) with the pinned packages and
# generates the gRPC code (gen/) from ../../proto; both are git-ignored.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$here/.venv"
gen="$here/gen"
proto="$here/../../proto"

setup() {
  if [ ! -x "$venv/bin/python" ] || [ "$here/requirements.txt" -nt "$venv/.installed" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$here/requirements.txt"
    touch "$venv/.installed"
  fi
  if [ ! -f "$gen/.stamp" ] || [ -n "$(find "$proto" -name '*.proto' -newer "$gen/.stamp")" ]; then
    rm -rf "$gen" && mkdir -p "$gen"
    "$venv/bin/python" -m grpc_tools.protoc -I "$proto" --python_out="$gen" --grpc_python_out="$gen" \
      "$proto"/contextengine/v1/*.proto
    touch "$gen/.stamp"
  fi
}

# Several engines may start at once (tests): one of them sets up, the others wait.
exec 9>"$here/.setup.lock"
flock 9
setup >&2
flock -u 9
exec "$venv/bin/python" "$here/engine.py" "$@"
