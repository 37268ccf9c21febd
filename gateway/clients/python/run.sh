#!/usr/bin/env bash
# The Python harness client for ctxgate.
#   gateway/clients/python/run.sh example --gateway URL --model-url URL --session KEY --turns N [...]
#   gateway/clients/python/run.sh python SCRIPT [ARGS]   (any script using ctxgate_harness)
# On first use it creates a venv (.venv) with the pinned packages and
# generates the gRPC code (gen/) from ../../../proto; both are git-ignored.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

usage() {
  echo "usage: $0 example [example_agent.py flags] | python SCRIPT [ARGS]" >&2
  exit 2
}

[ $# -ge 1 ] || usage
cmd="$1"
shift
"$here/../../../proto/python-setup.sh" "$here" contextengine/v1 ctxgate/v1 >&2
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
case "$cmd" in
  example) exec "$here/.venv/bin/python" "$here/example_agent.py" "$@" ;;
  python) exec "$here/.venv/bin/python" "$@" ;;
  *) usage ;;
esac
