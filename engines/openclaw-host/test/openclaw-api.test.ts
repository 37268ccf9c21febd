// The OpenClaw 2026.9.6 plugin API the host presents, checked with a probe
// plugin that records what it is given (test/fixtures/probe-plugin):
// commitTurn's flat anchors, the factory's context, runtimeSettings and
// sessionTarget in OpenClaw's shapes, the acceptedHostParams projection,
// the registrations context engines make, runtime.version and
// runtime.llm, the openclaw/plugin-sdk modules, registerTool's forms,
// TypeScript and runtime entries, and lossless-claw 1.0.0-beta.4.
import assert from "node:assert/strict";
import { existsSync, readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { after, before, describe, test } from "node:test";
import * as grpc from "@grpc/grpc-js";
import type { pb } from "@ctxgate/engine-sdk";
import { projectHostParams, runtimeSettings } from "../src/shapes.js";
import {
  FIXTURES,
  HOST,
  type FakeHost,
  type Running,
  call,
  compact,
  fakeHost,
  grant,
  runToEnd,
  start,
  stopHost,
  temp,
} from "./support.js";

const PROBE = join(FIXTURES, "probe-plugin");

interface Recorded {
  method: string;
  params: Record<string, unknown>;
  [extra: string]: unknown;
}

/** A probe host: the plugin, its client, its state dir. */
interface Probe {
  e: Running;
  client: grpc.Client;
  state: string;
  calls(method: string): Promise<Recorded[]>;
  stop(): Promise<number | null>;
}

async function probe(extraArgs: string[] = [], pluginConfig?: Record<string, unknown>): Promise<Probe> {
  const state = temp();
  const args = ["--plugin", PROBE, "--listen", "127.0.0.1:0", "--state-dir", state, ...extraArgs];
  if (pluginConfig) {
    writeFileSync(join(state, "plugin.json"), JSON.stringify(pluginConfig));
    args.push("--plugin-config", join(state, "plugin.json"));
  }
  const e = await start(args);
  const client = new grpc.Client(e.address, grpc.credentials.createInsecure());
  return {
    e,
    client,
    state,
    async calls(method: string) {
      const args = JSON.stringify({ method });
      const req = {
        sessionId: "probe",
        sessionKey: "probe",
        toolCallId: "p",
        name: "probe_calls",
        argumentsJson: args,
      };
      const r = await call<pb.CallToolResult__Output>(client, "CallTool", req);
      assert.ok(r.value, r.err?.message);
      return JSON.parse(r.value.content[0]!.text!) as Recorded[];
    },
    async stop() {
      client.close();
      return stopHost(e);
    },
  };
}

const text = (id: string, role: "ROLE_USER" | "ROLE_ASSISTANT", t: string): pb.AgentMessage => ({
  id,
  role,
  content: [{ text: t }],
  createdAtUnixMs: 1_700_000_000_000 + id.length,
});

/** A turn: the user, an assistant calling two tools, one tool message
 * answering both, the assistant's answer (4 contract messages, 5 OpenClaw). */
function turnMessages() {
  return [
    text("u1", "ROLE_USER", "what is in a and b?"),
    {
      id: "a1",
      role: "ROLE_ASSISTANT",
      content: [
        { toolCall: { id: "t1", name: "read", argumentsJson: '{"f":"a"}' } },
        { toolCall: { id: "t2", name: "read", argumentsJson: '{"f":"b"}' } },
      ],
      createdAtUnixMs: 1_700_000_000_100,
    },
    {
      id: "r1",
      role: "ROLE_TOOL",
      content: [
        { toolResult: { toolCallId: "t1", toolName: "read", text: "A" } },
        { toolResult: { toolCallId: "t2", toolName: "read", text: "B" } },
      ],
      createdAtUnixMs: 1_700_000_000_200,
    },
    text("a2", "ROLE_ASSISTANT", "a has A, b has B"),
  ];
}

const WIRE_SETTINGS = {
  schemaVersion: 1,
  runtime: { host: "ctxgate", mode: "RUNTIME_MODE_FALLBACK", harnessId: "codex" },
  model: { requested: "gpt-test", resolved: "gpt-test", provider: "openai" },
  contextEngineSelection: { selectedId: "probe", source: "SELECTION_SOURCE_CONFIGURED" },
  executionHost: { id: "embedded", label: "ctxgate embedded runner" },
  limits: { promptTokenBudget: 9000, maxOutputTokens: 512 },
  diagnostics: { fallbackReason: "REASON_CODE_CONTEXT_OVERFLOW" },
};

const OPENCLAW_SETTINGS = {
  schemaVersion: 1,
  runtime: { host: "openclaw", mode: "fallback", harnessId: "codex", runtimeId: null },
  model: { requested: "gpt-test", resolved: "gpt-test", provider: "openai", family: null },
  contextEngineSelection: { selectedId: "probe", source: "configured" },
  executionHost: { id: "embedded", label: "ctxgate embedded runner" },
  limits: { promptTokenBudget: 9000, maxOutputTokens: 512 },
  diagnostics: { fallbackReason: "context_overflow", degradedReason: null },
};

const WIRE_TARGET = { agentId: "main", sessionId: "r1", sessionKey: "agent:main:r1", threadId: "42" };
const OPENCLAW_TARGET = { agentId: "main", sessionId: "r1", sessionKey: "agent:main:r1", threadId: "42" };

/** The host started on fixture plugin `name`, run until it exits (a plugin it refuses at start). */
function startFixtureToEnd(name: string) {
  return runToEnd(["--plugin", join(FIXTURES, name), "--listen", "127.0.0.1:0", "--state-dir", temp()]);
}

describe("OpenClaw 2026.9.6's plugin API under the host", () => {
  let p: Probe;
  let host: FakeHost;
  before(async () => {
    host = await fakeHost(
      ["engine llm says hi", "plugin llm says hi"],
      [
        { id: "t1", seq: 1, turnId: "x", message: text("t1", "ROLE_USER", "first") },
        {
          id: "t2",
          parentId: "t1",
          seq: 2,
          turnId: "x",
          message: { id: "t2", role: "ROLE_TOOL", content: turnMessages()[2]!.content, createdAtUnixMs: 5 },
        },
        { id: "c1", parentId: "t2", seq: 3, turnId: "y", compaction: { summary: "so far", firstKeptEntryId: "t1" } },
        { id: "t3", parentId: "c1", seq: 4, turnId: "y", message: text("t3", "ROLE_ASSISTANT", "third") },
      ],
    );
    p = await probe();
  });
  after(async () => {
    host.close();
    await p.stop();
  });

  test("commitTurn: flat anchors, the admission's identity and target, the persisted runtime context", async () => {
    const a = (entryId: string, rawSeq: number, pos: number, more = {}) => ({
      agentId: "main",
      sessionId: "c1",
      sessionKey: "agent:main:c1",
      storePath: "/store/sessions.sqlite",
      generation: "0123456789abcdef0123456789abcdef",
      entryId,
      rawSeq,
      activeMessagePosition: pos,
      ...more,
    });
    const req = {
      advancementKey: "turn-1",
      admission: { anchor: a("u1", 7, 3), logicalTurnId: "turn-1", role: "ROLE_USER" },
      terminal: a("a2", 10, 6, { effectiveParentId: "r1", idempotencyKey: "idem-1" }),
      messages: turnMessages(),
      sessionId: "c1",
      sessionKey: "agent:main:c1",
      sessionTarget: { agentId: "main", sessionId: "c1", sessionKey: "agent:main:c1" },
      runtimeSettings: WIRE_SETTINGS,
      runtimeContext: {
        provider: "openai",
        modelId: "gpt-test",
        tokenBudget: 9000,
        extra: { modelContextWindow: "32000" },
      },
      isHeartbeat: false,
    };
    const first = await call<pb.CommitTurnResult__Output>(p.client, "CommitTurn", req);
    const second = await call<pb.CommitTurnResult__Output>(p.client, "CommitTurn", req);
    assert.equal(first.value?.status, "COMMIT_STATUS_COMMITTED", first.err?.message);
    assert.equal(second.value?.status, "COMMIT_STATUS_DUPLICATE", second.err?.message);
    const [c, retry] = await p.calls("commitTurn");
    assert.deepEqual(Object.keys(c!.params).sort(), [
      "admission",
      "advancementKey",
      "isHeartbeat",
      "messages",
      "runtimeContext",
      "sessionId",
      "sessionKey",
      "sessionTarget",
      "terminal",
    ]);
    const identity = {
      agentId: "main",
      sessionId: "c1",
      sessionKey: "agent:main:c1",
      storePath: "/store/sessions.sqlite",
    };
    assert.deepEqual(c!.params["admission"], {
      ...identity,
      generation: "0123456789abcdef0123456789abcdef",
      entryId: "u1",
      rawSeq: 7,
      effectiveParentId: null,
      activeMessagePosition: 3,
      logicalTurnId: "turn-1",
      role: "user",
    });
    // Positions count OpenClaw messages: the tool message answering two calls is two.
    assert.deepEqual(c!.params["terminal"], {
      ...identity,
      generation: "0123456789abcdef0123456789abcdef",
      entryId: "a2",
      rawSeq: 10,
      effectiveParentId: "r1",
      activeMessagePosition: 7,
      idempotencyKey: "idem-1",
    });
    assert.equal(c!["frozen"], true);
    const messages = c!.params["messages"] as { role: string }[];
    assert.deepEqual(
      messages.map((m) => m.role),
      ["user", "assistant", "toolResult", "toolResult", "assistant"],
    );
    assert.deepEqual(c!.params["sessionTarget"], identity);
    assert.deepEqual([c!.params["sessionId"], c!.params["sessionKey"]], ["c1", "agent:main:c1"]);
    assert.deepEqual(c!.params["runtimeContext"], {
      provider: "openai",
      modelId: "gpt-test",
      modelContextWindow: 32000,
      tokenBudget: 9000,
    });
    // A retry is the same call, message for message (its payload hash holds).
    assert.deepEqual(retry!.params, c!.params);

    // The next turn follows a tool message that answered two calls: OpenClaw
    // counts it twice, so the admission's position is one more than the contract's.
    const next = {
      ...req,
      advancementKey: "turn-2",
      admission: { anchor: a("u2", 11, 7, { effectiveParentId: "a2" }), logicalTurnId: "turn-2", role: "ROLE_USER" },
      terminal: a("a3", 12, 8, { effectiveParentId: "u2" }),
      messages: [text("u2", "ROLE_USER", "and c?"), text("a3", "ROLE_ASSISTANT", "no c")],
    };
    const committed = await call<pb.CommitTurnResult__Output>(p.client, "CommitTurn", next);
    assert.equal(committed.value?.status, "COMMIT_STATUS_COMMITTED", committed.err?.message);
    const [, , c2] = await p.calls("commitTurn");
    const positions = ["admission", "terminal"].map((k) => {
      const x = c2!.params[k] as { activeMessagePosition: number; effectiveParentId: string | null };
      return [x.activeMessagePosition, x.effectiveParentId];
    });
    assert.deepEqual(positions, [
      [8, "a2"],
      [9, "u2"],
    ]);
  });

  test("the factory gets {config, agentDir, workspaceDir}; an engine with a blank info.id fails at start", async () => {
    const [f] = await p.calls("factory");
    const ctx = f!.params as {
      config: { plugins: { entries: Record<string, unknown> } };
      agentDir: string;
      workspaceDir: string;
    };
    assert.deepEqual(Object.keys(ctx).sort(), ["agentDir", "config", "workspaceDir"]);
    assert.ok(ctx.config.plugins.entries["probe-plugin"]);
    assert.equal(ctx.agentDir, join(p.state, "agents", "main", "agent"));
    assert.equal(ctx.workspaceDir, join(p.state, "workspace"));
    assert.ok(existsSync(ctx.agentDir) && existsSync(ctx.workspaceDir));
    const blank = startFixtureToEnd("blank-info-plugin");
    assert.equal(blank.status, 2, blank.stderr);
    assert.match(
      blank.stderr,
      /Context engine "blank-info-plugin" factory returned an invalid ContextEngine: missing info\.id\./,
    );
  });

  test("runtimeSettings and sessionTarget in OpenClaw's shapes wherever OpenClaw passes them", async () => {
    const history = [
      text("m1", "ROLE_USER", "hello there, a longer text"),
      text("m2", "ROLE_ASSISTANT", "a long answer here"),
    ];
    const common = {
      sessionId: "r1",
      sessionKey: "agent:main:r1",
      runtimeSettings: WIRE_SETTINGS,
      runtimeContext: { tokenBudget: 9000, sessionTarget: WIRE_TARGET, provider: "openai" },
    };
    const withTarget = { ...common, sessionTarget: WIRE_TARGET };
    assert.ok(
      (await call(p.client, "AfterTurn", { ...withTarget, messages: history, prePromptMessageCount: 0 })).value,
    );
    assert.ok((await call(p.client, "Bootstrap", { ...withTarget, sessionFile: "agent:main:r1" })).value);
    assert.ok(
      (await call(p.client, "Assemble", { ...common, messages: history, tokenBudget: 900, prompt: "hi" })).value,
    );
    const maintained = await call<pb.MaintainResult__Output>(p.client, "Maintain", {
      ...withTarget,
      reason: "MAINTAIN_REASON_TURN",
    });
    const events = await compact(p.client, {
      ...withTarget,
      compactionTarget: "COMPACTION_TARGET_THRESHOLD",
      force: true,
    });
    const r1 = async (method: string) => (await p.calls(method)).find((x) => x.params["sessionId"] === "r1");
    for (const method of ["bootstrap", "assemble", "afterTurn", "maintain", "compact"]) {
      const c = await r1(method);
      assert.deepEqual(c!.params["runtimeSettings"], OPENCLAW_SETTINGS, method);
      const rc = c!.params["runtimeContext"] as Record<string, unknown>;
      assert.deepEqual(rc["sessionTarget"], OPENCLAW_TARGET, method);
      assert.deepEqual(rc["transcriptStorage"], { kind: "sqlite" }, method);
      // OpenClaw's assemble takes no top-level sessionTarget.
      if (method !== "assemble") assert.deepEqual(c!.params["sessionTarget"], OPENCLAW_TARGET, method);
      else assert.ok(!("sessionTarget" in c!.params));
    }
    const compacted = await r1("compact");
    assert.ok(!("sessionFile" in compacted!.params), "compact gets no sessionFile");
    assert.equal(compacted!.params["abortSignal"], "[AbortSignal]");
    assert.deepEqual([compacted!.params["compactionTarget"], compacted!.params["force"]], ["threshold", true]);
    // The successor the plugin answered is the contract's.
    const result = events.at(-1)!.result!;
    assert.equal(result.sessionId, "s-next");
    assert.deepEqual(
      { ...result.sessionTarget },
      {
        sessionId: "s-next",
        sessionKey: "agent:main:next",
        threadId: "7",
        _sessionId: "sessionId",
        _sessionKey: "sessionKey",
        _threadId: "threadId",
      },
    );
    assert.deepEqual([result.firstKeptEntryId, result.detailsJson], ["m2", '{"probe":1}']);
    // maintain: no reason (OpenClaw passes none), the rewrite helper, the signal.
    const m = await r1("maintain");
    assert.ok(!("reason" in m!.params));
    assert.equal((m!.params["runtimeContext"] as Record<string, unknown>)["rewriteTranscriptEntries"], "[function]");
    assert.equal(m!.params["abortSignal"], "[AbortSignal]");
    // OpenClaw's rewrite arithmetic: identical replacements skipped, real bytes freed, reasons for no-ops.
    assert.deepEqual(m!["rewrite"], [
      { changed: false, bytesFreed: 0, rewrittenEntries: 0, reason: "no replacements requested" },
      { changed: true, bytesFreed: "a long answer here".length - "short".length, rewrittenEntries: 1 },
      { changed: false, bytesFreed: 0, rewrittenEntries: 0, reason: "no changed matching message entries" },
    ]);
    const out = maintained.value!;
    assert.deepEqual(
      out.replacements.map((r) => [r.entryId, r.message?.id, r.message?.content[0]?.text]),
      [["m2", "m2", "short"]],
    );
    assert.deepEqual(out.allowedRewriteSuffixEntryIds, ["m2"]);
  });

  test("acceptedHostParams projects every call as OpenClaw does (compact keeps its abortSignal)", async () => {
    const signal = new AbortController().signal;
    const all = {
      sessionId: "s",
      sessionKey: "k",
      prompt: "p",
      runtimeSettings: {},
      sessionTarget: {},
      runtimeContext: {},
      abortSignal: signal,
      messages: [],
    };
    const info = (acceptedHostParams?: string[]) => ({
      id: "x",
      name: "x",
      ...(acceptedHostParams ? { acceptedHostParams } : {}),
    });
    assert.equal(projectHostParams(info(), "assemble", all), all);
    assert.deepEqual(Object.keys(projectHostParams(info([]), "compact", all)), [
      "sessionId",
      "abortSignal",
      "messages",
    ]);
    assert.deepEqual(Object.keys(projectHostParams(info([]), "maintain", all)), ["sessionId", "messages"]);
    assert.deepEqual(Object.keys(projectHostParams(info(["sessionKey", "runtimeContext"]), "maintain", all)), [
      "sessionId",
      "sessionKey",
      "runtimeContext",
      "messages",
    ]);
    // Through the host: a plugin accepting only sessionKey.
    const narrow = await probe([], { accepted: ["sessionKey"] });
    try {
      const info = (await call<pb.EngineInfo__Output>(narrow.client, "GetInfo", {})).value!;
      assert.deepEqual([...info.acceptedHostParams!.params].sort(), ["host", "session_key"]);
      const req = {
        sessionId: "n1",
        sessionKey: "agent:main:n1",
        sessionTarget: WIRE_TARGET,
        runtimeSettings: WIRE_SETTINGS,
      };
      assert.ok((await call(narrow.client, "Maintain", { ...req, reason: "MAINTAIN_REASON_TURN" })).value);
      await compact(narrow.client, req);
      const [m] = await narrow.calls("maintain");
      assert.deepEqual(Object.keys(m!.params).sort(), ["sessionFile", "sessionId", "sessionKey"]);
      const [c] = await narrow.calls("compact");
      assert.deepEqual(Object.keys(c!.params).sort(), [
        "abortSignal",
        "compactionTarget",
        "force",
        "sessionId",
        "sessionKey",
      ]);
    } finally {
      assert.equal(await narrow.stop(), 0);
    }
  });

  test("CLI, gateway methods, legacy hooks, commands logged; services run; hooks by priority", async () => {
    const err = p.e.stderr();
    for (const line of [
      "CLI commands probe registered; not served",
      "gateway method probe.status registered; not served",
      "legacy hook probe-legacy for command:new registered; not served",
      "command /probe registered; not served",
      'unknown typed hook "no_such_hook" ignored',
    ]) {
      assert.equal(err.split("\n").filter((l) => l.includes(line)).length, 1, `${line}:\n${err}`);
    }
    const started = JSON.parse(readFileSync(join(p.state, "service-started.json"), "utf8")) as Record<string, unknown>;
    assert.deepEqual(started, {
      keys: ["config", "logger", "stateDir", "workspaceDir"],
      workspaceDir: join(p.state, "workspace"),
      stateDir: p.state,
      logger: "function",
    });
    // before_prompt_build: priority 10 runs before priority 1.
    const a = await call<pb.AssembleResult__Output>(p.client, "Assemble", {
      sessionId: "h1",
      messages: [text("h", "ROLE_USER", "hi")],
    });
    assert.equal(a.value?.systemPromptAddition, "HIGH\n\nLOW");
    // The service stops at the drain.
    const other = await probe();
    assert.equal(await other.stop(), 0);
    assert.ok(existsSync(join(other.state, "service-stopped.json")));
  });

  test("runtime.version is the presented OpenClaw's; llm.complete in OpenClaw's shapes", async () => {
    const sdk = JSON.parse(readFileSync(join(HOST, "openclaw-sdk", "package.json"), "utf8")) as { version: string };
    assert.equal(sdk.version, "2026.9.6");
    const [r] = await p.calls("register");
    assert.equal((r!.params as { version: string }).version, sdk.version);
    const newer = await probe(["--openclaw-version", "2026.10.1"]);
    try {
      const [n] = await newer.calls("register");
      assert.equal((n!.params as { version: string }).version, "2026.10.1");
    } finally {
      await newer.stop();
    }
    const access = { endpoint: `127.0.0.1:${host.port}`, grant: grant("l1") };
    const events = await compact(p.client, {
      sessionId: "l1",
      sessionKey: "agent:main:l1",
      customInstructions: "llm",
      host: access,
    });
    assert.ok(events.at(-1)?.result?.ok);
    const [c] = (await p.calls("compact")).filter((x) => x.params["customInstructions"] === "llm");
    assert.deepEqual(c!["engineLlm"], {
      text: "engine llm says hi",
      provider: "test",
      model: "fake",
      agentId: "",
      usage: {},
      execution: { mode: "direct-provider", owner: { kind: "provider", id: "test" } },
      audit: { caller: { kind: "context-engine", id: "context-engine.compaction" }, purpose: "probe.summary" },
    });
    assert.deepEqual((c!["pluginLlm"] as { audit: unknown }).audit, {
      caller: { kind: "plugin", id: "probe-plugin", name: "Probe" },
      purpose: "probe.plugin",
    });
    assert.equal((c!["abortedLlm"] as { name: string }).name, "AbortError");
    assert.match((c!["isolatedLlm"] as { message: string }).message, /isolated-agent-runtime.*not available/);
    // responseFormat, an object in OpenClaw, is the contract's string; the aborted call never left.
    assert.deepEqual(
      host.requests.map((q) => [q.purpose, q.responseFormat ?? null]),
      [
        ["probe.summary", "json"],
        ["probe.plugin", null],
      ],
    );
  });

  test("the openclaw/plugin-sdk stub: core, plugin-entry, logging-core, session-transcript-runtime", async () => {
    const core = (await import("openclaw/plugin-sdk/core" as string)) as Record<string, unknown>;
    const entry = (await import("openclaw/plugin-sdk/plugin-entry" as string)) as Record<string, unknown>;
    const logging = (await import("openclaw/plugin-sdk/logging-core" as string)) as Record<string, unknown>;
    for (const name of [
      "definePluginEntry",
      "delegateCompactionToRuntime",
      "buildMemorySystemPromptAddition",
      "jsonResult",
    ]) {
      assert.equal(typeof core[name], "function", name);
    }
    for (const name of [
      "definePluginEntry",
      "emptyPluginConfigSchema",
      "buildPluginConfigSchema",
      "WorkerProviderError",
    ]) {
      assert.equal(typeof entry[name], "function", name);
    }
    const define = entry["definePluginEntry"] as (o: Record<string, unknown>) => Record<string, unknown>;
    const defined = define({ id: "x", name: "X", description: "d", register() {} });
    assert.deepEqual(Object.keys(defined).sort(), ["configSchema", "description", "id", "name", "register"]);
    assert.deepEqual((defined["configSchema"] as { jsonSchema: unknown }).jsonSchema, {
      type: "object",
      additionalProperties: false,
      properties: {},
    });
    const redact = logging["redactSensitiveText"] as (t: string, o?: unknown) => string;
    assert.equal(redact("Authorization: Bearer abcdefghijklmnopqrstuvwxyz0123"), "Authorization: Bearer abcdef…0123");
    assert.equal(redact("password=hunter2"), "password=***");
    assert.equal(redact("a basic understanding of sk-abc"), "a basic understanding of sk-abc");
    assert.equal(redact("sk-abcdefghijklmnopqrstuvwx", { mode: "off" }), "sk-abcdefghijklmnopqrstuvwx");
    const [r] = await p.calls("register");
    assert.equal((r!.params as { redacted: string }).redacted, "the key is sk-abc…uvwx, keep it");
    // delegateCompactionToRuntime: the gateway's own compaction, after OpenClaw's identity check.
    const delegated = await compact(p.client, {
      sessionId: "d1",
      sessionKey: "agent:main:d1",
      customInstructions: "delegate",
    });
    assert.ok(delegated.at(-1)?.delegateToHost, JSON.stringify(delegated));
    await compact(p.client, { sessionId: "d1", sessionKey: "agent:main:d1", customInstructions: "delegate-conflict" });
    const [conflict] = (await p.calls("compact")).filter((x) => x.params["customInstructions"] === "delegate-conflict");
    assert.equal(
      (conflict!["conflict"] as { message: string }).message,
      "Context-engine successor target conflicts with the caller session identity",
    );
    // session-transcript-runtime, served from the gateway's transcript (Host.ReadTranscript).
    const access = { endpoint: `127.0.0.1:${host.port}`, grant: grant("v1") };
    assert.ok(
      (await call(p.client, "Bootstrap", { sessionId: "v1", sessionKey: "agent:main:v1", host: access })).value,
    );
    const [b] = (await p.calls("bootstrap")).filter((x) => x.params["sessionId"] === "v1");
    const reads = b!["reads"] as {
      entries: Record<string, unknown>[];
      deltas: Record<string, unknown>[];
      limitError: { name: string; message: string };
    };
    const at = (ms: number) => new Date(ms).toISOString();
    assert.deepEqual(
      reads.entries.map((e) => [e["entryId"], e["parentId"], e["seq"], e["role"], e["createdAt"]]),
      [
        ["t1", null, 1, "user", at(1_700_000_000_002)],
        ["t2", "t1", 2, "toolResult", at(5)],
        ["t2#1", "t2", 2, "toolResult", at(5)],
        ["t3", "c1", 4, "assistant", at(1_700_000_000_002)],
      ],
    );
    assert.deepEqual(Object.keys(reads.entries[0]!).sort(), [
      "createdAt",
      "entryId",
      "message",
      "parentId",
      "role",
      "seq",
    ]);
    const [first, rest, bad] = reads.deltas;
    assert.deepEqual([first!["kind"], (first!["entries"] as unknown[]).length, first!["hasMore"]], ["page", 1, true]);
    assert.ok((first!["serializedBytes"] as number) > 0 && typeof first!["cursor"] === "string");
    assert.deepEqual([rest!["kind"], (rest!["entries"] as unknown[]).length, rest!["hasMore"]], ["page", 3, false]);
    assert.deepEqual([bad!["kind"], bad!["reason"]], ["reset", "invalid_cursor"]);
    // Paged from the gateway after the cursor, a tool message cut by a page
    // resumes at its next part, parents continuing.
    const [, , , cut, afterCut, missing] = reads.deltas;
    const ids = (d: Record<string, unknown>) =>
      (d["entries"] as Record<string, unknown>[]).map((e) => [e["entryId"], e["parentId"]]);
    assert.deepEqual([ids(cut!), cut!["hasMore"]], [[["t1", null], ["t2", "t1"]], true]);
    assert.deepEqual([ids(afterCut!), afterCut!["hasMore"]], [[["t2#1", "t2"], ["t3", "c1"]], false]);
    assert.deepEqual([missing!["kind"], missing!["reason"]], ["reset", "anchor_missing"]);
    assert.deepEqual(reads.limitError, {
      name: "RangeError",
      message: "maxMessages must be an integer between 1 and 10000",
    });
  });

  test("registerTool: tool, factory, {contextVersion: 2}, names, optional, contracts.tools", async () => {
    const info = (await call<pb.EngineInfo__Output>(p.client, "GetInfo", {})).value!;
    // probe_undeclared, made by a factory registered under no name, is not in contracts.tools.
    assert.deepEqual(
      info.tools.map((t) => t.name),
      ["probe_calls", "probe_v2", "probe_multi_a", "probe_multi_b"],
    );
    const run = (client: grpc.Client, name: string) =>
      call<pb.CallToolResult__Output>(client, "CallTool", {
        sessionId: "s9",
        sessionKey: "agent:main:s9",
        toolCallId: "c",
        name,
        argumentsJson: "{}",
      });
    assert.equal((await run(p.client, "probe_v2")).value?.content[0]?.text, "agent:main:s9|main|workspace|config");
    assert.equal((await run(p.client, "probe_multi_b")).value?.content[0]?.text, "b");
    const allowed = await probe(["--optional-tool", "probe_opt"]);
    try {
      const names = (await call<pb.EngineInfo__Output>(allowed.client, "GetInfo", {})).value!.tools.map((t) => t.name);
      assert.ok(names.includes("probe_opt"), names.join());
      assert.equal((await run(allowed.client, "probe_opt")).value?.content[0]?.text, "optional");
    } finally {
      await allowed.stop();
    }
    const undeclared = startFixtureToEnd("undeclared-tool-plugin");
    assert.equal(undeclared.status, 2, undeclared.stderr);
    assert.match(
      undeclared.stderr,
      /plugin undeclared-tool-plugin: plugin must declare contracts\.tools for: secret_tool/,
    );
  });
});

describe("plugin entries as OpenClaw loads them", () => {
  for (const [fixture, name] of [
    ["ts-plugin", "ts-plugin (typed)"],
    ["prebuilt-ts-plugin", "Prebuilt (from src/index.js)"],
    ["runtime-ext-plugin", "Runtime extension"],
  ] as const) {
    test(`${fixture}: served as ${JSON.stringify(name)}`, async () => {
      const e = await start(["--plugin", join(FIXTURES, fixture), "--listen", "127.0.0.1:0", "--state-dir", temp()]);
      const client = new grpc.Client(e.address, grpc.credentials.createInsecure());
      try {
        const info = (await call<pb.EngineInfo__Output>(client, "GetInfo", {})).value!;
        assert.deepEqual([info.id, info.name], [fixture, name]);
      } finally {
        client.close();
        assert.equal(await stopHost(e), 0);
      }
    });
  }
});

describe("lossless-claw beside itself", () => {
  test("1.0.0-beta.4 (the durable line) and 0.15.3 both start under the host, from the host's lock", async () => {
    for (const [version, durable] of [
      ["1.0.0-beta.4", true],
      ["0.15.3", false],
    ] as const) {
      const state = temp();
      writeFileSync(join(state, "plugin.json"), JSON.stringify({ independentLogFile: { enabled: false } }));
      const e = await start([
        "--plugin",
        `@martian-engineering/lossless-claw@${version}`,
        "--plugin-config",
        join(state, "plugin.json"),
        "--listen",
        "127.0.0.1:0",
        "--state-dir",
        join(state, "lcm"),
      ]);
      const client = new grpc.Client(e.address, grpc.credentials.createInsecure());
      try {
        const info = (await call<pb.EngineInfo__Output>(client, "GetInfo", {})).value!;
        assert.deepEqual([info.id, info.version], ["lossless-claw", version]);
        assert.equal(info.implementedMethods.includes("CommitTurn"), durable);
        assert.match(e.stderr(), new RegExp(`as OpenClaw 2026\\.9\\.6`));
      } finally {
        client.close();
        assert.equal(await stopHost(e), 0, e.stderr());
      }
    }
  });
});

describe("lossless-claw 1.0.0-beta.4 as the gateway drives it", () => {
  test("it bootstraps from the gateway's transcript, assembles, commits a turn once, maintains", async () => {
    const history = [text("h1", "ROLE_USER", "an earlier question"), text("h2", "ROLE_ASSISTANT", "an earlier answer")];
    const gateway = await fakeHost(
      ["a summary"],
      [
        { id: "h1", seq: 1, turnId: "t0", message: history[0]! },
        { id: "h2", parentId: "h1", seq: 2, turnId: "t0", message: history[1]! },
      ],
    );
    const state = temp();
    writeFileSync(join(state, "plugin.json"), JSON.stringify({ independentLogFile: { enabled: false } }));
    const e = await start([
      ...["--plugin", "lossless-claw-1", "--plugin-config", join(state, "plugin.json")],
      ...["--listen", "127.0.0.1:0", "--state-dir", state],
    ]);
    const client = new grpc.Client(e.address, grpc.credentials.createInsecure());
    const target = { agentId: "main", sessionId: "g1", sessionKey: "agent:main:g1" };
    const common = {
      sessionId: "g1",
      sessionKey: "agent:main:g1",
      runtimeContext: { tokenBudget: 8000, sessionTarget: target, provider: "openai", modelId: "m" },
      host: { endpoint: `127.0.0.1:${gateway.port}`, grant: grant("g1") },
    };
    try {
      const b = await call<pb.BootstrapResult__Output>(client, "Bootstrap", { ...common, sessionTarget: target });
      assert.deepEqual([b.value?.bootstrapped, b.value?.importedMessages], [true, 2], b.err?.message);
      const turn = [text("u3", "ROLE_USER", "a new question"), text("a3", "ROLE_ASSISTANT", "a new answer")];
      const a = await call<pb.AssembleResult__Output>(client, "Assemble", {
        ...common,
        messages: [...history, turn[0]],
        tokenBudget: 4000,
      });
      assert.deepEqual(
        a.value?.messages.map((m) => m.id),
        ["h1", "h2", "u3"],
        a.err?.message,
      );
      const anchor = (entryId: string, rawSeq: number, pos: number, parent: string) => ({
        ...target,
        generation: "g1",
        entryId,
        rawSeq,
        activeMessagePosition: pos,
        effectiveParentId: parent,
      });
      const commit = {
        ...common,
        advancementKey: "turn-3",
        admission: { anchor: anchor("u3", 3, 2, "h2"), logicalTurnId: "turn-3", role: "ROLE_USER" },
        terminal: anchor("a3", 4, 3, "u3"),
        messages: turn,
      };
      for (const status of ["COMMIT_STATUS_COMMITTED", "COMMIT_STATUS_DUPLICATE"]) {
        const r = await call<pb.CommitTurnResult__Output>(client, "CommitTurn", commit);
        assert.equal(r.value?.status, status, r.err?.message);
      }
      const m = await call<pb.MaintainResult__Output>(client, "Maintain", {
        ...common,
        sessionTarget: target,
        reason: "MAINTAIN_REASON_TURN",
      });
      assert.ok(m.value, m.err?.message);
    } finally {
      client.close();
      gateway.close();
      assert.equal(await stopHost(e), 0, e.stderr());
    }
  });
});

test("runtimeSettings: unset values are null, UNSPECIFIED enums null or their default", () => {
  assert.equal(runtimeSettings(null), undefined);
  assert.deepEqual(runtimeSettings({ schemaVersion: 1 } as pb.RuntimeSettings__Output), {
    schemaVersion: 1,
    runtime: { host: "openclaw", mode: "normal", harnessId: null, runtimeId: null },
    model: { requested: null, resolved: null, provider: null, family: null },
    contextEngineSelection: { selectedId: null, source: "unknown" },
    executionHost: { id: null, label: null },
    limits: { promptTokenBudget: null, maxOutputTokens: null },
    diagnostics: { fallbackReason: null, degradedReason: null },
  });
});
