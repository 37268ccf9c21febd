// The OpenClaw host with small plugins: what it refuses at start (one
// sentence naming the call), and what it gives a plugin that keeps to the
// provided API: tools with their audience and session, hooks, runtime.llm
// and runtime.subagent over the gateway's Host, resolvePath, ForgetSession.
import assert from "node:assert/strict";
import { existsSync, mkdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { describe, test } from "node:test";
import * as grpc from "@grpc/grpc-js";
import { gapOf, type pb } from "@ctxgate/engine-sdk";
import { pendingTurnStart } from "../src/engine.js";
import { History } from "../src/history.js";
import { Transcripts } from "../src/transcript.js";
import { FIXTURES, call, compact, fakeHost, grant, runToEnd, start, temp } from "./support.js";

describe("the OpenClaw host", () => {
  test("a plugin that registers something the host does not provide fails at start, naming it in one sentence", () => {
    const r = runToEnd([
      "--plugin",
      join(FIXTURES, "refusing-plugin"),
      "--listen",
      "127.0.0.1:0",
      "--state-dir",
      temp(),
    ]);
    assert.equal(r.status, 2, r.stderr);
    assert.equal(r.stdout, "");
    assert.match(
      r.stderr,
      /openclaw-host: plugin refusing-plugin calls api\.registerProvider, which the ctxgate OpenClaw host does not/,
    );
    const none = runToEnd([
      "--plugin",
      join(FIXTURES, "engineless-plugin"),
      "--listen",
      "127.0.0.1:0",
      "--state-dir",
      temp(),
    ]);
    assert.equal(none.status, 2);
    assert.match(
      none.stderr,
      /plugin engineless-plugin registered no context engine \(it never called api\.registerContextEngine\)/,
    );
    const missing = runToEnd([
      "--plugin",
      join(FIXTURES, "no-such-plugin"),
      "--listen",
      "127.0.0.1:0",
      "--state-dir",
      temp(),
    ]);
    assert.equal(missing.status, 2);
    assert.match(missing.stderr, /openclaw-host: .*no-such-plugin/);
    const noState = runToEnd(["--plugin", join(FIXTURES, "echo-plugin"), "--listen", "127.0.0.1:0"]);
    assert.equal(noState.status, 2);
    assert.match(noState.stderr, /--state-dir DIR is required/);
  });

  test("a plugin keeping to the API is served: tools, hooks, llm, subagent, resolvePath, ForgetSession", async () => {
    const state = temp();
    const config = join(state, "plugin.json");
    writeFileSync(config, JSON.stringify({ greeting: "hello" }));
    const host = await fakeHost(['TOOL_CALL {"name": "deep_tool", "arguments": {}}', "found: 42", "a short summary"]);
    const e = await start([
      "--plugin",
      join(FIXTURES, "echo-plugin"),
      "--listen",
      "127.0.0.1:0",
      "--state-dir",
      state,
      "--plugin-config",
      config,
      "--subagent-tool",
      "deep_tool",
    ]);
    const client = new grpc.Client(e.address, grpc.credentials.createInsecure());
    const access = { endpoint: `127.0.0.1:${host.port}`, grant: grant() };
    try {
      // pluginConfig and resolvePath (under --state-dir).
      assert.deepEqual(JSON.parse(readFileSync(join(state, "registered.txt"), "utf8")), { greeting: "hello" });
      const info = (await call<pb.EngineInfo__Output>(client, "GetInfo", {})).value!;
      assert.equal(info.id, "echo-plugin");
      assert.ok(info.ownsCompaction);
      assert.deepEqual(
        info.tools.map((t) => [t.name, t.audience]),
        [
          ["echo_tool", "TOOL_AUDIENCE_MAIN"],
          ["deep_tool", "TOOL_AUDIENCE_SUBAGENT"],
        ],
      );
      assert.deepEqual([...info.acceptedHostParams!.params].sort(), ["host", "prompt", "session_key"]);
      assert.ok(info.implementedMethods.includes("CallTool") && info.implementedMethods.includes("AfterTurn"));
      assert.ok(!info.implementedMethods.includes("Maintain"), "the plugin has no maintain");
      // A tool is made for the call's session.
      const tool = (args: string, name = "echo_tool") =>
        call<pb.CallToolResult__Output>(client, "CallTool", {
          sessionId: "s1",
          sessionKey: "agent:main:s1",
          toolCallId: "c1",
          name,
          argumentsJson: args,
          host: access,
        });
      assert.equal((await tool('{"say":"hi"}')).value?.content[0]?.text, "agent:main:s1: hi");
      const boom = (await tool('{"say":"boom"}')).value!;
      assert.ok(boom.isError && /echo_tool failed: boom/.test(boom.content[0]!.text!));
      assert.equal((await tool("{", "echo_tool")).value?.isError, true);
      assert.equal((await tool("{}", "nope")).value?.isError, true);
      assert.match((await tool('{"say":"events"}')).value!.content[0]!.text!, /gateway_start/);
      // runtime.subagent: a bounded loop over Host.LlmComplete with the sub-agent tools.
      const delegated = (await tool('{"say":"delegate"}')).value!;
      assert.equal(delegated.content[0]?.text, "ok: found: 42");
      assert.match(host.prompts[1]!, /Result of deep_tool:\nthe answer is 42/);
      // before_prompt_build → the system prompt addition; messages come back as they went.
      const m = { id: "u1", role: "ROLE_USER", content: [{ text: "hello" }], metadata: { channel: "test" } };
      const a = (await call<pb.AssembleResult__Output>(client, "Assemble", { sessionId: "s1", messages: [m] })).value!;
      assert.equal(a.systemPromptAddition, "ECHO POLICY");
      assert.deepEqual(
        a.messages.map((x) => [x.id, x.metadata]),
        [["u1", { channel: "test" }]],
      );
      // runtime.llm.complete inside Compact uses the call's grant.
      const events = await compact(client, { sessionId: "s1", sessionKey: "s1", host: access });
      const result = events.at(-1)!.result!;
      assert.deepEqual([result.ok, result.compacted, result.summary], [true, true, "a short summary"]);
      // Ingest is idempotent by message id, whatever the plugin does.
      assert.equal(
        (await call<pb.IngestResult__Output>(client, "Ingest", { sessionId: "s2", message: m })).value?.ingested,
        true,
      );
      assert.equal(
        (await call<pb.IngestResult__Output>(client, "Ingest", { sessionId: "s2", message: m })).value?.ingested,
        false,
      );
      // ForgetSession: session_end with reason "deleted" and the messages held (OpenClaw's
      // event), the host's transcript dropped.
      assert.ok(existsSync(join(state, "sessions")));
      await call(client, "ForgetSession", { sessionId: "s2" });
      assert.match((await tool('{"say":"events"}')).value!.content[0]!.text!, /session_end s2 deleted 1$/);
      assert.equal(
        (await call<pb.IngestResult__Output>(client, "Ingest", { sessionId: "s2", message: m })).value?.ingested,
        true,
      );
    } finally {
      client.close();
      host.close();
      e.child.kill("SIGTERM");
      assert.equal(await e.exited, 0);
    }
  });
});

describe("the turn an Assemble answers", () => {
  const m = (id: string, role: string): pb.AgentMessage => ({ id, role: role as pb.AgentMessage["role"] });
  const held = (ids: string[]) => (id: string) => ids.includes(id);
  test("starts at its user message when the plugin has not been told of it", () => {
    const messages = [m("u1", "ROLE_USER"), m("a1", "ROLE_ASSISTANT"), m("u2", "ROLE_USER"), m("a2", "ROLE_ASSISTANT")];
    assert.equal(pendingTurnStart(messages, held(["u1", "a1"])), 2, "a tool loop's messages follow the prompt");
    assert.equal(pendingTurnStart(messages.slice(0, 3), held([])), 2, "a restarted host holds nothing");
  });
  test("is none when the newest turn is held (a preview), or there is no user message", () => {
    const messages = [m("u1", "ROLE_USER"), m("a1", "ROLE_ASSISTANT")];
    assert.equal(pendingTurnStart(messages, held(["u1", "a1"])), 2);
    assert.equal(pendingTurnStart([m("s", "ROLE_SYSTEM")], held([])), 1);
    assert.equal(pendingTurnStart([], held([])), 0);
  });
});

describe("a transcript in OpenClaw's units", () => {
  test("places a message after tool messages answering several calls, or none", () => {
    const t = new Transcripts(temp());
    const results = (id: string, n: number): pb.AgentMessage => ({
      id,
      role: "ROLE_TOOL",
      content: Array.from({ length: n }, (_, k) => ({ toolResult: { toolCallId: `c${k}`, toolName: "t", text: "r" } })),
    });
    t.append("s", [
      { id: "u1", role: "ROLE_USER", content: [{ text: "hi" }] },
      results("r1", 3),
      results("r0", 0),
      { id: "u2", role: "ROLE_USER", content: [{ text: "again" }] },
    ]);
    assert.deepEqual(t.openClawPlace("s", "u1"), { extra: 0, parentEntryId: null });
    assert.deepEqual(t.openClawPlace("s", "u2"), { extra: 1, parentEntryId: "r1#2" });
    assert.equal(t.openClawPlace("s", "nope"), undefined);
  });
});

describe("the transcripts the host keeps", () => {
  const say = (id: string): pb.AgentMessage => ({ id, role: "ROLE_USER", content: [{ text: id }] });

  test("keep the most recently used sessions in memory and read the others again from their files", () => {
    const dir = temp();
    const t = new Transcripts(dir, 3);
    for (const k of ["a", "b", "c", "d", "e"]) t.append(k, [say(`${k}1`)]);
    assert.equal(t.cached, 3);
    // "a" was evicted: read again from its file, whole, and still appended to once.
    assert.deepEqual(t.messages("a").map((m) => m.id), ["a1"]);
    assert.equal(t.append("a", [say("a1"), say("a2")]).length, 1, "a1 is held already");
    assert.equal(t.cached, 3);
    const again = new Transcripts(dir, 3);
    assert.deepEqual(again.messages("a").map((m) => m.id), ["a1", "a2"]);
    // A line the file holds twice (written, then the write failed late and
    // the gateway resent it) is read as one message.
    const file = again.pathOf("a");
    writeFileSync(file, readFileSync(file, "utf8") + readFileSync(file, "utf8").split("\n").slice(-2).join("\n"));
    assert.deepEqual(new Transcripts(dir).messages("a").map((m) => m.id), ["a1", "a2"]);
    assert.deepEqual(again.entries("a").map((e) => e.parentId), [null, "a1"]);
  });

  test("hold a message only once it is written", () => {
    const dir = temp();
    const t = new Transcripts(dir);
    t.append("s", [say("m1")]);
    // The file cannot be written: the append fails and holds nothing new.
    rmSync(t.dir, { recursive: true });
    writeFileSync(t.dir, "not a directory");
    assert.throws(() => t.append("s", [say("m2")]));
    assert.equal(t.holds("s", "m2"), false, "a message never written is not held");
    rmSync(t.dir);
    mkdirSync(t.dir);
    assert.equal(t.append("s", [say("m2")]).length, 1, "the resend writes it");
  });
});


describe("the history the host holds for DELTA requests", () => {
  const said = (id: string, text = id) => ({ id, role: "ROLE_USER" as const, content: [{ text }] });
  const cursor = (messageId: string, messageCount: number) =>
    ({ messageId, messageCount, seq: 0, tokens: 0 }) as unknown as pb.HistoryCursor__Output;
  const ids = (list: { id?: string }[] | undefined) => list?.map((m) => m.id);

  test("stands for what the cursor names, or is a gap", () => {
    const h = new History();
    h.acknowledge("s", [said("a"), said("b"), said("c")]);
    assert.deepEqual(ids(h.through("s", cursor("b", 2))), ["a", "b"]);
    assert.deepEqual(ids(h.through("s", cursor("", 0))), []);
    assert.equal(h.through("s", cursor("b", 3)), undefined, "a count that differs (the gateway restructured it)");
    assert.equal(h.through("s", cursor("x", 1)), undefined, "an unknown message");
    assert.equal(h.through("other", cursor("a", 1)), undefined);
    // A message resent under its id replaces the one held (a rewrite, resynced).
    h.acknowledge("s", [said("b", "rewritten")]);
    assert.equal(h.through("s", cursor("c", 3))![1]!.content![0]!.text, "rewritten");
    // An after-turn keeps only what its cursor covers, then takes its messages.
    assert.ok(h.advance("s", cursor("b", 2), [said("d")]));
    assert.deepEqual(ids(h.through("s", cursor("d", 3))), ["a", "b", "d"]);
    assert.equal(h.through("s", cursor("c", 3)), undefined, "c left the branch");
    assert.equal(h.advance("s", cursor("c", 3), [said("e")]), false);
    assert.equal(h.through("s", cursor("d", 3)), undefined, "a gap forgets the session");
  });

  test("starts again from a batch that does not follow its order, and finds a summary's cursor", () => {
    const h = new History();
    h.acknowledge("s", [said("a"), said("b"), said("c")]);
    // A resync in order (the same ids, a rewrite in) keeps the copy.
    h.acknowledge("s", [said("a"), said("b", "new"), said("c"), said("d")]);
    assert.deepEqual(ids(h.through("s", cursor("d", 4))), ["a", "b", "c", "d"]);
    // b is held but not next after d: stale, started again from b.
    h.acknowledge("s", [said("d"), said("b"), said("e")]);
    assert.equal(h.through("s", cursor("e", 5)), undefined, "a gap, not a wrong order");
    assert.deepEqual(ids(h.through("s", cursor("e", 2))), ["b", "e"]);
    // A new id after a held one that is not the last: stale too.
    h.acknowledge("t", [said("a"), said("b"), said("c")]);
    h.acknowledge("t", [said("a"), said("x")]);
    assert.equal(h.through("t", cursor("x", 4)), undefined);
    // A compaction's cursor names its summary, held first.
    h.acknowledge("u", [said("summary"), said("k1"), said("k2")]);
    assert.deepEqual(ids(h.through("u", cursor("summary", 3))), ["summary", "k1", "k2"]);
    assert.equal(h.through("u", cursor("summary", 4)), undefined);
  });

  test("keeps the most recently used sessions", () => {
    const h = new History(2);
    for (const s of ["s1", "s2"]) h.acknowledge(s, [said("a")]);
    h.through("s1", cursor("a", 1));
    h.acknowledge("s3", [said("a")]);
    assert.equal(h.size, 2);
    assert.equal(h.through("s2", cursor("a", 1)), undefined, "the least recently used went");
    assert.ok(h.through("s1", cursor("a", 1)));
  });

  test("is served: a DELTA Assemble gives the plugin the whole history, a gap is reported and resynced", async () => {
    const e = await start(["--plugin", join(FIXTURES, "echo-plugin"), "--listen", "127.0.0.1:0", "--state-dir", temp()]);
    const client = new grpc.Client(e.address, grpc.credentials.createInsecure());
    const assemble = (messages: unknown[], c?: unknown) =>
      call<pb.AssembleResult__Output>(client, "Assemble", { sessionId: "d1", messages, ...(c ? { cursor: c } : {}) });
    const history = [said("u1"), said("u2"), said("u3")];
    try {
      const info = (await call<pb.EngineInfo__Output>(client, "GetInfo", {})).value!;
      assert.equal(info.historyDelivery, "HISTORY_DELIVERY_DELTA");
      await call(client, "IngestBatch", { sessionId: "d1", messages: history });
      // The echo plugin returns what it is given: the held history, then the turn.
      const delta = (await assemble([said("u4")], cursor("u3", 3))).value!;
      assert.deepEqual(ids(delta.messages), ["u1", "u2", "u3", "u4"]);
      const full = (await assemble([...history, said("u4")])).value!;
      assert.deepEqual(ids(full.messages), ids(delta.messages), "a FULL request is still answered");
      // A cursor the host does not hold: FAILED_PRECONDITION with the gap.
      const gap = await assemble([said("u4")], cursor("u3", 4));
      assert.equal(gap.err?.code, grpc.status.FAILED_PRECONDITION);
      assert.ok(gapOf(gap.err!), gap.err?.message);
      // The session is forgotten until the gateway resends it (with a rewrite in).
      assert.ok((await assemble([said("u4")], cursor("u3", 3))).err);
      await call(client, "IngestBatch", { sessionId: "d1", messages: [said("u1"), said("u2", "again"), said("u3")] });
      const resynced = (await assemble([said("u4")], cursor("u3", 3))).value!;
      assert.deepEqual(
        resynced.messages.map((m) => [m.id, m.content[0]?.text]),
        [
          ["u1", "u1"],
          ["u2", "again"],
          ["u3", "u3"],
          ["u4", "u4"],
        ],
      );
      // AfterTurn: its messages follow the cursor, and are held after it.
      const turn = [said("u4"), { id: "a4", role: "ROLE_ASSISTANT", content: [{ text: "ok" }] }];
      const after = await call(client, "AfterTurn", {
        sessionId: "d1",
        messages: turn,
        prePromptMessageCount: 0,
        cursor: cursor("u3", 3),
      });
      assert.equal(after.err, undefined);
      assert.deepEqual(ids((await assemble([said("u5")], cursor("a4", 5))).value?.messages), [
        "u1",
        "u2",
        "u3",
        "u4",
        "a4",
        "u5",
      ]);
      const lost = await call(client, "AfterTurn", { sessionId: "d1", messages: turn, cursor: cursor("a9", 9) });
      assert.ok(gapOf(lost.err!));
    } finally {
      client.close();
      e.child.kill("SIGTERM");
      assert.equal(await e.exited, 0);
    }
  });
});
