#!/usr/bin/env bash
# The ctxgate plugin for OpenClaw (engines/openclaw-plugin) in the real
# openclaw@2026.9.6, headless (`openclaw agent --local`, a local fake
# model), against `ctxgate serve` whose engine is ENGINE — the window engine
# (the default: every step below), the Python engine or lossless-claw
# 1.0.0-beta.4 under the plugin host (step 1):
#   1. two turns, answered by the fake model through the plugin; the
#      gateway's copy of the session equals OpenClaw's transcript (roles,
#      order, each turn's terminal entry id) and the engine got each turn's
#      CommitTurn once (check.mjs, the gateway's status);
#   2. the engine killed (-9) between two turns: the next turn is answered
#      (the gateway's legacy engine), the plugin says so on OpenClaw's
#      console, OpenClaw does not quarantine the plugin;
#   3. the engine restarted on its address and state: the gateway re-admits
#      it and the turn after uses it — its state holds every turn, the one
#      it missed delivered from the gateway's outbox — without restarting
#      anything of OpenClaw — that turn calls an engine tool: the model,
#      offered history_search, calls it and its answer quotes what the
#      engine found (turn 1's words); the gateway holds the call and its
#      result once, as OpenClaw does.
#   With the Python engine, turn 1 runs before the plugin does (OpenClaw's
#   own engine) and turn 2 through it: the plugin imports turn 1 into the
#   gateway first, and the checks of step 1 hold for both turns.
#   tests/openclaw-plugin/run.sh [window|python|lossless]
# Installs what it needs (tests/openclaw-probe/setup-openclaw.sh, the
# plugin's setup, its unit tests); uses the built `ctxgate` and
# `ctxgate-engine-window` (the folder of $CTXGATE_BIN, else of
# $CTXGATE_CONFORMANCE, else target/debug). Runs in a network namespace of
# its own (loopback only) when `unshare -rn` works. Files of the last run:
# target/openclaw-plugin/last-run/. Closing line: `openclaw-plugin: ok …`.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
ENGINE="${ENGINE:-${1:-window}}"
case "$ENGINE" in window | python | lossless) ;; *) echo "run.sh: no engine $ENGINE (window, python, lossless)" >&2; exit 2 ;; esac
run="$repo/target/openclaw-plugin/last-run-$ENGINE"
LIMIT=${OPENCLAW_PLUGIN_LIMIT:-900}
SESSION=agent:main:plugin

