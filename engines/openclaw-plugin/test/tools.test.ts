// The engine's tools as OpenClaw tools: the manifest's names, the factory's
// offer (cached, read once, retried after a failure), and a committed turn
// less the tool calls and results the gateway holds already.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { describe, test } from "node:test";
import { withoutHeld } from "../src/engine.js";
import type { ToolAudience__Output } from "../src/gen/contextengine/v1/ToolAudience.js";
import type { ToolDefinition__Output } from "../src/gen/contextengine/v1/ToolDefinition.js";
import { ENGINE_TOOL_NAMES, EngineTools, fromDefinitions, readToolsInWorker } from "../src/tools.js";

const def = (
  name: string,
  audience: ToolAudience__Output = "TOOL_AUDIENCE_ALL",
  parametersJsonSchema = '{"type":"object","properties":{"query":{"type":"string"}}}',
): ToolDefinition__Output => ({
  name,
  description: `${name} does things`,
  parametersJsonSchema,
  audience,
});

describe("engine tools", () => {
  test("the manifest declares the names the plugin offers", () => {
    const manifest = JSON.parse(readFileSync(new URL("../../openclaw.plugin.json", import.meta.url), "utf8"));
    assert.deepEqual(manifest.contracts.tools, [...ENGINE_TOOL_NAMES]);
  });

  test("definitions: subagent-only tools stay out, a schema that is not an object is none", () => {
    const tools = fromDefinitions([def("history_search"), def("lcm_expand", "TOOL_AUDIENCE_SUBAGENT"), def("history_read", "TOOL_AUDIENCE_MAIN", "[1]")]);
    assert.deepEqual(
      tools.map((t) => t.name),
      ["history_search", "history_read"],
    );
    assert.deepEqual(tools[1]!.parameters, { type: "object", properties: {} });
  });

  test("the offer: read once, kept, a turn's context replaces it; undeclared names are not offered", async () => {
    let reads = 0;
    const tools = new EngineTools(
      () => (reads++, { tools: fromDefinitions([def("history_search"), def("someone_elses_tool")]) }),
      () => assert.fail("no warning"),
    );
    const calls: unknown[] = [];
    const offered = tools.forRun("s1", async (...a) => (calls.push(a), { content: [], details: { ctxgate: true, isError: false } }));
    assert.deepEqual(
      offered.map((t) => (t as { name: string }).name),
      ["history_search"],
    );
    tools.forRun("s1", async () => assert.fail());
    assert.equal(reads, 1);
    await (offered[0] as { execute: (id: string, a: unknown) => Promise<unknown> }).execute("call-1", { query: "x" });
    assert.deepEqual(calls, [["s1", "call-1", "history_search", { query: "x" }]]);
    tools.update([]); // quarantined: the gateway offers none
    assert.deepEqual(tools.current(), []);
    assert.equal(tools.has("history_read"), true, "a declared name is the engine's even while none is offered");
    assert.equal(tools.has("exec"), false);
  });

  test("a failed read offers nothing, warns once, and is retried only after 30 s", () => {
    let now = 1_000_000;
    let reads = 0;
    const warnings: string[] = [];
    const tools = new EngineTools(
      () => (reads++, { error: "connection refused" }),
      (w) => warnings.push(w),
      () => now,
    );
    assert.deepEqual(tools.current(), []);
    assert.deepEqual(tools.current(), []);
    assert.equal(reads, 1);
    assert.match(warnings[0]!, /not offered this run: connection refused/);
    now += 30_001;
    tools.current();
    assert.equal(reads, 2);
  });

  test("the status read in a worker: a gateway nobody answers at is an error within the timeout", () => {
    const start = Date.now();
    const r = readToolsInWorker({ endpoint: "127.0.0.1:1" }, 2_000)();
    assert.ok("error" in r, JSON.stringify(r));
    assert.ok(Date.now() - start < 4_000, `took ${Date.now() - start} ms`);
  });

  test("a committed turn less the engine tool calls and results the gateway holds", () => {
    const messages = [
      { role: "assistant", content: [{ type: "toolCall", id: "c1", name: "history_search", arguments: {} }] },
      { role: "toolResult", toolCallId: "c1", content: [{ type: "text", text: "hit" }] },
      {
        role: "assistant",
        content: [
          { type: "text", text: "and also" },
          { type: "toolCall", id: "c2", name: "history_search", arguments: {} },
          { type: "toolCall", id: "c3", name: "exec", arguments: {} },
        ],
      },
      { role: "toolResult", toolCallId: "c2", content: [{ type: "text", text: "its own error" }] },
      { role: "toolResult", toolCallId: "c3", content: [{ type: "text", text: "ran" }] },
      { role: "assistant", content: [{ type: "text", text: "done" }] },
    ];
    // c2's call went in but its run failed: OpenClaw's result answers it.
    const kept = withoutHeld(messages, { calls: new Set(["c1", "c2"]), results: new Set(["c1"]) });
    assert.deepEqual(kept, [
      { role: "assistant", content: [{ type: "text", text: "and also" }, { type: "toolCall", id: "c3", name: "exec", arguments: {} }] },
      messages[3],
      messages[4],
      messages[5],
    ]);
    assert.equal(withoutHeld(messages, undefined), messages);
  });
});
