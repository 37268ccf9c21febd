// The time OpenClaw spends in its context engine per turn: this plugin
// (its engine, over gRPC to `ctxgate serve`, whose engine is the window
// engine, each a process of its own) against OpenClaw's in-process
// `legacy` engine (the real one, from openclaw@2026.9.6's dist), on the
// same turns, in one run (docs/benchmarks.md):
//   engines/openclaw-plugin/bench/run.sh [--bin target/release] [--turns 300]
// Each engine is driven as OpenClaw's embedded runner drives it: before
// the prompt, assemble({sessionId, sessionKey, messages: the history so
// far, tokenBudget, prompt, ...}); after the reply, commitTurn with the
// turn's messages and an advancement key (legacy has no commitTurn:
// OpenClaw stores the turn itself, outside the engine, for both). The
// session grows by one user and one assistant message a turn, so the last
// turns carry the longest history. Prints p50/p99/max per engine and call,
// and the plugin's per-turn total over the legacy one's.
import { spawn } from "node:child_process";
import { mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";
import { parseConfig } from "../dist/src/config.js";
import { CtxgateEngine } from "../dist/src/engine.js";
import { KnownSessions } from "../dist/src/history.js";
import { connect } from "../dist/src/gateway.js";
import { EngineTools } from "../dist/src/tools.js";

const here = dirname(fileURLToPath(import.meta.url));
const args = process.argv.slice(2);
const opt = (name, fallback) => {
  const i = args.indexOf(name);
  return i >= 0 ? args[i + 1] : fallback;
};
const bin = opt("--bin");
const openclawDist = opt("--openclaw-dist");
const turns = Number(opt("--turns", "300"));
const warmup = Number(opt("--warmup", "20"));
if (!bin || !openclawDist || !(turns > 0)) {
  console.error("usage: overhead.mjs --bin DIR --openclaw-dist DIR [--turns 300] [--warmup 20]");
  process.exit(2);
}

/** Starts a process that prints `listening on ADDR`; its address. */
function start(cmd, cmdArgs, children) {
  const child = spawn(cmd, cmdArgs, { stdio: ["ignore", "pipe", "inherit"], env: { ...process.env, RUST_LOG: "warn" } });
  children.push(child);
  return new Promise((resolve, reject) => {
    createInterface({ input: child.stdout }).on("line", (l) => {
      if (l.startsWith("listening on ")) resolve(l.slice("listening on ".length).trim());
    });
    child.on("exit", (c) => reject(new Error(`${cmd} exited ${c}`)));
  });
}

/**
 * OpenClaw's own legacy engine: its dist registers it into the active
 * plugin registry, so the bench installs an empty registry first, as
 * OpenClaw does at start. The bundle's file names are hashed; the modules
 * are found by what they define, the functions by their names.
 */
async function openclawLegacy(dist) {
  const files = readdirSync(dist).filter((f) => f.endsWith(".mjs"));
  const load = async (defines, name) => {
    const file = files.find((f) => readFileSync(join(dist, f), "utf8").includes(defines));
    if (!file) throw new Error(`no module of ${dist} defines ${defines}`);
    const fn = Object.values(await import(join(dist, file))).find((v) => typeof v === "function" && v.name === name);
    if (!fn) throw new Error(`${file} exports no ${name}`);
    return fn;
  };
  const setActive = await load("function setActivePluginRegistry(", "setActivePluginRegistry");
  const empty = await load("function createEmptyPluginRegistry(", "createEmptyPluginRegistry");
  const init = await load("function ensureContextEnginesInitialized(", "ensureContextEnginesInitialized");
  const registration = await load("function getContextEngineRegistration(", "getContextEngineRegistration");
  setActive(empty());
  init();
  const engine = await registration("legacy").factory({});
  if (engine.info?.id !== "legacy") throw new Error("not OpenClaw's legacy engine");
  return engine;
}

const words = "the build failed on the integration step and we traced it to a stale cache entry in the runner".split(" ");
const text = (i) => `#${i}: ${Array.from({ length: 28 }, (_, k) => words[(i * 7 + k) % words.length]).join(" ")}`;
const user = (i) => ({ role: "user", content: text(2 * i), timestamp: Date.now() });
const assistant = (i) => ({
  role: "assistant",
  content: [{ type: "text", text: text(2 * i + 1) }],
  api: "openai-completions",
  provider: "local",
  model: "bench",
  usage: { input: 0, output: 0, cacheRead: 0, cacheWrite: 0, totalTokens: 0, cost: { input: 0, output: 0, cacheRead: 0, cacheWrite: 0, total: 0 } },
  stopReason: "stop",
  timestamp: Date.now(),
});

/** One session of `engine`, driven a turn at a time; each turn's assemble and commit times (ms). */
function driver(name, engine) {
  const sessionId = `bench-${name}-${process.pid}`;
  const sessionKey = `agent:main:bench-${name}-${process.pid}`;
  const messages = [];
  const times = { assemble: [], commit: [], turn: [] };
  const step = async (i) => {
    const prompt = user(i);
    const t0 = performance.now();
    const assembled = await engine.assemble({
      sessionId,
      sessionKey,
      messages: [...messages],
      tokenBudget: 100_000,
      availableTools: new Set(["read", "exec"]),
      model: "bench",
      prompt: prompt.content,
    });
    const t1 = performance.now();
    if (!Array.isArray(assembled.messages)) throw new Error(`${name}: assemble answered no messages`);
    const turn = [prompt, assistant(i)];
    messages.push(...turn);
    if (engine.commitTurn) {
      const r = await engine.commitTurn({ sessionId, sessionKey, messages: turn, advancementKey: `${sessionId}:${i}`, terminal: { entryId: `e${i}` } });
      if (r.status !== "committed") throw new Error(`${name}: turn ${i} ${r.status}`);
    }
    const t2 = performance.now();
    if (i >= warmup) {
      times.assemble.push(t1 - t0);
      times.commit.push(t2 - t1);
      times.turn.push(t2 - t0);
    }
  };
  return { step, times };
}

const pct = (xs, p) => {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.floor((p / 100) * s.length))];
};
const ms = (x) => (x < 0.01 ? `${(x * 1000).toFixed(1)} µs` : `${x.toFixed(2)} ms`);

