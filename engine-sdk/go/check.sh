#!/usr/bin/env bash
# The Go SDK's checks, as CI runs them (tests/engines/sdk_go.rs starts it):
#   engine-sdk/go/check.sh [CONFORMANCE_BINARY]
# go vet; the committed pb/ matches what generate.sh makes from proto/;
# go test (with -race where cgo can build it); then the example engines are
# built and judged by the conformance kit (judge.sh): examples/recall over
# TCP and over a unix socket, examples/minimal (the one in the docs). Go
# modules come from the Go module proxy into the default module cache; the
# build and test caches make a second run fast.
# Runs under a lock, so two runs never race over the caches.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
kit="${1:-$root/target/debug/ctxgate-conformance}"
cd "$here"
export GOTOOLCHAIN=local GOFLAGS="${GOFLAGS:-} -mod=readonly"

exec 9>"$here/.check.lock"
flock 9

command -v go >/dev/null || [ ! -x /usr/local/go/bin/go ] || PATH="/usr/local/go/bin:$PATH"
command -v go >/dev/null || { echo "check.sh: no go on PATH (the polyglot machine has it in /usr/local/go/bin)" >&2; exit 1; }
echo "== $(go version)"

echo "== go vet"
go vet ./...

echo "== generated code"
if ls "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/protoc-bin-vendored-linux-x86_64-*/bin/protoc >/dev/null 2>&1; then
  scratch="$(mktemp -d)"
  trap 'rm -rf "$scratch"' EXIT
  GEN_OUT="$scratch" ./generate.sh >/dev/null
  if ! diff -r "$scratch/pb" pb >/dev/null; then
    echo "pb/ is stale: run engine-sdk/go/generate.sh and commit pb/" >&2
    diff -r "$scratch/pb" pb | head -20 >&2
    exit 1
  fi
  echo "pb/ is what generate.sh makes from proto/"
else
  echo "pb/ not compared: no vendored protoc in the cargo registry (cargo fetch brings it)"
fi

echo "== go test"
race=()
if [ "$(go env CGO_ENABLED)" = 1 ] && command -v "$(go env CC)" >/dev/null; then race=(-race); fi
go test "${race[@]}" ./...

echo "== conformance kit against the examples"
[ -x "$kit" ] || { echo "check.sh: no conformance kit at $kit (cargo build --workspace --bins)" >&2; exit 1; }
./judge.sh ./examples/recall --kit "$kit"
./judge.sh ./examples/recall --unix --kit "$kit"
./judge.sh ./examples/minimal --kit "$kit"
echo "check.sh: the Go SDK passes"
