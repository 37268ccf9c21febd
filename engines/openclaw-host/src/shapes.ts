// The contract's request fields in OpenClaw's shapes: flat anchors, session
// targets and runtime settings as OpenClaw 2026.9.6 builds them (lowercase
// string enums, `null` for an unset value, no protobuf helper keys), and
// OpenClaw's host-param projection (`acceptedHostParams`).
import type { pb } from "@ctxgate/engine-sdk";
import type {
  CommitTurnRuntimeContext,
  ContextEngineInfo,
  ContextEngineMethod,
  ContextEngineRuntimeContext,
  ContextEngineRuntimeReasonCode,
  ContextEngineRuntimeSettings,
  ContextEngineSessionTarget,
  TranscriptEntryAnchor,
  TranscriptTurnAdmission,
} from "./openclaw-types.js";

type Maybe<T> = T | null | undefined;

/** A proto3 optional string: blank means unset. */
function str(v: Maybe<string>): string | undefined {
  return typeof v === "string" && v !== "" ? v : undefined;
}

function num(v: Maybe<number | string>): number | undefined {
  if (v === null || v === undefined) return undefined;
  const n = Number(v);
  return Number.isFinite(n) ? n : undefined;
}

/** OpenClaw's TranscriptEntryAnchor: exactly its ten keys
 * (`idempotencyKey` only when set), frozen as OpenClaw's builder makes it. */
export function anchor(a: Maybe<pb.TranscriptEntryAnchor__Output>): TranscriptEntryAnchor {
  const idempotencyKey = str(a?.idempotencyKey);
  return Object.freeze({
    agentId: a?.agentId ?? "",
    sessionId: a?.sessionId ?? "",
    sessionKey: a?.sessionKey ?? "",
    storePath: a?.storePath ?? "",
    generation: a?.generation ?? "",
    entryId: a?.entryId ?? "",
    rawSeq: Number(a?.rawSeq ?? 0),
    effectiveParentId: str(a?.effectiveParentId) ?? null,
    activeMessagePosition: Number(a?.activeMessagePosition ?? 0),
    ...(idempotencyKey !== undefined ? { idempotencyKey } : {}),
  });
}

/** OpenClaw's TranscriptTurnAdmission: the flat anchor plus the turn. */
export function admission(a: Maybe<pb.TranscriptTurnAdmission__Output>): TranscriptTurnAdmission {
  return Object.freeze({ ...anchor(a?.anchor), logicalTurnId: a?.logicalTurnId ?? "", role: "user" as const });
}

/** The session target commitTurn gets: the admission's identity. */
export function admissionTarget(a: TranscriptEntryAnchor): ContextEngineSessionTarget {
  return { agentId: a.agentId, sessionId: a.sessionId, sessionKey: a.sessionKey, storePath: a.storePath };
}

/** OpenClaw's ContextEngineSessionTarget: set keys only. */
export function sessionTarget(t: Maybe<pb.SessionTarget__Output>): ContextEngineSessionTarget | undefined {
  if (!t) return undefined;
  const out: ContextEngineSessionTarget = {};
  const agentId = str(t.agentId);
  const sessionId = str(t.sessionId);
  const sessionKey = str(t.sessionKey);
  const storePath = str(t.storePath);
  const threadId = str(t.threadId);
  if (agentId !== undefined) out.agentId = agentId;
  if (sessionId !== undefined) out.sessionId = sessionId;
  if (sessionKey !== undefined) out.sessionKey = sessionKey;
  if (storePath !== undefined) out.storePath = storePath;
  if (threadId !== undefined) out.threadId = threadId;
  return out;
}

/** A session target as the contract carries it (CompactResult's successor). */
export function sessionTargetToProto(t: ContextEngineSessionTarget): pb.SessionTarget {
  const out: pb.SessionTarget = {};
  if (typeof t.agentId === "string" && t.agentId) out.agentId = t.agentId;
  if (typeof t.sessionId === "string" && t.sessionId) out.sessionId = t.sessionId;
  if (typeof t.sessionKey === "string" && t.sessionKey) out.sessionKey = t.sessionKey;
  if (typeof t.storePath === "string" && t.storePath) out.storePath = t.storePath;
  if (typeof t.threadId === "string" || typeof t.threadId === "number") out.threadId = String(t.threadId);
  return out;
}

