// What the plugin's runtime calls reach: the engine call in progress (its
// CallContext, carried through the plugin's own async work with
// AsyncLocalStorage) and, through its grant, the gateway's Host service.
// runtime.llm.complete → Host.LlmComplete.
import { AsyncLocalStorage } from "node:async_hooks";
import type { CallContext, pb } from "@ctxgate/engine-sdk";

export const current = new AsyncLocalStorage<CallContext>();

/** Runs `fn` as part of the engine call `ctx`. */
export function within<T>(ctx: CallContext, fn: () => T): T {
  return current.run(ctx, fn);
}

/** OpenClaw's LlmCompleteParams (direct form). */
export interface LlmCompleteParams {
  messages: { role: string; content: string }[];
  model?: string;
  maxTokens?: number;
  temperature?: number;
  reasoning?: string;
  systemPrompt?: string;
  signal?: AbortSignal;
  purpose?: string;
  agentId?: string;
  responseFormat?: string;
  execution?: unknown;
}

export class HostCallbackUnavailable extends Error {
  constructor(what: string) {
    super(
      `${what}: this engine call carries no host grant for llm_complete (the gateway grants it during calls whose operation may use the model, when it offers runtime-llm-complete)`,
    );
    this.name = "HostCallbackUnavailable";
  }
}

/** runtime.llm.complete for the call in progress. */
export async function llmComplete(params: LlmCompleteParams): Promise<Record<string, unknown>> {
  const ctx = current.getStore();
  if (!ctx?.host || !ctx.host.allows("llm_complete")) throw new HostCallbackUnavailable("runtime.llm.complete");
  const roles = new Set(["system", "user", "assistant"]);
  const req: pb.LlmCompleteRequest = {
    messages: (params.messages ?? []).filter((m) => roles.has(m.role)).map((m) => ({ role: m.role, content: String(m.content ?? "") })),
    purpose: params.purpose ?? "context-engine",
    ...(params.systemPrompt ? { systemPrompt: params.systemPrompt } : {}),
    ...(typeof params.maxTokens === "number" ? { maxTokens: Math.max(1, Math.floor(params.maxTokens)) } : {}),
    ...(typeof params.temperature === "number" ? { temperature: params.temperature } : {}),
    ...(params.reasoning ? { reasoning: params.reasoning } : {}),
    ...(params.responseFormat ? { responseFormat: params.responseFormat } : {}),
  };
  if (req.messages!.length === 0) req.messages = [{ role: "user", content: "" }];
  const r = await ctx.host.llmComplete(ctx, req);
  const u = r.usage;
  return {
    text: r.text,
    provider: r.provider,
    model: r.model,
    ...(r.responseModel ? { responseModel: r.responseModel } : {}),
    ...(r.stopReason ? { stopReason: r.stopReason } : {}),
    agentId: r.agentId,
    usage: {
      inputTokens: u?.inputTokens ?? undefined,
      outputTokens: u?.outputTokens ?? undefined,
      cacheReadTokens: u?.cacheReadTokens ?? undefined,
      cacheWriteTokens: u?.cacheWriteTokens ?? undefined,
      totalTokens: u?.totalTokens ?? undefined,
      costUsd: u?.costUsd ?? undefined,
    },
    execution: { mode: "direct" },
    audit: { caller: r.audit?.caller ?? "", purpose: r.audit?.purpose ?? req.purpose, sessionKey: r.audit?.sessionKey ?? "" },
  };
}
