// Assemble latency at 1k and 10k messages: lossless-claw served by the
// OpenClaw host, side by side with the window engine, in one run.
//   engines/openclaw-host/bench/run.sh --window target/release/ctxgate-engine-window
// Each engine gets one session per size, its history delivered with
// IngestBatch (1000 messages a request), then Assemble is timed as the
// gateway sends it: DELTA (a cursor plus the new user message) — and, for
// the host, FULL too (the whole history plus the new message), on the same
// session. The floor: the plugin called in-process (floor.mjs).
import { spawn } from "node:child_process";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createInterface } from "node:readline";
import * as grpc from "@grpc/grpc-js";
import { engineService, messagesTokens } from "@ctxgate/engine-sdk";
import { history, nextTurn, timed } from "./history.mjs";

const args = process.argv.slice(2);
const opt = (name, fallback) => {
  const i = args.indexOf(name);
  return i >= 0 ? args[i + 1] : fallback;
};
const windowBin = opt("--window");
const hostRun = opt("--host");
const sizes = opt("--sizes", "1000,10000").split(",").map(Number);
const budget = Number(opt("--budget", "8000"));
// Timed calls a measurement (default 300 at 1k, 60 at 10k).
const calls = opt("--calls");
const rounds = (n) => (calls ? Number(calls) : n >= 10_000 ? 60 : 300);
// The lossless-claw versions the host serves, each in a host of its own.
const plugins = opt(
  "--plugins",
  "@martian-engineering/lossless-claw@0.15.3,@martian-engineering/lossless-claw@1.0.0-beta.4",
).split(",").filter(Boolean);
if (!windowBin || !hostRun) {
  console.error(
    "usage: assemble.mjs --window PATH --host engines/openclaw-host/run.sh [--sizes 1000,10000] [--budget 8000] [--calls N] [--plugins SPEC,SPEC]",
  );
  process.exit(2);
}

function start(cmd, cmdArgs) {
  const child = spawn(cmd, cmdArgs, { stdio: ["ignore", "pipe", "ignore"] });
  return new Promise((resolve, reject) => {
    createInterface({ input: child.stdout }).once("line", (l) => resolve({ child, address: l.replace("listening on ", "") }));
    child.on("exit", (c) => reject(new Error(`${cmd} exited ${c}`)));
  });
}

function call(client, method, request, deadlineMs = 600_000) {
  const def = engineService[method];
  return new Promise((resolve, reject) =>
    client.makeUnaryRequest(def.path, def.requestSerialize, def.responseDeserialize, request, new grpc.Metadata(), { deadline: Date.now() + deadlineMs }, (e, v) =>
      e ? reject(new Error(`${method}: ${e.details}`)) : resolve(v),
    ),
  );
}

/** One session of `n` messages, delivered with IngestBatch. */
async function ingest(client, session, h) {
  for (let i = 0; i < h.length; i += 1000) {
    await call(client, "IngestBatch", { sessionId: session, sessionKey: session, messages: h.slice(i, i + 1000) });
  }
}

/** Assemble timed as the gateway sends it: DELTA (a cursor and the new
 * message) or FULL (the whole history and the new message). */
async function measure(name, client, session, h, delta) {
  const n = h.length;
  const next = nextTurn(n);
  const request = delta
    ? { sessionId: session, sessionKey: session, messages: [next], tokenBudget: budget, cursor: { messageId: `m${n - 1}`, seq: n, messageCount: n, tokens: messagesTokens(h) } }
    : { sessionId: session, sessionKey: session, messages: [...h, next], tokenBudget: budget };
  const r = await timed(rounds(n), () => call(client, "Assemble", request));
  return { name, n, rounds: r.rounds, p50: r.p50, p99: r.p99, kept: r.out.messages.length, tokens: r.out.estimatedTokens };
}

/** The plugin in-process, as OpenClaw calls it (floor.mjs, a process of its own). */
function floor(plugin, stateDir, config) {
  const script = new URL("./floor.mjs", import.meta.url).pathname;
  const args = [script, "--plugin", plugin, "--plugin-config", config, "--state-dir", stateDir, "--sizes", sizes.join(","), "--budget", String(budget), ...(calls ? ["--calls", calls] : [])];
  const child = spawn(process.execPath, args, { stdio: ["ignore", "pipe", "inherit"] });
  const rows = [];
  createInterface({ input: child.stdout }).on("line", (l) => rows.push({ name: `${plugin.split("/").pop()} (in-process)`, ...JSON.parse(l) }));
  return new Promise((resolve, reject) => child.on("exit", (c) => (c === 0 ? resolve(rows) : reject(new Error(`floor.mjs exited ${c}`)))));
}

const dir = mkdtempSync(join(tmpdir(), "assemble-bench-"));
writeFileSync(join(dir, "plugin.json"), JSON.stringify({ independentLogFile: { enabled: false } }));
const windowEngine = await start(windowBin, ["--listen", "127.0.0.1:0", "--state-dir", join(dir, "window")]);
const hosts = [];
for (const [i, plugin] of plugins.entries()) {
  const state = join(dir, `lcm-${i}`);
  const args = ["--plugin", plugin, "--plugin-config", join(dir, "plugin.json"), "--listen", "127.0.0.1:0"];
  hosts.push({ name: `${plugin.split("/").pop()} (host)`, ...(await start(hostRun, [...args, "--state-dir", state])) });
}
const options = { "grpc.max_send_message_length": 64 << 20, "grpc.max_receive_message_length": 64 << 20 };
const client = (address) => new grpc.Client(address, grpc.credentials.createInsecure(), options);
const clients = { window: client(windowEngine.address) };
for (const h of hosts) clients[h.name] = client(h.address);
const rows = [];
for (const [i, plugin] of plugins.entries()) rows.push(...(await floor(plugin, join(dir, `floor-${i}`), join(dir, "plugin.json"))));
try {
  for (const n of sizes) {
    const h = history(n);
    await ingest(clients.window, `bench-window-${n}`, h);
    rows.push(await measure("window", clients.window, `bench-window-${n}`, h, true));
    for (const host of hosts) {
      const session = `bench-host-${n}`;
      await ingest(clients[host.name], session, h);
      rows.push(await measure(`${host.name}, DELTA`, clients[host.name], session, h, true));
      rows.push(await measure(`${host.name}, FULL`, clients[host.name], session, h, false));
    }
  }
} finally {
  for (const c of Object.values(clients)) c.close();
  windowEngine.child.kill("SIGTERM");
  for (const h of hosts) h.child.kill("SIGTERM");
}
console.log(`Assemble, budget ${budget} tokens, ${new Date().toISOString()}`);
console.log("| engine | messages | calls | p50 | p99 | kept | est. tokens |");
console.log("|---|---:|---:|---:|---:|---:|---:|");
rows.sort((a, b) => a.n - b.n);
for (const r of rows) console.log(`| ${r.name} | ${r.n} | ${r.rounds} | ${r.p50.toFixed(2)} ms | ${r.p99.toFixed(2)} ms | ${r.kept} | ${r.tokens} |`);
rmSync(dir, { recursive: true, force: true });
process.exit(0);
