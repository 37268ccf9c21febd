// Engines as processes, through the shared command line: one
// `listening on` line, the unix socket's mode, the health subcommand,
// flag mistakes, SIGTERM drain, SIGHUP certificate reload, and the
// example engine's durable DELTA state and tool.
import assert from "node:assert/strict";
import { type ChildProcess, spawn, spawnSync } from "node:child_process";
import { copyFileSync, readFileSync, statSync } from "node:fs";
import { join } from "node:path";
import { createInterface } from "node:readline";
import { connect } from "node:tls";
import { describe, test } from "node:test";
import * as grpc from "@grpc/grpc-js";
import { checkHealth, gapOf, PACKAGE_ROOT_FOR_TESTS } from "./sdk.js";
import { certificates, engineClient, sleep, tempDir, unary } from "./helpers.js";

const EXAMPLE = join(PACKAGE_ROOT_FOR_TESTS, "dist", "example", "main.js");
const PROBE = join(PACKAGE_ROOT_FOR_TESTS, "dist", "test", "fixtures", "probe-engine.js");

interface Running {
  child: ChildProcess;
  address: string;
  lines: string[];
  exited: Promise<number | null>;
}

async function start(script: string, args: string[]): Promise<Running> {
  const child = spawn(process.execPath, [script, ...args], { stdio: ["ignore", "pipe", "inherit"] });
  const lines: string[] = [];
  const exited = new Promise<number | null>((r) => child.on("exit", (code) => r(code)));
  const first = await new Promise<string>((resolve, reject) => {
    const rl = createInterface({ input: child.stdout! });
    rl.on("line", (l) => {
      lines.push(l);
      if (lines.length === 1) resolve(l);
    });
    child.on("exit", (code) => reject(new Error(`exited ${code} before listening`)));
  });
  assert.match(first, /^listening on /);
  return { child, address: first.slice("listening on ".length), lines, exited };
}

const user = (id: string, text: string) => ({ id, role: "ROLE_USER", content: [{ text }] });

