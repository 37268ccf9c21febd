#!/usr/bin/env bash
# Regenerates pb/ (the contract's Go code) from ../../proto/contextengine/v1:
#   engine-sdk/go/generate.sh
# protoc is the one the Rust build vendors (the protoc-bin-vendored crate in
# the cargo registry; `cargo fetch` brings it); protoc-gen-go and
# protoc-gen-go-grpc are this module's pinned tools (go.mod `tool`), built
# from the Go module proxy. The generated .pb.go files are committed, as Go
# modules ship them; `check.sh` fails when they are stale (it generates
# into GEN_OUT, a scratch module root, and compares).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${GEN_OUT:-$here}"
proto="$(cd "$here/../../proto" && pwd)"
export GOTOOLCHAIN=local
module="$(cd "$here" && go list -m)"

protoc="${PROTOC:-}"
if [ -z "$protoc" ]; then
  # The version Cargo.lock pins (the generated files name it), else the newest.
  version="$(awk '/^name = "protoc-bin-vendored-linux-x86_64"$/ { getline; gsub(/"/, "", $3); print $3 }' "$here/../../Cargo.lock")"
  protoc="$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/protoc-bin-vendored-linux-x86_64-"${version:-*}"/bin/protoc 2>/dev/null | sort -V | tail -n 1)"
fi
if [ ! -x "$protoc" ]; then
  echo "generate.sh: no protoc: run 'cargo fetch' at the repository root (it brings the protoc-bin-vendored crate) or set PROTOC" >&2
  exit 1
fi

bin="$here/.bin"
mkdir -p "$bin"
(cd "$here" && go build -o "$bin/protoc-gen-go" google.golang.org/protobuf/cmd/protoc-gen-go \
  && go build -o "$bin/protoc-gen-go-grpc" google.golang.org/grpc/cmd/protoc-gen-go-grpc)

files=(contextengine/v1/types.proto contextengine/v1/engine.proto contextengine/v1/host.proto)
maps=()
for f in "${files[@]}"; do maps+=("M$f=$module/pb;pb"); done
go_opts=("module=$module"); grpc_opts=("module=$module")
for m in "${maps[@]}"; do go_opts+=("$m"); grpc_opts+=("$m"); done
join() { local IFS=,; echo "$*"; }

rm -f "$out"/pb/*.pb.go
mkdir -p "$out/pb"
PATH="$bin:$PATH" "$protoc" -I "$proto" \
  --go_out="$out" --go_opt="$(join "${go_opts[@]}")" \
  --go-grpc_out="$out" --go-grpc_opt="$(join "${grpc_opts[@]}")" \
  "${files[@]}"
echo "generated $(ls "$out"/pb/*.pb.go | wc -l) files in $out/pb with $("$protoc" --version)"
