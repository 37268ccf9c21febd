// A recording probe: an OpenClaw context-engine plugin that does as little
// as a durable engine may and writes, for every call it gets, the method's
// name and the shape of its parameters (shape.js) as one JSON line appended
// to the file $OPENCLAW_PROBE_LOG. Plain ESM JavaScript with no imports
// outside this folder, so the real OpenClaw (native require / jiti) and
// engines/openclaw-host (import()) both load it unchanged.
//
// tests/openclaw-probe/run.sh loads it in both and compares the records.
import { appendFileSync } from "node:fs";
import { shapeOf } from "./shape.js";

const ID = "ctxgate-probe";

function record(method, params) {
  const file = process.env.OPENCLAW_PROBE_LOG;
  if (!file) return;
  const line = { at: Date.now(), pid: process.pid, method, shape: shapeOf(params) };
  appendFileSync(file, `${JSON.stringify(line)}\n`);
}

/** A rough token count: 4 characters a token. */
function tokens(message) {
  return Math.ceil(JSON.stringify(message ?? "").length / 4);
}

function createEngine() {
  const committed = new Set();
  return {
    info: {
      id: ID,
      name: "ctxgate recording probe",
      version: "0.1.0",
      ownsCompaction: true,
      // Durable turns: both values and commitTurn, or OpenClaw >= 2026.8
      // runs every turn on its legacy engine instead.
      transcriptSemantics: {
        currentTurnFence: "before-current-turn-entry-v1",
        turnAdvancementIdempotency: "atomic-idempotent-v1",
      },
    },
    async bootstrap(params) {
      record("bootstrap", params);
      return { bootstrapped: true, importedMessages: 0 };
    },
    async ingest(params) {
      record("ingest", params);
      return { ingested: true };
    },
    async ingestBatch(params) {
      record("ingestBatch", params);
      return { ingestedCount: Array.isArray(params?.messages) ? params.messages.length : 0 };
    },
    async assemble(params) {
      record("assemble", params);
      // The messages given, the oldest dropped while over the budget.
      const messages = Array.isArray(params?.messages) ? [...params.messages] : [];
      const budget = typeof params?.tokenBudget === "number" ? params.tokenBudget : Infinity;
      let total = messages.reduce((n, m) => n + tokens(m), 0);
      while (messages.length > 0 && total > budget) total -= tokens(messages.shift());
      return { messages, estimatedTokens: total };
    },
    async compact(params) {
      record("compact", params);
      return { ok: true, compacted: false, reason: "the probe keeps everything" };
    },
    async afterTurn(params) {
      record("afterTurn", params);
    },
    async commitTurn(params) {
      record("commitTurn", params);
      const key = String(params?.advancementKey);
      if (committed.has(key)) return { status: "duplicate" };
      committed.add(key);
      return { status: "committed" };
    },
    async maintain(params) {
      record("maintain", params);
      return { changed: false, bytesFreed: 0, rewrittenEntries: 0 };
    },
    async dispose() {
      record("dispose", {});
    },
  };
}

export default {
  id: ID,
  name: "ctxgate recording probe",
  description: "Records the shape of every context-engine call.",
  register(api) {
    api.registerContextEngine(ID, (ctx) => {
      // The factory's argument is recorded as a call of its own.
      record("factory", ctx);
      return createEngine();
    });
  },
};
