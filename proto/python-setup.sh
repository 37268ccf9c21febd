#!/usr/bin/env bash
# Sets up a Python component of this repository:
#   proto/python-setup.sh DIR [--requirements FILE] [--path DIR]... PACKAGE...
# Creates DIR/.venv from DIR/requirements.txt (or FILE, relative to DIR) and
# generates the gRPC code and its type stubs (.pyi) of the given proto
# packages (e.g. contextengine/v1) into DIR/gen, each only when missing or out
# of date; both are git-ignored. DIR/gen and every --path (relative to DIR)
# go on the venv's import path (a .pth file), so scripts import
# `contextengine.v1` (and, with --path, the Python engine SDK) as packages.
# Runs under a lock in DIR, so several processes may start at once (tests):
# one sets up, the others wait.
set -euo pipefail
dir="$(cd "$1" && pwd)"
shift
requirements="$dir/requirements.txt"
paths=("$dir/gen")
while [ $# -gt 0 ]; do
  case "$1" in
    --requirements) requirements="$dir/$2"; shift 2 ;;
    --path) paths+=("$(cd "$dir/$2" && pwd)"); shift 2 ;;
    *) break ;;
  esac
done
proto="$(cd "$(dirname "$0")" && pwd)"
venv="$dir/.venv"
gen="$dir/gen"

# The requirements file and every file it includes (`-r`), as one digest: a
# change to any of them reinstalls.
digest() {
  local f="$1" base
  base="$(dirname "$f")"
  cat "$f"
  sed -n 's/^-r[[:space:]]*//p' "$f" | while read -r inc; do digest "$base/$inc"; done
}

exec 9>"$dir/.setup.lock"
flock 9
want="$(digest "$requirements" | sha256sum | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$venv/.installed" 2>/dev/null)" != "$want" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$requirements"
  echo "$want" >"$venv/.installed"
fi
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
printf '%s\n' "${paths[@]}" >"$site/ctxgate-paths.pth"
if [ ! -f "$gen/.stamp" ] || [ -n "$(find "$proto" -name '*.proto' -newer "$gen/.stamp")" ]; then
  rm -rf "$gen" && mkdir -p "$gen"
  files=()
  for p in "$@"; do files+=("$proto/$p"/*.proto); done
  "$venv/bin/python" -m grpc_tools.protoc -I "$proto" --python_out="$gen" --pyi_out="$gen" \
    --grpc_python_out="$gen" "${files[@]}"
  touch "$gen/.stamp"
fi
