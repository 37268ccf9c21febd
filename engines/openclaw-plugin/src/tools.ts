// The context engine's tools (EngineInfo.tools: the window engine's
// history_search, lossless-claw's lcm_grep, ...) as OpenClaw agent tools.
//
// OpenClaw asks two things a remote engine does not fit easily: the tool
// names, fixed in the manifest (contracts.tools, since 2026.5.2), and the
// tools themselves from a synchronous factory. So the manifest names the
// tools of the engines ctxgate ships (ENGINE_TOOL_NAMES; another engine's
// names are added there), and the factory offers those the engine declares
// now: as each turn's context reported them, else as the gateway's status
// says, read once, synchronously, in a worker thread (bounded by connectMs).
// A tool runs inside the open turn at the gateway (engine.ts, runEngineTool).
import { MessageChannel, Worker, receiveMessageOnPort } from "node:worker_threads";
import type { ToolDefinition__Output } from "./gen/contextengine/v1/ToolDefinition.js";

/** What the manifest declares: the tools of the engines ctxgate ships. */
export const ENGINE_TOOL_NAMES = [
  "history_search",
  "history_read",
  "lcm_grep",
  "lcm_describe",
  "lcm_expand",
  "lcm_expand_query",
] as const;

/** After a failed status read, the factory offers no tools for this long before trying again. */
const RETRY_MS = 30_000;

/** One tool as the engine declares it. */
export interface EngineTool {
  name: string;
  description: string;
  parameters: Record<string, unknown>;
}

/** What a tool call answers, as OpenClaw's AgentToolResult. */
export interface ToolAnswer {
  content: { type: "text"; text: string }[];
  details: { ctxgate: true; isError: boolean };
}

/** Runs one engine tool in the session's open turn. */
export type RunTool = (sessionId: string, toolCallId: string, name: string, args: unknown) => Promise<ToolAnswer>;

/**
 * An engine's tool definitions in OpenClaw's terms. Tools only for
 * subagent sessions stay out: OpenClaw's main runs are what the plugin serves.
 */
export function fromDefinitions(defs: readonly ToolDefinition__Output[]): EngineTool[] {
  return defs.filter((d) => d.name && d.audience !== "TOOL_AUDIENCE_SUBAGENT").map((d) => ({
    name: d.name,
    description: d.description,
    parameters: parseSchema(d.parametersJsonSchema),
  }));
}

function parseSchema(json: string): Record<string, unknown> {
  try {
    const v: unknown = json ? JSON.parse(json) : undefined;
    if (v && typeof v === "object" && !Array.isArray(v)) return v as Record<string, unknown>;
  } catch {
    // The gateway validated it; an engine that slipped one through gets no arguments.
  }
  return { type: "object", properties: {} };
}

/** Reads the selected engine's tools from the gateway's status; why not, when it cannot. */
export type ReadTools = () => { tools: EngineTool[] } | { error: string };

/**
 * A synchronous status read: a worker thread asks the gateway while this
 * thread waits on a shared flag, for at most `timeoutMs`.
 */
export function readToolsInWorker(rawConfig: unknown, timeoutMs: number): ReadTools {
  return () => {
    const done = new Int32Array(new SharedArrayBuffer(4));
    const { port1, port2 } = new MessageChannel();
    const worker = new Worker(new URL("./tools-worker.js", import.meta.url), {
      workerData: { rawConfig, port: port2, done, timeoutMs },
      transferList: [port2],
    });
    // A worker that dies answers nothing (the wait runs out); its error must not reach OpenClaw.
    worker.on("error", () => {});
    try {
      Atomics.wait(done, 0, 0, timeoutMs + 1_000);
      const reply = receiveMessageOnPort(port1)?.message as { tools?: EngineTool[]; error?: string } | undefined;
      if (reply?.tools) return { tools: reply.tools };
      return { error: reply?.error ?? `no answer from the gateway within ${timeoutMs} ms` };
    } finally {
      void worker.terminate();
      port1.close();
    }
  };
}

/** The tools OpenClaw's factory offers, kept current by each turn's context. */
export class EngineTools {
  private tools: EngineTool[] | undefined;
  private failedAt = -Infinity;

  constructor(
    private readonly read: ReadTools,
    private readonly warn: (message: string) => void,
    private readonly now: () => number = Date.now,
  ) {}

  /** A turn's context named the engine's tools for its session (none while it is quarantined). */
  update(defs: readonly ToolDefinition__Output[]): void {
    this.tools = fromDefinitions(defs);
  }

  /** Whether `name` is one of the engine's tools (the harness's own tools must not repeat them). */
  has(name: string): boolean {
    return ENGINE_TOOL_NAMES.includes(name as (typeof ENGINE_TOOL_NAMES)[number]) || (this.tools ?? []).some((t) => t.name === name);
  }

  /** The tools to offer now: the last turn's, else the gateway's status (read once; retried after a failure). */
  current(): EngineTool[] {
    if (this.tools) return this.tools;
    if (this.now() - this.failedAt < RETRY_MS) return [];
    const r = this.read();
    if ("error" in r) {
      this.failedAt = this.now();
      this.warn(`ctxgate: the engine's tools are not offered this run: ${r.error}`);
      return [];
    }
    this.tools = r.tools;
    return r.tools;
  }

  /** OpenClaw agent tools for a run in `sessionId`, those the manifest declares. */
  forRun(sessionId: string | undefined, run: RunTool): object[] {
    const declared = new Set<string>(ENGINE_TOOL_NAMES);
    return this.current()
      .filter((t) => declared.has(t.name))
      .map((t) => ({
        name: t.name,
        label: t.name,
        description: t.description,
        parameters: t.parameters,
        // Visible to the model beside OpenClaw's Tool Search catalog: the
        // engine's system prompt addition tells the model to call it by name.
        catalogMode: "direct-only",
        execute: (toolCallId: string, args: unknown) =>
          sessionId ? run(sessionId, toolCallId, t.name, args) : Promise.resolve(toolError("no session to run the tool in")),
      }));
  }
}

/** A tool result the model reads as an error. */
export function toolError(text: string): ToolAnswer {
  return { content: [{ type: "text", text }], details: { ctxgate: true, isError: true } };
}
