// openclaw/plugin-sdk/session-transcript-runtime as the ctxgate OpenClaw
// host provides it: the visible transcript readers, served from the
// gateway's transcript (Host.ReadTranscript, under the grant of the engine
// call in progress) by the host process (src/transcript-reader.ts), with
// OpenClaw 2026.9.6's result shapes and defaults.

const HOST_BRIDGE = Symbol.for("ctxgate.openclaw-host.sdk");

function host() {
  const bridge = globalThis[HOST_BRIDGE];
  if (!bridge) {
    throw new Error("openclaw/plugin-sdk/session-transcript-runtime is served only inside the ctxgate OpenClaw host");
  }
  return bridge;
}

/** A read past the current-turn fence (the gateway enforces the fence: its
 * reads for pre-turn calls end before the admitted user entry). */
export class SessionTranscriptReadFenceError extends Error {
  constructor(message) {
    super(message);
    this.name = "SessionTranscriptReadFenceError";
  }
}

/** `scope = {sessionId, sessionKey?, agentId?, storePath?, sessionFile?, threadId?}` →
 * `[{entryId, parentId, seq, message, role, createdAt?, idempotencyKey?}]`. */
export async function readVisibleSessionTranscriptMessageEntries(scope) {
  return host().readVisibleSessionTranscriptMessageEntries(scope);
}

/** `{...scope, cursor?, maxBytes?, maxMessages?}` → a page, a reset, `missing` or `unavailable`. */
export async function readSessionTranscriptVisibleMessageDelta(params) {
  return host().readSessionTranscriptVisibleMessageDelta(params);
}
