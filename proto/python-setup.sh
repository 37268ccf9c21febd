#!/usr/bin/env bash
# Sets up a Python component of this repository:  proto/python-setup.sh DIR PACKAGE...
# Creates DIR/.venv from DIR/requirements.txt and generates the gRPC code of
# the given proto packages (e.g. contextengine/v1) into DIR/gen, each only
# when missing or out of date; both are git-ignored. Runs under a lock in DIR,
# so several processes may start at once (tests): one sets up, the others wait.
set -euo pipefail
dir="$(cd "$1" && pwd)"
shift
proto="$(cd "$(dirname "$0")" && pwd)"
venv="$dir/.venv"
gen="$dir/gen"

exec 9>"$dir/.setup.lock"
flock 9
if [ ! -x "$venv/bin/python" ] || [ "$dir/requirements.txt" -nt "$venv/.installed" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$dir/requirements.txt"
  touch "$venv/.installed"
fi
if [ ! -f "$gen/.stamp" ] || [ -n "$(find "$proto" -name '*.proto' -newer "$gen/.stamp")" ]; then
  rm -rf "$gen" && mkdir -p "$gen"
  files=()
  for p in "$@"; do files+=("$proto/$p"/*.proto); done
  "$venv/bin/python" -m grpc_tools.protoc -I "$proto" --python_out="$gen" --grpc_python_out="$gen" "${files[@]}"
  touch "$gen/.stamp"
fi
