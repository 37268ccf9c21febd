// Assemble latency at 1k and 10k messages: lossless-claw served by the
// OpenClaw host, side by side with the window engine, in one run.
//   engines/openclaw-host/bench/run.sh --window target/release/ctxgate-engine-window
// Each engine gets one session per size, its history delivered with
// IngestBatch (1000 messages a request), then Assemble is timed as the
// gateway sends it: the window engine is DELTA (a cursor plus the new user
// message), lossless-claw FULL (the whole history plus the new message).
import { spawn } from "node:child_process";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createInterface } from "node:readline";
import * as grpc from "@grpc/grpc-js";
import { engineService, messagesTokens } from "@ctxgate/engine-sdk";

const args = process.argv.slice(2);
const opt = (name, fallback) => {
  const i = args.indexOf(name);
  return i >= 0 ? args[i + 1] : fallback;
};
const windowBin = opt("--window");
const hostRun = opt("--host");
const sizes = opt("--sizes", "1000,10000").split(",").map(Number);
const budget = Number(opt("--budget", "8000"));
// The lossless-claw versions the host serves, each in a host of its own.
const plugins = opt(
  "--plugins",
  "@martian-engineering/lossless-claw@0.15.3,@martian-engineering/lossless-claw@1.0.0-beta.4",
).split(",").filter(Boolean);
if (!windowBin || !hostRun) {
  console.error(
    "usage: assemble.mjs --window PATH --host engines/openclaw-host/run.sh [--sizes 1000,10000] [--budget 8000] [--plugins SPEC,SPEC]",
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

const words = "the build failed on the integration step and we traced it to a stale cache entry in the runner".split(" ");
function history(n) {
  const t0 = Date.now() - n * 1000;
  return Array.from({ length: n }, (_, i) => ({
    id: `m${i}`,
    role: i % 2 === 0 ? "ROLE_USER" : "ROLE_ASSISTANT",
    createdAtUnixMs: t0 + i * 1000,
    content: [{ text: `#${i}: ${Array.from({ length: 28 }, (_, k) => words[(i * 7 + k) % words.length]).join(" ")}` }],
  }));
}

function percentile(sorted, p) {
  return sorted[Math.min(sorted.length - 1, Math.floor((p / 100) * sorted.length))];
}

async function measure(name, client, n, delta) {
  const session = `bench-${name}-${n}`;
  const h = history(n);
  for (let i = 0; i < n; i += 1000) {
    await call(client, "IngestBatch", { sessionId: session, sessionKey: session, messages: h.slice(i, i + 1000) });
  }
  const next = { id: `q${n}`, role: "ROLE_USER", createdAtUnixMs: Date.now(), content: [{ text: "what did we find about the cache?" }] };
  const request = delta
    ? { sessionId: session, sessionKey: session, messages: [next], tokenBudget: budget, cursor: { messageId: `m${n - 1}`, seq: n, messageCount: n, tokens: messagesTokens(h) } }
    : { sessionId: session, sessionKey: session, messages: [...h, next], tokenBudget: budget };
  const rounds = n >= 10_000 ? 60 : 300;
  let out;
  for (let i = 0; i < 5; i++) out = await call(client, "Assemble", request);
  const took = [];
  for (let i = 0; i < rounds; i++) {
    const t = process.hrtime.bigint();
    out = await call(client, "Assemble", request);
    took.push(Number(process.hrtime.bigint() - t) / 1e6);
  }
  took.sort((a, b) => a - b);
  return { name, n, rounds, p50: percentile(took, 50), p99: percentile(took, 99), kept: out.messages.length, tokens: out.estimatedTokens };
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
try {
  for (const n of sizes) {
    rows.push(await measure("window", clients.window, n, true));
    for (const h of hosts) rows.push(await measure(h.name, clients[h.name], n, false));
  }
} finally {
  for (const c of Object.values(clients)) c.close();
  windowEngine.child.kill("SIGTERM");
  for (const h of hosts) h.child.kill("SIGTERM");
}
console.log(`Assemble, budget ${budget} tokens, ${new Date().toISOString()}`);
console.log("| engine | messages | calls | p50 | p99 | kept | est. tokens |");
console.log("|---|---:|---:|---:|---:|---:|---:|");
for (const r of rows) console.log(`| ${r.name} | ${r.n} | ${r.rounds} | ${r.p50.toFixed(2)} ms | ${r.p99.toFixed(2)} ms | ${r.kept} | ${r.tokens} |`);
rmSync(dir, { recursive: true, force: true });
process.exit(0);
