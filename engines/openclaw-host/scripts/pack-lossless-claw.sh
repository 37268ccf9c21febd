#!/usr/bin/env bash
# How vendor/martian-engineering-lossless-claw-0.15.3.tgz was made: the
# package's own release build, from the public repository's v0.15.3 tag,
# unmodified (the npm registry the project's machines reach serves no
# @martian-engineering/lossless-claw):
#   git clone https://github.com/Martian-Engineering/lossless-claw && cd lossless-claw
#   git checkout v0.15.3   (or v1.0.0-beta.4: the newest tag this machine can bring)
#   engines/openclaw-host/scripts/pack-lossless-claw.sh PATH/TO/lossless-claw
# It runs the package.json `build` script's three esbuild bundles (esbuild
# 0.28, @sinclair/typebox 0.34.48 as the package pins) and `npm pack`.
set -euo pipefail
src="$(cd "${1:?usage: pack-lossless-claw.sh CHECKOUT}" && pwd)"
out="$(cd "$(dirname "$0")/../vendor" && pwd)"
tools=$(mktemp -d)
trap 'rm -rf "$tools"' EXIT
(cd "$tools" && npm init -y >/dev/null && npm install --no-audit --no-fund --save-exact esbuild@0.28.2 @sinclair/typebox@0.34.48 >/dev/null)
cd "$src"
ln -sfn "$tools/node_modules" node_modules
trap 'rm -f "$src/node_modules"; rm -rf "$tools"' EXIT
esbuild="$tools/node_modules/.bin/esbuild"
common=(--bundle --platform=node --target=node22 --format=esm --minify-whitespace)
"$esbuild" index.ts "${common[@]}" --outfile=dist/index.js --external:openclaw '--external:@earendil-works/*'
"$esbuild" src/cli/migrate-sessions.ts "${common[@]}" --outfile=dist/migrate-sessions.js --external:openclaw '--external:@earendil-works/*'
"$esbuild" cli.ts "${common[@]}" --outfile=dist/cli.js
rm -f node_modules
npm pack --pack-destination "$out"