/** `PREFIX_SOME_VALUE` → `some_value`; UNSPECIFIED (or anything else) → null. */
function lowerEnum<T extends string>(v: Maybe<string | number>, prefix: string, allowed: readonly T[]): T | null {
  if (typeof v !== "string" || !v.startsWith(prefix)) return null;
  const name = v.slice(prefix.length).toLowerCase();
  return (allowed as readonly string[]).includes(name) ? (name as T) : null;
}

const REASON_CODES = [
  "provider_timeout",
  "provider_unavailable",
  "rate_limited",
  "context_overflow",
  "runtime_unavailable",
  "unknown",
] as const satisfies readonly ContextEngineRuntimeReasonCode[];

/**
 * OpenClaw's ContextEngineRuntimeSettings (schema 1) from the contract's.
 * `runtime.host` is "openclaw", as OpenClaw's type has it (the host
 * presents OpenClaw's API); which host really runs the turn is in
 * `executionHost`, as the gateway says it.
 */
export function runtimeSettings(s: Maybe<pb.RuntimeSettings__Output>): ContextEngineRuntimeSettings | undefined {
  if (!s) return undefined;
  const reason = (v: Maybe<string | number>) => lowerEnum(v, "REASON_CODE_", REASON_CODES);
  return {
    schemaVersion: 1,
    runtime: {
      host: "openclaw",
      mode: lowerEnum(s.runtime?.mode, "RUNTIME_MODE_", ["normal", "fallback", "degraded"] as const) ?? "normal",
      harnessId: str(s.runtime?.harnessId) ?? null,
      runtimeId: str(s.runtime?.runtimeId) ?? null,
    },
    model: {
      requested: str(s.model?.requested) ?? null,
      resolved: str(s.model?.resolved) ?? null,
      provider: str(s.model?.provider) ?? null,
      family: str(s.model?.family) ?? null,
    },
    contextEngineSelection: {
      selectedId: str(s.contextEngineSelection?.selectedId) ?? null,
      source:
        lowerEnum(s.contextEngineSelection?.source, "SELECTION_SOURCE_", [
          "configured",
          "default",
          "unknown",
        ] as const) ?? (str(s.contextEngineSelection?.selectedId) ? "configured" : "unknown"),
    },
    executionHost: { id: str(s.executionHost?.id) ?? null, label: str(s.executionHost?.label) ?? null },
    limits: {
      promptTokenBudget: num(s.limits?.promptTokenBudget) ?? null,
      maxOutputTokens: num(s.limits?.maxOutputTokens) ?? null,
    },
    diagnostics: {
      fallbackReason: reason(s.diagnostics?.fallbackReason),
      degradedReason: reason(s.diagnostics?.degradedReason),
    },
  };
}

function promptCache(p: pb.PromptCache__Output): Record<string, unknown> {
  const out: Record<string, unknown> = {};
  if (str(p.retention)) out["retention"] = p.retention;
  const u = p.lastCallUsage;
  if (u) {
    const usage: Record<string, unknown> = {};
    for (const k of ["input", "output", "cacheRead", "cacheWrite", "total"] as const) {
      if (num(u[k]) !== undefined) usage[k] = num(u[k]);
    }
    if (u.contextUsage) {
      usage["contextUsage"] = u.contextUsage.available
        ? {
            state: "available",
            promptTokens: num(u.contextUsage.promptTokens) ?? 0,
            totalTokens: num(u.contextUsage.totalTokens) ?? 0,
          }
        : { state: "unavailable" };
    }
    out["lastCallUsage"] = usage;
  }
  const o = p.observation;
  if (o) {
    out["observation"] = {
      broke: o.broke === true,
      ...(num(o.previousCacheRead) !== undefined ? { previousCacheRead: num(o.previousCacheRead) } : {}),
      ...(num(o.cacheRead) !== undefined ? { cacheRead: num(o.cacheRead) } : {}),
      ...(o.changes.length > 0 ? { changes: o.changes.map((c) => ({ code: c.code, detail: c.detail })) } : {}),
    };
  }
  if (num(p.lastCacheTouchAtUnixMs) !== undefined) out["lastCacheTouchAt"] = num(p.lastCacheTouchAtUnixMs);
  if (num(p.expiresAtUnixMs) !== undefined) out["expiresAt"] = num(p.expiresAtUnixMs);
  return out;
}

