// openclaw/plugin-sdk/core as the ctxgate OpenClaw host provides it: the
// helpers context-engine plugins import at run time (OpenClaw's exports 66
// names, most for channel plugins).
export {
  buildJsonPluginConfigSchema,
  buildPluginConfigSchema,
  definePluginEntry,
  emptyPluginConfigSchema,
} from "./internal/config-schema.js";

/** Marks a compaction the plugin hands back to the host: the host answers
 * Compact with delegate_to_host (ctxgate's built-in compaction). */
export const DELEGATED_TO_HOST = Symbol.for("ctxgate.openclaw-host.delegateCompactionToRuntime");

function nonBlank(value) {
  return typeof value === "string" && value.trim() ? value.trim() : undefined;
}

/** `agent:<agentId>:<rest>` → agentId. */
function agentOfSessionKey(key) {
  const parts = typeof key === "string" ? key.split(":") : [];
  return parts.length >= 3 && parts[0] === "agent" && parts[1].trim() && parts.slice(2).join(":").trim()
    ? parts[1].trim()
    : undefined;
}

/** OpenClaw's assertCompactionSessionIdentity (src/context-engine/delegate.ts). */
function assertCompactionSessionIdentity({ agentId, sessionId, sessionKey, sessionTarget }) {
  const targetAgentId = nonBlank(sessionTarget?.agentId);
  const targetSessionId = nonBlank(sessionTarget?.sessionId);
  const targetSessionKey = nonBlank(sessionTarget?.sessionKey);
  const requestedAgentId = nonBlank(agentId);
  const callerSessionId = nonBlank(sessionId);
  const requestedSessionKey = nonBlank(sessionKey);
  const keyAgentId = agentOfSessionKey(requestedSessionKey);
  if (
    (requestedAgentId && targetAgentId && requestedAgentId !== targetAgentId) ||
    (callerSessionId && targetSessionId && callerSessionId !== targetSessionId) ||
    (requestedSessionKey && targetSessionKey && requestedSessionKey !== targetSessionKey) ||
    (keyAgentId && targetAgentId && keyAgentId !== targetAgentId)
  ) {
    throw new Error("Context-engine successor target conflicts with the caller session identity");
  }
  const resolvedAgentId = targetAgentId ?? requestedAgentId;
  const sessionKeyAgentId = agentOfSessionKey(targetSessionKey ?? requestedSessionKey);
  if (sessionKeyAgentId && resolvedAgentId && sessionKeyAgentId !== resolvedAgentId) {
    throw new Error("Context-engine successor session key conflicts with its agent identity");
  }
}

/**
 * OpenClaw's delegateCompactionToRuntime: run the host's own compaction.
 * The identity is checked as OpenClaw checks it; the host then answers
 * Compact with delegate_to_host, so the gateway's built-in compaction
 * runs (its result reaches the gateway, not this promise).
 */
export async function delegateCompactionToRuntime(params) {
  const runtimeContext = params?.runtimeContext ?? {};
  assertCompactionSessionIdentity({
    agentId: params?.agentId ?? runtimeContext.agentId,
    sessionId: params?.sessionId,
    sessionKey: params?.sessionKey ?? runtimeContext.sessionKey,
    sessionTarget: params?.sessionTarget ?? runtimeContext.sessionTarget,
  });
  return {
    ok: true,
    compacted: false,
    reason: "delegated to the host's built-in compaction",
    result: undefined,
    [DELEGATED_TO_HOST]: { customInstructions: params?.customInstructions },
  };
}

/** OpenClaw's memory prompt supplement: ctxgate hosts no memory plugins,
 * so there is nothing to add. */
export function buildMemorySystemPromptAddition(_params) {
  return undefined;
}

/** The async form (OpenClaw prepares the memory section first). */
export async function prepareMemorySystemPromptAddition(_params) {
  return undefined;
}

/** A tool result whose text is the payload as JSON (agents/tools/tool-results.ts). */
export function jsonResult(payload) {
  return { content: [{ type: "text", text: JSON.stringify(payload, null, 2) }], details: payload };
}
