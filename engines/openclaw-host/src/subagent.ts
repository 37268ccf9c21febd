// runtime.subagent: OpenClaw runs a sub-agent (a child session with its own
// model loop); the host runs a bounded model loop over Host.LlmComplete,
// within the engine call that asked for it, with the plugin's sub-agent
// tools (audience SUBAGENT or ALL) offered through a one-line text
// protocol, since LlmComplete carries text only.
import { randomUUID } from "node:crypto";
import type { CallContext } from "@ctxgate/engine-sdk";
import { BoundedMap } from "./bounded.js";
import type { OcMessage } from "./convert.js";
import type { LlmCompleteMessage } from "./openclaw-types.js";
import { current, llmCompleteFor, within } from "./runtime.js";
import type { Tools } from "./tools.js";

/** The sub-agent loop's model calls: the host's own, on the run's grant. */
const llmComplete = llmCompleteFor(() => ({ kind: "host", id: "openclaw-host.subagent" }));

/** Model calls one sub-agent run makes at most. */
export const MAX_STEPS = 6;
/** Child sessions (their messages) kept at most. */
const MAX_SESSIONS = 256;

interface Run {
  sessionKey: string;
  done: Promise<void>;
  status: "running" | "ok" | "error";
  error?: string;
}

const TOOL_CALL = /TOOL_CALL\s*(\{[\s\S]*\})\s*$/;

/** A tool call in a model's reply, if it made one. */
export function parseToolCall(text: string): { name: string; arguments: Record<string, unknown> } | undefined {
  const m = TOOL_CALL.exec(text.trim());
  if (!m) return undefined;
  try {
    const v = JSON.parse(m[1]!) as { name?: unknown; tool?: unknown; arguments?: unknown };
    const name = typeof v.name === "string" ? v.name : typeof v.tool === "string" ? v.tool : undefined;
    if (!name) return undefined;
    const args =
      v.arguments && typeof v.arguments === "object" && !Array.isArray(v.arguments)
        ? (v.arguments as Record<string, unknown>)
        : {};
    return { name, arguments: args };
  } catch {
    return undefined;
  }
}

export class Subagents {
  private readonly runs = new Map<string, Run>();
  private readonly sessions = new BoundedMap<string, OcMessage[]>(MAX_SESSIONS);

  constructor(
    private readonly tools: Tools,
    private readonly log: (line: string) => void,
  ) {}

  private protocol(): string {
    const offered = this.tools.definitions.filter(
      (t) => t.audience === "TOOL_AUDIENCE_SUBAGENT" || t.audience === "TOOL_AUDIENCE_ALL",
    );
    if (offered.length === 0) return "";
    return [
      "You can use these tools. To call one, answer with exactly one line and nothing else:",
      'TOOL_CALL {"name": "<tool name>", "arguments": {<arguments as JSON>}}',
      "The next message gives you its result. When you have the answer, reply without TOOL_CALL.",
      "",
      ...offered.map((t) => `- ${t.name}: ${t.description}\n  arguments (JSON Schema): ${t.parametersJsonSchema}`),
    ].join("\n");
  }

  /** The runtime.subagent object a plugin receives. */
  api(): Record<string, unknown> {
    return {
      run: (p: { sessionKey?: string; message?: string; extraSystemPrompt?: string }) => this.run(p),
      waitForRun: (p: { runId?: string; timeoutMs?: number }) => this.waitForRun(p),
      getSessionMessages: (p: { sessionKey?: string; limit?: number }) => this.getSessionMessages(p),
      getSession: (p: { sessionKey?: string }) => ({
        sessionKey: p.sessionKey,
        messages: this.sessions.get(p.sessionKey ?? "") ?? [],
      }),
      deleteSession: async (p: { sessionKey?: string }) => {
        this.sessions.delete(p.sessionKey ?? "");
      },
    };
  }