const children = [];
const dir = mkdtempSync(join(tmpdir(), "ctxgate-plugin-bench-"));
try {
  const engineAddr = await start(join(bin, "ctxgate-engine-window"), ["--listen", "127.0.0.1:0", "--state-dir", join(dir, "engine")], children);
  writeFileSync(
    join(dir, "gateway.json5"),
    `{ plugins: { slots: { contextEngine: "window" }, entries: { window: { endpoint: "http://${engineAddr}" } } } }`,
  );
  const gatewayAddr = await start(
    join(bin, "ctxgate"),
    ["serve", "--config", join(dir, "gateway.json5"), "--listen", "127.0.0.1:0", "--state-dir", join(dir, "gateway")],
    children,
  );
  const config = parseConfig({ endpoint: gatewayAddr }, {}, () => Buffer.alloc(0));
  const gateway = connect(config);
  const quiet = { info: () => {}, warn: (m) => console.error(m) };
  const plugin = new CtxgateEngine(gateway, config, quiet, new Map(), new EngineTools(() => ({ tools: [] }), quiet.warn), new KnownSessions());
  // Until the gateway has attached its engine, its turns fall back: wait for a served one.
  for (let i = 0; ; i++) {
    const r = await plugin.assemble({ sessionId: "probe", sessionKey: "agent:main:probe", messages: [], tokenBudget: 8_000, prompt: "hello" });
    await plugin.commitTurn({ sessionId: "probe", sessionKey: "agent:main:probe", messages: [user(0), assistant(0)], advancementKey: `probe:${i}` });
    if (r.systemPromptAddition || i > 50) break;
    await new Promise((res) => setTimeout(res, 100));
  }
  const legacy = await openclawLegacy(openclawDist);

  console.log(`OpenClaw's time in its context engine per turn, ${turns} turns (after ${warmup}), history growing to ${2 * (warmup + turns)} messages`);
  // Turn by turn, alternately first, so neither engine gets the quieter part of the run.
  const drivers = { legacy: driver("legacy", legacy), ctxgate: driver("ctxgate", plugin) };
  for (let i = 0; i < warmup + turns; i++) {
    const order = i % 2 ? [drivers.legacy, drivers.ctxgate] : [drivers.ctxgate, drivers.legacy];
    for (const d of order) await d.step(i);
  }
  const results = { legacy: drivers.legacy.times, ctxgate: drivers.ctxgate.times };
  console.log("| engine | assemble p50 | p99 | commitTurn p50 | p99 | turn p50 | p99 | max |");
  console.log("|---|---|---|---|---|---|---|---|");
  for (const [name, t] of Object.entries(results)) {
    console.log(
      `| ${name === "legacy" ? "OpenClaw legacy (in process)" : "ctxgate plugin → gateway → window engine"} | ${ms(pct(t.assemble, 50))} | ${ms(pct(t.assemble, 99))} | ${name === "legacy" ? "—" : ms(pct(t.commit, 50))} | ${name === "legacy" ? "—" : ms(pct(t.commit, 99))} | ${ms(pct(t.turn, 50))} | ${ms(pct(t.turn, 99))} | ${ms(Math.max(...t.turn))} |`,
    );
  }
  const extra = (p) => pct(results.ctxgate.turn, p) - pct(results.legacy.turn, p);
  console.log(`the plugin adds ${ms(extra(50))} a turn at p50, ${ms(extra(99))} at p99`);
  // Every measured turn was the window engine's, none the gateway's fallback.
  const status = await new Promise((res, rej) => gateway.gateway.GetStatus({}, gateway.metadata(), (e, v) => (e ? rej(e) : res(v))));
  const window = status.engines.find((e) => e.id === "window");
  const calls = Object.fromEntries((window?.methods ?? []).map((m) => [m.method, m]));
  const fellBack = (window?.methods ?? []).reduce((n, m) => n + m.fallbacks + m.failures, 0);
  console.log(`window engine: ${calls.Assemble?.calls ?? 0} Assemble, ${calls.CommitTurn?.calls ?? 0} CommitTurn, ${fellBack} failed or fell back`);
  if (fellBack > 0 || (calls.Assemble?.calls ?? 0) < warmup + turns) throw new Error("turns were not all served by the window engine");
  gateway.close();
} finally {
  for (const c of children.reverse()) c.kill("SIGTERM");
  rmSync(dir, { recursive: true, force: true });
}
