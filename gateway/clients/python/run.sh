#!/usr/bin/env bash
# The Python harness client for ctxgate.
#   gateway/clients/python/run.sh example --gateway URL --model-url URL --session KEY --turns N [...]
#   gateway/clients/python/run.sh python SCRIPT [ARGS]   (any script using ctxgate_harness)
# On first use it creates a venv (.venv) with the pinned packages and
# generates the gRPC code (gen/) from ../../../proto; both are git-ignored.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$here/.venv"
gen="$here/gen"
proto="$here/../../../proto"

setup() {
  if [ ! -x "$venv/bin/python" ] || [ "$here/requirements.txt" -nt "$venv/.installed" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$here/requirements.txt"
    touch "$venv/.installed"
  fi
  if [ ! -f "$gen/.stamp" ] || [ -n "$(find "$proto" -name '*.proto' -newer "$gen/.stamp")" ]; then
    rm -rf "$gen" && mkdir -p "$gen"
    "$venv/bin/python" -m grpc_tools.protoc -I "$proto" --python_out="$gen" --grpc_python_out="$gen" \
      "$proto"/contextengine/v1/*.proto "$proto"/ctxgate/v1/*.proto
    touch "$gen/.stamp"
  fi
}

usage() {
  echo "usage: $0 example [example_agent.py flags] | python SCRIPT [ARGS]" >&2
  exit 2
}

[ $# -ge 1 ] || usage
cmd="$1"
shift
# Several clients may start at once (tests): one of them sets up, the others wait.
exec 9>"$here/.setup.lock"
flock 9
setup >&2
flock -u 9
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
case "$cmd" in
  example) exec "$venv/bin/python" "$here/example_agent.py" "$@" ;;
  python) exec "$venv/bin/python" "$@" ;;
  *) usage ;;
esac
