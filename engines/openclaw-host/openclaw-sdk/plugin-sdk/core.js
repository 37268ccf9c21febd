// openclaw/plugin-sdk/core as the ctxgate OpenClaw host provides it: the
// helpers context-engine plugins import at run time.

/** Marks a compaction the plugin hands back to the host: the host answers
 * Compact with delegate_to_host (ctxgate's built-in compaction). */
export const DELEGATED_TO_HOST = Symbol.for("ctxgate.openclaw-host.delegateCompactionToRuntime");

/** OpenClaw's delegateCompactionToRuntime: run the host's own compaction. */
export async function delegateCompactionToRuntime(params) {
  return {
    ok: true,
    compacted: false,
    reason: "delegated to the host's built-in compaction",
    [DELEGATED_TO_HOST]: { customInstructions: params?.customInstructions },
  };
}

/** OpenClaw's memory prompt supplement: ctxgate hosts no memory plugins,
 * so there is nothing to add. */
export function buildMemorySystemPromptAddition(_params) {
  return undefined;
}
