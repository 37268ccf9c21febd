// What the plugin's runtime calls reach: the engine call in progress (its
// CallContext, carried through the plugin's own async work with
// AsyncLocalStorage) and, through its grant, the gateway's Host service.
// runtime.llm.complete → Host.LlmComplete, in OpenClaw's request and result
// shapes.
import { AsyncLocalStorage } from "node:async_hooks";
import { CallContext, type pb } from "@ctxgate/engine-sdk";
import type { LlmCompleteCaller, LlmCompleteParams, LlmCompleteResult } from "./openclaw-types.js";

export const current = new AsyncLocalStorage<CallContext>();

/** Runs `fn` as part of the engine call `ctx`. */
export function within<T>(ctx: CallContext, fn: () => T): T {
  return current.run(ctx, fn);
}

export class HostCallbackUnavailable extends Error {
  constructor(what: string) {
    super(
      `${what}: this engine call carries no host grant for llm_complete (the gateway grants it during calls ` +
        `whose operation may use the model, when it offers runtime-llm-complete)`,
    );
    this.name = "HostCallbackUnavailable";
  }
}

/** OpenClaw's provider-native `responseFormat` object as the contract's
 * string: `json_object`/`json_schema` → "json", `text` → "text". */
export function responseFormatOf(format: unknown): string | undefined {
  if (format === undefined || format === null) return undefined;
  const type = typeof format === "string" ? format : (format as { type?: unknown }).type;
  if (type === "json_object" || type === "json_schema" || type === "json") return "json";
  if (type === "text") return "text";
  return undefined;
}

const STOP_REASONS = new Set(["stop", "length", "toolUse", "error", "aborted"]);

/** The call's context, aborted also by the plugin's own `signal`. */
function withSignal(ctx: CallContext, signal: AbortSignal | undefined): CallContext {
  if (!signal) return ctx;
  return new CallContext(AbortSignal.any([ctx.signal, signal]), ctx.deadline, ctx.host, ctx.trace, ctx.span);
}

/**
 * runtime.llm.complete for the call in progress, on behalf of `caller`
 * (OpenClaw: `{kind: "plugin", id, name}` for api.runtime.llm,
 * `{kind: "context-engine", id: purpose}` for runtimeContext.llm). The
 * model is the gateway's: a `model` is not an override (ignored).
 */
export function llmCompleteFor(caller: (params: LlmCompleteParams) => LlmCompleteCaller) {
  return async (params: LlmCompleteParams): Promise<LlmCompleteResult> => {
    const ctx = current.getStore();
    if (!ctx?.host || !ctx.host.allows("llm_complete")) throw new HostCallbackUnavailable("runtime.llm.complete");
    if (params.execution !== undefined) {
      throw new Error(
        `runtime.llm.complete: execution mode ${JSON.stringify(params.execution?.mode)} is not available under ` +
          `ctxgate (only direct provider completions, through the gateway's model)`,
      );
    }
    params.signal?.throwIfAborted();
    const roles = new Set(["system", "user", "assistant"]);
    const format = responseFormatOf(params.responseFormat);
    const req: pb.LlmCompleteRequest = {
      messages: (params.messages ?? [])
        .filter((m) => roles.has(m.role))
        .map((m) => ({ role: m.role, content: String(m.content ?? "") })),
      purpose: params.purpose ?? "context-engine",
      ...(params.systemPrompt ? { systemPrompt: params.systemPrompt } : {}),
      ...(typeof params.maxTokens === "number" ? { maxTokens: Math.max(1, Math.floor(params.maxTokens)) } : {}),
      ...(typeof params.temperature === "number" ? { temperature: params.temperature } : {}),
      ...(params.reasoning ? { reasoning: params.reasoning } : {}),
      ...(format ? { responseFormat: format } : {}),
    };
    if (req.messages!.length === 0) req.messages = [{ role: "user", content: "" }];
    const call = withSignal(ctx, params.signal);
    let r: pb.LlmCompleteResult__Output;
    try {
      r = await ctx.host.llmComplete(call, req);
    } catch (e) {
      // The plugin's own abort is its AbortError, as a provider call's is.
      params.signal?.throwIfAborted();
      throw e;
    }
    const u = r.usage;
    const usage: LlmCompleteResult["usage"] = {};
    for (const k of [
      "inputTokens",
      "outputTokens",
      "cacheReadTokens",
      "cacheWriteTokens",
      "totalTokens",
      "costUsd",
    ] as const) {
      const v = u?.[k];
      if (v !== undefined && v !== null) usage[k] = Number(v);
    }
    const purpose = r.audit?.purpose || req.purpose;
    return {
      text: r.text,
      provider: r.provider,
      model: r.model,
      ...(r.responseModel ? { responseModel: r.responseModel } : {}),
      ...(r.stopReason && STOP_REASONS.has(r.stopReason)
        ? { stopReason: r.stopReason as NonNullable<LlmCompleteResult["stopReason"]> }
        : {}),
      agentId: r.agentId,
      usage,
      execution: { mode: "direct-provider", owner: { kind: "provider", id: r.provider } },
      audit: {
        caller: caller(params),
        ...(purpose ? { purpose } : {}),
        ...(r.audit?.sessionKey ? { sessionKey: r.audit.sessionKey } : {}),
      },
    };
  };
}
