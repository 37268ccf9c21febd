// The smallest engine worth running (docs/engines-in-typescript.md): it
// holds each session's messages in memory and assembles the newest ones
// that fit the budget, never splitting a tool call from its result.
import { type ContextEngine, type pb, messageTokens, serveMain } from "../src/index.js";

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
    let kept: Message[] = [];
    let tokens = 0;
    for (const m of [...req.messages].reverse()) {
      ctx.check(); // stops when the caller cancels or the deadline passes
      const t = messageTokens(m);
      if (kept.length > 0 && req.tokenBudget != null && tokens + t > req.tokenBudget) break;
      kept.unshift(m);
      tokens += t;
    }
    // A tool result whose call was cut off goes too.
    const calls = new Set(kept.flatMap((m) => m.content.map((p) => p.toolCall?.id)));
    kept = kept.filter((m) => m.content.every((p) => !p.toolResult || calls.has(p.toolResult.toolCallId)));
    return { messages: kept, estimatedTokens: kept.reduce((n, m) => n + messageTokens(m), 0) };
  },
  async compact() {
    return { delegateToHost: { reason: "the gateway's built-in compaction does it" } };
  },
};

await serveMain(() => engine, { program: "minimal-engine" });
