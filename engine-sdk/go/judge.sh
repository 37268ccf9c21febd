#!/usr/bin/env bash
# Builds a Go engine, starts it and runs the conformance kit against it:
#   engine-sdk/go/judge.sh PACKAGE [--unix] [--kit BINARY]
# PACKAGE is a package of this module (./examples/minimal) or the folder of
# your own engine's main package. It listens on 127.0.0.1:0 (--unix: on a
# unix socket) with a fresh --state-dir, the kit judges it, then SIGTERM
# drains it (the engine must exit 0). The kit is target/debug's
# ctxgate-conformance, built with cargo when missing.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
package="${1:?usage: judge.sh PACKAGE [--unix] [--kit BINARY]}"
shift
unix="" kit="$root/target/debug/ctxgate-conformance"
while [ $# -gt 0 ]; do
  case "$1" in
    --unix) unix=1 ;;
    --kit) kit="$2"; shift ;;
    *) echo "judge.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
export GOTOOLCHAIN=local
command -v go >/dev/null || [ ! -x /usr/local/go/bin/go ] || PATH="/usr/local/go/bin:$PATH"
if [ ! -x "$kit" ]; then
  (cd "$root" && cargo build -q -p ctxgate-engine-sdk --bin ctxgate-conformance)
fi

work="$(mktemp -d)"
pid=""
trap 'if [ -n "$pid" ]; then kill -TERM "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi; rm -rf "$work"' EXIT
if [ -d "$package" ] && [ -f "$package/go.mod" -o -n "$(cd "$package" && go list -m 2>/dev/null)" ]; then
  (cd "$package" && go build -o "$work/engine" .)
else
  (cd "$here" && go build -o "$work/engine" "$package")
fi
listen=127.0.0.1:0
[ -z "$unix" ] || listen="unix://$work/engine.sock"
"$work/engine" --listen "$listen" --state-dir "$work/state" >"$work/out" 2>"$work/log" &
pid=$!
line=""
for _ in $(seq 100); do
  line="$(head -n 1 "$work/out" 2>/dev/null || true)"
  [ -n "$line" ] && break
  kill -0 "$pid" 2>/dev/null || break
  sleep 0.1
done
case "$line" in
  "listening on "*) ;;
  *) echo "judge.sh: $package did not start:" >&2; cat "$work/log" >&2; exit 1 ;;
esac
addr="${line#listening on }"
case "$addr" in unix://*) ;; *) addr="http://$addr" ;; esac
echo "-- $package${unix:+ (unix socket)}: ctxgate-conformance --endpoint $addr"
status=0
"$kit" --endpoint "$addr" || status=$?
kill -TERM "$pid"
wait "$pid" || { echo "judge.sh: $package did not exit 0 after SIGTERM:" >&2; cat "$work/log" >&2; exit 1; }
pid=""
exit "$status"
