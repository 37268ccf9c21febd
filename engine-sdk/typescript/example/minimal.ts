// The smallest engine worth running (docs/engines-in-typescript.md): it
// holds each session's messages in memory and assembles the newest ones
// that fit the budget, never splitting a tool call from its result.
import { type ContextEngine, type pb, fitBudget, serveMain } from "../src/index.js";

type Message = pb.AgentMessage__Output;
const sessions = new Map<string, Map<string, Message>>();

const engine: ContextEngine = {
  async getInfo() {
    return { id: "minimal", name: "Minimal engine", contractVersion: "1.0", implementedMethods: ["GetInfo", "Ingest", "Assemble", "Compact"] };
  },
  async ingest(req) {
    const held = sessions.get(req.sessionId) ?? new Map<string, Message>();
    sessions.set(req.sessionId, held);
    if (held.has(req.message!.id)) return { ingested: false };
    held.set(req.message!.id, req.message!);
    return { ingested: true };
  },
  async assemble(req, ctx) {
    ctx.check(); // stops when the caller cancels or the deadline passes
    // The newest messages that fit, a tool call kept or dropped with its results.
    return fitBudget(req.messages, req.tokenBudget);
  },
  async compact() {
    return { delegateToHost: { reason: "the gateway's built-in compaction does it" } };
  },
};

await serveMain(() => engine, { program: "minimal-engine" });