/** The contract's RuntimeContext in OpenClaw's names and shapes (its open
 * `extra` entries are JSON texts, parsed). No host capabilities: the
 * engine adds `llm` and `rewriteTranscriptEntries` where OpenClaw does. */
export function runtimeContextFields(rc: Maybe<pb.RuntimeContext__Output>): ContextEngineRuntimeContext {
  const out: ContextEngineRuntimeContext = { transcriptStorage: { kind: "sqlite" } };
  if (!rc) return out;
  const strings = [
    "cwd",
    "agentHarnessId",
    "forceReason",
    "preflightCompactionTrigger",
    "workspaceDir",
    "agentDir",
    "provider",
    "modelId",
    "thinkLevel",
    "senderId",
  ] as const;
  for (const k of strings) {
    // cwd may be "" on purpose (a task with no working directory).
    if (typeof rc[k] === "string" && (rc[k] !== "" || k === "cwd")) out[k] = rc[k];
  }
  if (rc.allowDeferredCompactionExecution) out.allowDeferredCompactionExecution = true;
  if (num(rc.tokenBudget) !== undefined) out.tokenBudget = num(rc.tokenBudget);
  if (num(rc.currentTokenCount) !== undefined) out.currentTokenCount = num(rc.currentTokenCount);
  if (rc.promptCache) out.promptCache = promptCache(rc.promptCache);
  const target = sessionTarget(rc.sessionTarget);
  if (target) out.sessionTarget = target;
  for (const [k, v] of Object.entries(rc.extra ?? {})) {
    try {
      out[k] = JSON.parse(v) as unknown;
    } catch {
      out[k] = v;
    }
  }
  return out;
}

/** What OpenClaw persists with a durable turn and hands commitTurn:
 * `{provider, modelId, modelContextWindow, tokenBudget}`, JSON only. */
export function commitTurnRuntimeContext(rc: Maybe<pb.RuntimeContext__Output>): CommitTurnRuntimeContext | undefined {
  if (!rc) return undefined;
  const out: CommitTurnRuntimeContext = {};
  if (str(rc.provider)) out.provider = rc.provider!;
  if (str(rc.modelId)) out.modelId = rc.modelId!;
  const window = rc.extra?.["modelContextWindow"];
  if (window !== undefined && Number.isFinite(Number(window))) out.modelContextWindow = Number(window);
  if (num(rc.tokenBudget) !== undefined) out.tokenBudget = num(rc.tokenBudget);
  return out;
}

/** OpenClaw's host params (registry-contract.ts). */
export const CONTEXT_ENGINE_HOST_PARAMS: ReadonlySet<string> = new Set([
  "sessionKey",
  "prompt",
  "runtimeSettings",
  "sessionTarget",
  "runtimeContext",
  "abortSignal",
]);

/**
 * OpenClaw's projectContextEngineHostParams, verbatim: with
 * `info.acceptedHostParams` set, every host param it does not list is
 * removed (an empty list removes all six, even compact's `sessionKey`),
 * except compact's `abortSignal`; other keys pass.
 */
export function projectHostParams<P extends object>(
  info: Maybe<ContextEngineInfo>,
  method: ContextEngineMethod,
  params: P,
): P {
  const accepted = info?.acceptedHostParams;
  if (!accepted) return params;
  return Object.fromEntries(
    Object.entries(params).filter(
      ([key]) =>
        accepted.includes(key) ||
        !CONTEXT_ENGINE_HOST_PARAMS.has(key) ||
        (method === "compact" && key === "abortSignal"),
    ),
  ) as P;
}