if [ "${2:-}" = "--inside" ]; then
  pids=()
  cleanup() {
    local i
    for ((i = ${#pids[@]} - 1; i >= 0; i--)); do kill "${pids[i]}" 2>/dev/null || true; done
    for ((i = ${#pids[@]} - 1; i >= 0; i--)); do wait "${pids[i]}" 2>/dev/null || true; done
  }
  trap cleanup EXIT
  trap 'exit 143' TERM INT HUP
  [ "${3:-}" = "netns" ] && ip link set lo up
  fail() {
    echo "run.sh: $1" >&2
    shift
    for f in "$@"; do [ -f "$f" ] && { echo "--- $f (last 40 lines)" >&2; tail -n 40 "$f" >&2; }; done
    exit 1
  }
  listening() {
    local i
    for ((i = 0; i < $2 * 5; i++)); do
      if grep -q '^listening on ' "$1" 2>/dev/null; then sed -n 's/^listening on //p' "$1" | head -1; return 0; fi
      sleep 0.2
    done
    return 1
  }
  free_port() { node -e 'const s=require("net").createServer().listen(0,"127.0.0.1",()=>{console.log(s.address().port);s.close()})'; }

  node "$repo/tests/openclaw-probe/fake-model.mjs" > "$run/model.out" 2> "$run/model.err" &
  pids+=($!)
  model=$(listening "$run/model.out" 20) || fail "the fake model did not start" "$run/model.err"

  engine_addr="127.0.0.1:$(free_port)"
  engine_pid=""
  start_engine() {
    echo '{ "independentLogFile": { "enabled": false } }' > "$run/lossless.json"
    # exec: the background job is the engine itself, so killing it kills the engine.
    case "$ENGINE" in
      # One turn kept, three more before a compaction: it folds its older turns into its summary at turn 5.
      window) exec "$BIN/ctxgate-engine-window" --listen "$engine_addr" --state-dir "$run/engine" --keep-turns 1 --auto-compact-after 3 ;;
      python) exec "$repo/engines/python/run.sh" --listen "$engine_addr" --state-dir "$run/engine" ;;
      lossless)
        exec "$repo/engines/openclaw-host/run.sh" --plugin "$LOSSLESS" --plugin-config "$run/lossless.json" \
          --listen "$engine_addr" --state-dir "$run/engine" ;;
    esac > "$run/engine.out" 2>> "$run/engine.err" &
    engine_pid=$!
    pids+=($engine_pid)
    listening "$run/engine.out" 120 > /dev/null || fail "the $ENGINE engine did not start" "$run/engine.err"
  }
  start_engine
  # The gateway's model (models.*) is the fake one: an engine's LlmComplete reaches it.
  cat > "$run/gateway.json5" <<JSON
{
  models: { provider: "openai", baseUrl: "http://$model/v1", apiKey: "sk-local", model: "fake-model" },
  plugins: {
    slots: { contextEngine: "$ENGINE" },
    entries: { $ENGINE: { endpoint: "http://$engine_addr", timeouts: { default: 60 } } },
  },
}
JSON
  gateway_pid=""
  start_gateway() { # $1: the address to listen on; sets gateway (its address) and gateway_pid
    "$BIN/ctxgate" serve --config "$run/gateway.json5" --listen "$1" --state-dir "$run/gateway-state" \
      > "$run/gateway.out" 2>> "$run/gateway.err" &
    gateway_pid=$!
    pids+=($gateway_pid)
    gateway=$(listening "$run/gateway.out" 60) || fail "ctxgate serve did not start" "$run/gateway.err"
  }
  start_gateway 127.0.0.1:0
  status() { # $1: a JS expression over s (the status) and e (the engine, by its entry id)
    timeout --foreground 20 "$BIN/ctxgate" status --gateway "http://$gateway" --json 2>/dev/null |
      ENGINE="$ENGINE" node -e 'let t="";process.stdin.on("data",d=>t+=d).on("end",()=>{const s=JSON.parse(t);const e=(s.engines||[]).find(x=>x.id===process.env.ENGINE)||{};console.log(String(eval(process.argv[1])))})' "$1" || true
  }
  calls() { status "((e.methods||[]).find(m=>m.method===\"$1\")||{calls:0}).calls"; }

  cat > "$run/openclaw.json5" <<JSON
{
  models: {
    mode: "replace",
    providers: {
      local: {
        baseUrl: "http://$model/v1",
        apiKey: "sk-local",
        api: "openai-completions",
        models: [{ id: "fake-model", name: "Fake model", reasoning: false, input: ["text"],
          cost: { input: 0, output: 0, cacheRead: 0, cacheWrite: 0 }, contextWindow: 128000, maxTokens: 1024 }],
      },
    },
  },
  agents: { defaults: { model: { primary: "local/fake-model" } } },
  plugins: {
    load: { paths: ["$repo/engines/openclaw-plugin"] },
    slots: { contextEngine: "ctxgate" },
    entries: { ctxgate: { enabled: true, config: { endpoint: "$gateway", timeouts: { assembleMs: 20000 } } } },
  },
}
JSON
  # OpenClaw before the plugin: the plugin off, OpenClaw's own context engine.
  sed 's/slots: { contextEngine: "ctxgate" },//; s/enabled: true/enabled: false/' "$run/openclaw.json5" > "$run/openclaw-before.json5"
  mkdir -p "$run/home"
  turn() { # $1: the turn's number; $2: its message; $3: what the answer holds. BEFORE=1: without the plugin
    local out="$run/turn$1.log" start=$SECONDS config="$run/openclaw.json5"
    [ -n "${BEFORE:-}" ] && config="$run/openclaw-before.json5"
    HOME="$run/home" XDG_CACHE_HOME="$run/home/.cache" OPENCLAW_CONFIG_PATH="$config" \
      OPENCLAW_STATE_DIR="$run/openclaw-state" NO_COLOR=1 \
      timeout --foreground --kill-after=10 180 "$OPENCLAW" agent --local --session-key "$SESSION" \
      --message "${2:-Turn $1 of the plugin test: please note it.}" --timeout 120 > "$out" 2>&1 ||
      fail "openclaw agent --local (turn $1) failed" "$out" "$run/gateway.err"
    grep -q "${3:-the probe heard you}" "$out" || fail "turn $1 was not answered as expected (${3:-the probe heard you})" "$out" "$run/gateway.err" "$run/model.err"
    if [ -n "${BEFORE:-}" ]; then
      ! grep -q 'context engine "ctxgate"' "$out" || fail "turn $1 ran with the plugin" "$out"
    else
      grep -q 'context engine "ctxgate" owns compaction' "$out" || fail "turn $1 did not run on the plugin's engine" "$out"
    fi
    echo "turn $1: answered in $((SECONDS - start)) s${BEFORE:+ (before the plugin)}"
  }
  sql() { # $1: an SQLite file; $2: a query: the first column of its first row
    node -e 'const {DatabaseSync}=require("node:sqlite");const r=new DatabaseSync(process.argv[1],{readOnly:true}).prepare(process.argv[2]).get();console.log(r?Object.values(r)[0]:"")' "$1" "$2"
  }
  settled() { # the gateway's turns are done and its outbox empty
    local w
    for ((w = 0; w < 100; w++)); do
      [ "$(status 's.turns_in_flight===0 && s.outbox_queued===0')" = true ] && return 0
      sleep 0.3
    done
    fail "the gateway never settled (turns in flight or commits queued)" "$run/gateway.err"
  }

  for ((w = 0; ; w++)); do
    [ "$(status 'e.health==="SERVING" && e.quarantine===null')" = true ] && break
    [ $w -lt 200 ] || fail "the gateway never attached the $ENGINE engine" "$run/gateway.err" "$run/engine.err"
    sleep 0.3
  done
  db="$run/openclaw-state/agents/main/agent/openclaw-agent.sqlite"
  first=2 imported=0
  [ "$ENGINE" = python ] && imported=1
  echo "== $first turns through the plugin ($ENGINE engine)$([ $imported = 1 ] && echo ", turn 1 before it")"
  BEFORE=$([ $imported = 1 ] && echo 1) turn 1 "Turn 1 of the plugin test: please note it. The codeword is heliotrope."
  for ((t = 2; t <= first; t++)); do turn $t; done
  if [ $imported = 1 ]; then
    grep -q "ctxgate: imported 1 earlier turn(s) of $SESSION (2 messages) into the gateway" "$run/turn2.log" ||
      fail "turn 2 did not import turn 1 into the gateway" "$run/turn2.log" "$run/gateway.err"
  fi
  settled
  node "$here/check.mjs" "$db" "$SESSION" "$gateway" "$ENGINE" "$run/engine" $first $imported || fail "the copies differ" "$run/gateway.err"
  # Each turn told once: CommitTurn to a durable engine, AfterTurn to the Python one.
  told=CommitTurn
  [ "$ENGINE" = python ] && told=AfterTurn
  [ "$(calls $told)" = $first ] || fail "the engine got $(calls $told) $told calls for $first turns" "$run/gateway.err"
  [ "$(status 'e.quarantine===null && (e.methods||[]).every(m=>m.failures===0&&m.fallbacks===0)')" = true ] ||
    fail "the engine failed or fell back" "$run/gateway.err" "$run/engine.err"
  if [ "$ENGINE" != window ]; then
    echo "openclaw-plugin: ok ($first turns on the $ENGINE engine)"
    exit 0
  fi

  echo "== the engine killed between two turns"
  kill -9 "$engine_pid"
  wait "$engine_pid" 2>/dev/null || true
  turn 3
  grep -q 'ctxgate: Context engine "window" degraded to "legacy"' "$run/turn3.log" ||
    fail "turn 3 fell back without a word on OpenClaw's console" "$run/turn3.log"

  echo "== the engine restarted: re-admitted, used again (its tool answers), holding every turn"
  start_engine
  for ((w = 0; ; w++)); do
    [ "$(status 'e.quarantine===null && e.health==="SERVING"')" = true ] && break
    [ $w -lt 300 ] || fail "the gateway never re-admitted the restarted engine" "$run/gateway.err" "$run/engine.err"
    sleep 0.3
  done
  # The fake model calls history_search when it is offered and the user asks;
  # its answer quotes the tool's result, which holds turn 1's words.
  turn 4 "Search history for heliotrope." "History says: .*codeword is .heliotrope"
  grep -q "calls history_search" "$run/model.err" || fail "the model was never offered history_search" "$run/model.err"
  settled
  [ "$(calls CallTool)" = 1 ] || fail "the engine ran $(calls CallTool) tool calls, not 1" "$run/gateway.err"
  node "$here/check.mjs" "$db" "$SESSION" "$gateway" "$ENGINE" "$run/engine" 4 || fail "the copies differ after the restart" "$run/gateway.err"

  echo "== the engine's summary from a model: its LlmComplete answered by the gateway's (models.*)"
  turn 5
  settled
  summary=$(sql "$run/engine/window.sqlite" "SELECT summary FROM summaries")
  case "$summary" in "Summary by the fake model: "*) ;; *) fail "the engine's summary did not come from the gateway's model: ${summary:0:200}" "$run/engine.err" "$run/model.err" ;; esac
  grep -q "says Summary by the fake model" "$run/model.err" || fail "the fake model never wrote a summary" "$run/model.err"

  echo "== the gateway down: OpenClaw's own messages answer (onGatewayDown: fallback), the commit waits in OpenClaw's outbox"
  kill "$gateway_pid"
  wait "$gateway_pid" 2>/dev/null || true
  turn 6
  grep -q "ctxgate: assemble could not reach an answer from the gateway at $gateway" "$run/turn6.log" ||
    fail "turn 6 fell back without a word on OpenClaw's console" "$run/turn6.log"

  echo "== the gateway back on its address: OpenClaw's outbox delivers turn 6 first, then turn 7 runs through it"
  start_gateway "$gateway"
  turn 7
  settled
  node "$here/check.mjs" "$db" "$SESSION" "$gateway" "$ENGINE" "$run/engine" 7 || fail "the copies differ after the gateway's return" "$run/gateway.err"

  echo "== subagents: the plugin's prepareSubagentSpawn / onSubagentEnded / rollback at the gateway"
  node "$here/subagents.mjs" "$gateway" "$SESSION" || fail "the subagent calls did not reach the gateway as they should" "$run/gateway.err"
  spawns=$(sql "$run/engine/window.sqlite" "SELECT COUNT(*) FROM spawns")
  [ "$spawns" = 0 ] || fail "the engine still holds $spawns spawn records after both children ended" "$run/engine.err"
  echo "openclaw-plugin: ok (7 turns on the window engine, killed and re-admitted, one engine tool call, a summary from the gateway's model, the gateway down and back, subagents)"
  exit 0
fi

LOSSLESS=@martian-engineering/lossless-claw@1.0.0-beta.4
mkdir -p "$(dirname "$run")"
exec 8>"$(dirname "$run")/.run.lock"
flock 8
start=$SECONDS
nodebin="$("$repo/tests/openclaw-probe/setup-openclaw.sh")"
export PATH="$nodebin:$PATH"
OPENCLAW="$repo/target/openclaw-probe/openclaw/node_modules/.bin/openclaw"
timeout 900 "$repo/engines/openclaw-plugin/scripts/setup.sh"
echo "== the plugin's own tests"
(cd "$repo/engines/openclaw-plugin" && node --test --test-reporter=spec dist/test/*.test.js) 2>&1 | grep -E "^ℹ (pass|fail)"
BIN="$(dirname "${CTXGATE_BIN:-${CTXGATE_CONFORMANCE:-$repo/target/debug/ctxgate}}")"
for b in ctxgate ctxgate-engine-window; do
  [ -x "$BIN/$b" ] || { echo "run.sh: no $b in $BIN (cargo build -p ctxgate -p ctxgate-engine-window)" >&2; exit 1; }
done
# What the engines install on first use happens here: the namespace has no way out.
case "$ENGINE" in
  python) "$repo/proto/python-setup.sh" "$repo/engines/python" --path ../../engine-sdk/python contextengine/v1 >&2 ;;
  lossless) timeout 900 "$repo/engines/openclaw-host/run.sh" --install-only --plugin "$LOSSLESS" > /dev/null ;;
esac
export BIN OPENCLAW run ENGINE LOSSLESS
echo "setup took $((SECONDS - start)) s; node $(node --version); binaries from $BIN"
rm -rf "$run"
mkdir -p "$run"
set +e
if command -v ip >/dev/null 2>&1 && unshare -rn true 2>/dev/null; then
  echo "in a network namespace of its own (loopback only)"
  timeout --kill-after=15 "$LIMIT" unshare -rn bash "$0" "$ENGINE" --inside netns 8>&-
else
  timeout --kill-after=15 "$LIMIT" bash "$0" "$ENGINE" --inside 8>&-
fi
rc=$?
set -e
[ $rc -eq 124 ] && echo "run.sh: not done within $LIMIT s (OPENCLAW_PLUGIN_LIMIT)" >&2
echo "run.sh: $((SECONDS - start)) s in all"
exit $rc