  async run(p: { sessionKey?: string; message?: string; extraSystemPrompt?: string }): Promise<{ runId: string }> {
    const ctx = current.getStore();
    const sessionKey = String(p.sessionKey ?? "");
    const runId = `run-${randomUUID()}`;
    const messages: OcMessage[] = [
      { role: "user", content: [{ type: "text", text: String(p.message ?? "") }], timestamp: Date.now() },
    ];
    this.sessions.set(sessionKey, messages);
    const entry: Run = { sessionKey, status: "running", done: Promise.resolve() };
    entry.done = (
      ctx
        ? within(ctx, () => this.loop(ctx, sessionKey, messages, p.extraSystemPrompt ?? ""))
        : Promise.reject(new Error("runtime.subagent.run is only available during an engine call"))
    )
      .then(() => {
        entry.status = "ok";
      })
      .catch((e: unknown) => {
        entry.status = "error";
        entry.error = e instanceof Error ? e.message : String(e);
        this.log(`sub-agent run ${runId} (${sessionKey}) failed: ${entry.error}`);
      });
    this.runs.set(runId, entry);
    return { runId };
  }

  private async loop(ctx: CallContext, sessionKey: string, messages: OcMessage[], extra: string): Promise<void> {
    const systemPrompt = [extra, this.protocol()].filter(Boolean).join("\n\n");
    const history: LlmCompleteMessage[] = [{ role: "user", content: textOf(messages[0]!) }];
    for (let step = 1; step <= MAX_STEPS; step++) {
      ctx.check();
      const r = await llmComplete({ messages: history, systemPrompt, purpose: "openclaw-host.subagent" });
      const text = r.text ?? "";
      messages.push({ role: "assistant", content: [{ type: "text", text }], timestamp: Date.now() });
      history.push({ role: "assistant", content: text });
      const call = parseToolCall(text);
      if (!call) return;
      const offered = this.tools.definitions.find((t) => t.name === call.name && t.audience !== "TOOL_AUDIENCE_MAIN");
      const result = offered
        ? await this.tools.run(
            call.name,
            `${sessionKey}-step-${step}`,
            call.arguments,
            { sessionKey, sessionId: sessionKey },
            ctx,
          )
        : { content: [{ text: `unknown tool ${JSON.stringify(call.name)}` }], isError: true };
      const resultText = (result.content ?? []).map((c) => c.text ?? "").join("\n");
      messages.push({
        role: "toolResult",
        toolCallId: `${sessionKey}-step-${step}`,
        toolName: call.name,
        content: [{ type: "text", text: resultText }],
        isError: result.isError === true,
        timestamp: Date.now(),
      });
      history.push({
        role: "user",
        content: `Result of ${call.name}${result.isError ? " (error)" : ""}:\n${resultText}`,
      });
    }
    throw new Error(`the sub-agent made ${MAX_STEPS} model calls without a final answer`);
  }

  async waitForRun(p: { runId?: string; timeoutMs?: number }): Promise<{ status: string; error?: string }> {
    const run = this.runs.get(String(p.runId ?? ""));
    if (!run) return { status: "error", error: `unknown run ${String(p.runId)}` };
    const timeoutMs = typeof p.timeoutMs === "number" && p.timeoutMs > 0 ? p.timeoutMs : 60_000;
    let timer: NodeJS.Timeout | undefined;
    const timedOut = await Promise.race([
      run.done.then(() => false),
      new Promise<boolean>((r) => {
        timer = setTimeout(() => r(true), timeoutMs);
      }),
    ]);
    clearTimeout(timer);
    if (timedOut) return { status: "timeout" };
    return run.status === "ok" ? { status: "ok" } : { status: "error", error: run.error ?? "failed" };
  }

  async getSessionMessages(p: { sessionKey?: string; limit?: number }): Promise<{ messages: OcMessage[] }> {
    const all = this.sessions.get(String(p.sessionKey ?? "")) ?? [];
    const limit = typeof p.limit === "number" && p.limit > 0 ? p.limit : all.length;
    return { messages: all.slice(-limit) };
  }
}

function textOf(m: OcMessage): string {
  if (typeof m.content === "string") return m.content;
  return ((m.content as { type?: string; text?: string }[]) ?? [])
    .map((b) => (b.type === "text" ? (b.text ?? "") : ""))
    .join("\n");
}