describe("engine processes", () => {
  test("stdout carries exactly one line, `listening on ADDR`; the health subcommand exits 0 when SERVING, 1 otherwise", async () => {
    const e = await start(EXAMPLE, ["--listen", "127.0.0.1:0", "--state-dir", tempDir()]);
    try {
      const ok = spawnSync(process.execPath, [EXAMPLE, "health", "--endpoint", e.address], { encoding: "utf8" });
      assert.equal(ok.status, 0, ok.stderr);
      assert.equal(ok.stdout, "SERVING\n");
      await sleep(100);
      assert.deepEqual(e.lines, [`listening on ${e.address}`]);
    } finally {
      e.child.kill("SIGTERM");
      assert.equal(await e.exited, 0);
    }
    const down = spawnSync(process.execPath, [EXAMPLE, "health", "--endpoint", e.address, "--timeout-seconds", "1"], { encoding: "utf8" });
    assert.equal(down.status, 1);
    assert.match(down.stderr, /cannot be checked|did not answer/);
  });

  test("--listen unix:///PATH makes the socket file mode 0600 and serves on it", async () => {
    const dir = tempDir();
    const sock = join(dir, "engine.sock");
    const e = await start(EXAMPLE, ["--listen", `unix://${sock}`, "--state-dir", join(dir, "state")]);
    try {
      assert.equal(e.address, `unix://${sock}`);
      assert.equal(statSync(sock).mode & 0o777, 0o600);
      const s = await checkHealth(`unix://${sock}`, grpc.credentials.createInsecure(), {}, 3000);
      assert.equal(s, "SERVING");
    } finally {
      e.child.kill("SIGTERM");
      await e.exited;
    }
  });

  test("flag mistakes are one sentence on stderr and exit 2", () => {
    for (const [args, want] of [
      [["--tls-cert", "c.pem"], /--tls-cert requires --tls-key/],
      [["--no-such-flag"], /Unknown option '--no-such-flag'/],
      [["--max-concurrent-calls", "0"], /--max-concurrent-calls: "0" is not a number of at least 1/],
      [["--otlp-endpoint", "unix:///x.sock"], /--otlp-endpoint: .*OTLP goes to http/],
      [["--tls-cert", "/nonexistent.pem", "--tls-key", "/nonexistent.key"], /--tls-cert \/nonexistent\.pem: /],
    ] as const) {
      const r = spawnSync(process.execPath, [EXAMPLE, ...args], { encoding: "utf8" });
      assert.equal(r.status, 2, `${args.join(" ")}: ${r.stderr}`);
      assert.match(r.stderr, want);
      assert.equal(r.stdout, "");
    }
  });

  test("SIGTERM drains: health goes NOT_SERVING, new calls are refused, the in-flight call finishes, exit 0", async () => {
    const e = await start(PROBE, ["--listen", "127.0.0.1:0"]);
    const client = engineClient(e.address);
    try {
      const inflight = unary(client, "Assemble", { sessionId: "slower", messages: [user("a", "hi")] }, { deadlineMs: 10_000 });
      // The call is in flight (it takes 3 s) before SIGTERM.
      await sleep(800);
      e.child.kill("SIGTERM");
      await sleep(200);
      assert.equal(await checkHealth(e.address, grpc.credentials.createInsecure(), {}, 2000), "NOT_SERVING");
      const refused = await unary(client, "Assemble", { sessionId: "s", messages: [] }, { deadlineMs: 2000 });
      assert.equal(refused.err?.code, grpc.status.UNAVAILABLE);
      const done = await inflight;
      assert.equal(done.err, undefined, "the in-flight call finished");
      assert.equal(await e.exited, 0);
    } finally {
      client.close();
      e.child.kill("SIGKILL");
    }
  });

  test("SIGHUP re-reads the TLS certificate: new connections get the new one, the engine keeps serving", async () => {
    const c = certificates();
    const e = await start(EXAMPLE, ["--listen", "127.0.0.1:0", "--state-dir", tempDir(), "--tls-cert", c.cert, "--tls-key", c.key]);
    const port = Number(e.address.split(":").pop());
    const fingerprint = () =>
      new Promise<string>((resolve, reject) => {
        const s = connect({ host: "127.0.0.1", port, servername: "localhost", ca: readFileSync(c.ca), ALPNProtocols: ["h2"] }, () => {
          resolve(s.getPeerCertificate().fingerprint256);
          s.end();
        });
        s.on("error", reject);
      });
    try {
      const first = await fingerprint();
      copyFileSync(c.cert2, c.cert);
      copyFileSync(c.key2, c.key);
      e.child.kill("SIGHUP");
      await sleep(300);
      assert.notEqual(await fingerprint(), first);
      const ok = spawnSync(process.execPath, [EXAMPLE, "health", "--endpoint", `https://localhost:${port}`, "--tls-ca", c.ca], { encoding: "utf8" });
      assert.equal(ok.status, 0, ok.stderr);
    } finally {
      e.child.kill("SIGTERM");
      await e.exited;
    }
  });

  test("the example engine keeps its DELTA history across a kill -9, answers a gap for a cursor it lacks, and its tool finds a fact", async () => {
    const state = tempDir();
    let e = await start(EXAMPLE, ["--listen", "127.0.0.1:0", "--state-dir", state]);
    let client = engineClient(e.address);
    const held = [user("h1", "the deploy key is kept in vault path secret/ops/deploy"), user("h2", "noted")];
    try {
      const r = await unary<{ ingestedCount: number }>(client, "IngestBatch", { sessionId: "s1", messages: held });
      assert.equal(r.value?.ingestedCount, 2);
      e.child.kill("SIGKILL");
      await e.exited;
      client.close();
      e = await start(EXAMPLE, ["--listen", "127.0.0.1:0", "--state-dir", state]);
      client = engineClient(e.address);
      const cursor = { messageId: "h2", seq: 2, messageCount: 2, tokens: 0 };
      const out = await unary<{ messages: { id: string }[] }>(client, "Assemble", { sessionId: "s1", messages: [user("h3", "where is the key?")], cursor });
      assert.deepEqual(out.value?.messages.map((m) => m.id), ["h1", "h2", "h3"]);
      const gap = await unary(client, "Assemble", { sessionId: "s2", messages: [user("x", "?")], cursor });
      assert.ok(gapOf(gap.err!), "a cursor the engine does not hold is the typed gap");
      const call = (name: string, args: string) => unary<{ isError: boolean; content: { text: string }[] }>(client, "CallTool", { sessionId: "s1", toolCallId: "c1", name, argumentsJson: args });
      const found = await call("recall_search", JSON.stringify({ query: "vault path" }));
      assert.equal(found.value?.isError, false);
      assert.match(found.value!.content[0]!.text, /secret\/ops\/deploy/);
      assert.equal((await call("recall_search", "not json")).value?.isError, true);
      assert.equal((await call("no_such_tool", "{}")).value?.isError, true);
    } finally {
      client.close();
      e.child.kill("SIGTERM");
      await e.exited;
    }
  });
});
