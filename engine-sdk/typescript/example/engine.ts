// The SDK's example engine: small but real. It keeps every session's
// history itself (DELTA delivery: Assemble carries only what follows the
// cursor; a cursor it does not hold is the typed history gap, resynced
// through IngestBatch), durably in a journal file under --state-dir
// (appended and fsynced before it answers), commits durable turns
// idempotently, windows the history to the budget without splitting a
// tool call from its result, and offers the model one tool, `recall_search`.
import { appendFileSync, closeSync, existsSync, fsyncSync, mkdirSync, openSync, readFileSync } from "node:fs";
import { join } from "node:path";
import {
  type CallContext,
  type CompactOutcome,
  type ContextEngine,
  EngineError,
  type Progress,
  type pb,
  messageTokens,
  messagesTokens,
  tool,
  toolArguments,
  toolError,
  toolText,
} from "../src/index.js";

type Message = pb.AgentMessage__Output | pb.AgentMessage;

interface Session {
  messages: Message[];
  ids: Set<string>;
  commits: Set<string>;
}

type Record =
  | { op: "add"; s: string; m: Message[] }
  | { op: "commit"; s: string; key: string; m: Message[] }
  | { op: "forget"; s: string };

export const SEARCH_TOOL = "recall_search";

export class ExampleEngine implements ContextEngine {
  private readonly sessions = new Map<string, Session>();
  private readonly journal: string | undefined;

  /** `stateDir` undefined: in memory only (tests). */
  constructor(stateDir?: string) {
    if (stateDir) {
      mkdirSync(stateDir, { recursive: true });
      this.journal = join(stateDir, "journal.jsonl");
      if (existsSync(this.journal)) this.replay(readFileSync(this.journal, "utf8"));
    }
  }

  private replay(text: string): void {
    for (const line of text.split("\n")) {
      if (!line.trim()) continue;
      let r: Record;
      try {
        r = JSON.parse(line) as Record;
      } catch {
        // A line cut by a crash mid-write was never acknowledged.
        continue;
      }
      this.apply(r);
    }
  }

  private session(id: string): Session {
    let s = this.sessions.get(id);
    if (!s) {
      s = { messages: [], ids: new Set(), commits: new Set() };
      this.sessions.set(id, s);
    }
    return s;
  }

  private apply(r: Record): number {
    if (r.op === "forget") {
      this.sessions.delete(r.s);
      return 0;
    }
    const s = this.session(r.s);
    if (r.op === "commit") s.commits.add(r.key);
    let added = 0;
    for (const m of r.m) {
      if (s.ids.has(m.id!)) continue;
      s.ids.add(m.id!);
      s.messages.push(m);
      added++;
    }
    return added;
  }

  /** Durable before it is applied and answered. */
  private write(r: Record): number {
    if (this.journal) {
      const fd = openSync(this.journal, "a");
      try {
        appendFileSync(fd, JSON.stringify(r) + "\n");
        fsyncSync(fd);
      } finally {
        closeSync(fd);
      }
    }
    return this.apply(r);
  }

  private fresh(sessionId: string, list: readonly Message[]): Message[] {
    const s = this.sessions.get(sessionId);
    const seen = new Set<string>();
    return list.filter((m) => !(s?.ids.has(m.id!) ?? false) && !seen.has(m.id!) && seen.add(m.id!));
  }

  async getInfo(): Promise<pb.EngineInfo> {
    return {
      id: "ts-example",
      name: "TypeScript example engine",
      version: "0.1.0",
      contractVersion: "1.0",
      implementedMethods: [
        "GetInfo",
        "Ingest",
        "IngestBatch",
        "Assemble",
        "Compact",
        "AfterTurn",
        "CommitTurn",
        "ForgetSession",
      ],
      transcriptSemantics: {
        currentTurnFence: "CURRENT_TURN_FENCE_BEFORE_CURRENT_TURN_ENTRY_V1",
        turnAdvancementIdempotency: "TURN_ADVANCEMENT_IDEMPOTENCY_ATOMIC_IDEMPOTENT_V1",
      },
      historyDelivery: "HISTORY_DELIVERY_DELTA",
      replicaAffinity: "REPLICA_AFFINITY_SESSION",
    };
  }

  tools(): pb.ToolDefinition[] {
    return [
      tool(SEARCH_TOOL, "Search this session's earlier messages for a word or phrase; returns the matching messages.", {
        type: "object",
        properties: {
          query: { type: "string", description: "the text to look for (case-insensitive)" },
          limit: { type: "integer", minimum: 1, maximum: 50 },
        },
        required: ["query"],
      }),
    ];
  }

  async ingest(req: pb.IngestRequest__Output): Promise<pb.IngestResult> {
    const fresh = this.fresh(req.sessionId, [req.message!]);
    if (fresh.length === 0) return { ingested: false };
    this.write({ op: "add", s: req.sessionId, m: fresh });
    return { ingested: true };
  }

  async ingestBatch(req: pb.IngestBatchRequest__Output): Promise<pb.IngestBatchResult> {
    const fresh = this.fresh(req.sessionId, req.messages);
    if (fresh.length > 0) this.write({ op: "add", s: req.sessionId, m: fresh });
    return { ingestedCount: fresh.length };
  }

  async afterTurn(req: pb.AfterTurnRequest__Output): Promise<pb.AfterTurnResult> {
    this.checkCursor(req.sessionId, req.cursor);
    const fresh = this.fresh(req.sessionId, req.messages);
    if (fresh.length > 0) this.write({ op: "add", s: req.sessionId, m: fresh });
    return {};
  }

  async commitTurn(req: pb.CommitTurnRequest__Output): Promise<pb.CommitTurnResult> {
    if (this.sessions.get(req.sessionId)?.commits.has(req.advancementKey)) {
      return { status: "COMMIT_STATUS_DUPLICATE" };
    }
    this.write({ op: "commit", s: req.sessionId, key: req.advancementKey, m: this.fresh(req.sessionId, req.messages) });
    return { status: "COMMIT_STATUS_COMMITTED" };
  }

  async forgetSession(req: pb.ForgetSessionRequest__Output): Promise<pb.ForgetSessionResult> {
    if (this.sessions.has(req.sessionId)) this.write({ op: "forget", s: req.sessionId });
    return {};
  }

  /** A DELTA cursor this engine does not hold is a history gap. */
  private checkCursor(sessionId: string, cursor: pb.HistoryCursor__Output | null | undefined): void {
    if (!cursor) return;
    const s = this.sessions.get(sessionId);
    const held = s?.messages.length ?? 0;
    const holdsId = cursor.messageId === "" || (s?.ids.has(cursor.messageId) ?? false);
    if (!holdsId || held < Number(cursor.messageCount)) {
      const last = s?.messages[held - 1];
      throw EngineError.historyGap(
        last ? { messageId: last.id!, seq: held, messageCount: held, tokens: messagesTokens(s!.messages) } : undefined,
      );
    }
  }

  async assemble(req: pb.AssembleRequest__Output, ctx: CallContext): Promise<pb.AssembleResult> {
    let history: Message[];
    if (req.cursor) {
      this.checkCursor(req.sessionId, req.cursor);
      const held = this.sessions.get(req.sessionId)?.messages ?? [];
      const ids = new Set(held.map((m) => m.id));
      history = [...held, ...req.messages.filter((m) => !ids.has(m.id))];
    } else {
      history = req.messages;
    }
    const messages = window(history, req.tokenBudget, ctx);
    return { messages, estimatedTokens: messagesTokens(messages) };
  }

  async compact(req: pb.CompactRequest__Output, ctx: CallContext, progress: Progress): Promise<CompactOutcome> {
    const held = this.sessions.get(req.sessionId)?.messages ?? [];
    await progress.report("measuring", 1, 1, `${held.length} messages held`);
    ctx.check();
    // The example windows at assemble time: it keeps everything and
    // summarises nothing.
    return {
      result: {
        ok: true,
        compacted: false,
        reason: "the example engine windows each assembly; nothing to compact",
        tokensBefore: messagesTokens(held),
      },
    };
  }

  async callTool(req: pb.CallToolRequest__Output, ctx: CallContext): Promise<pb.CallToolResult> {
    if (req.name !== SEARCH_TOOL) return toolError(`unknown tool ${JSON.stringify(req.name)}`);
    const args = toolArguments(req);
    if (!args) return toolError("the arguments are not a JSON object");
    const query = args["query"];
    if (typeof query !== "string" || query.trim() === "") return toolError("`query` (a non-empty string) is required");
    const limit = typeof args["limit"] === "number" ? Math.min(50, Math.max(1, Math.floor(args["limit"]))) : 10;
    const needle = query.toLowerCase();
    const hits: string[] = [];
    for (const m of this.sessions.get(req.sessionId)?.messages ?? []) {
      ctx.check();
      const text = textOf(m);
      if (text.toLowerCase().includes(needle)) hits.push(`[${m.id}] ${text.slice(0, 400)}`);
    }
    if (hits.length === 0) return toolText(`nothing in this session mentions ${JSON.stringify(query)}`);
    return toolText(hits.slice(-limit).join("\n"));
  }
}

function textOf(m: Message): string {
  return (m.content ?? [])
    .map((p) => p.text ?? p.toolResult?.text ?? p.toolCall?.argumentsJson ?? p.thinking?.text ?? "")
    .filter(Boolean)
    .join(" ");
}

/** The newest messages that fit `budget`, oldest first, the newest always
 * kept, and no tool result without its call. */
export function window(history: readonly Message[], budget: number | undefined, ctx: CallContext): Message[] {
  if (budget === undefined || budget === null) return dropOrphans([...history]);
  let used = 0;
  let start = history.length;
  while (start > 0) {
    ctx.check();
    const t = messageTokens(history[start - 1]!);
    if (start < history.length && used + t > budget) break;
    used += t;
    start--;
  }
  return dropOrphans(history.slice(start));
}

function dropOrphans(list: Message[]): Message[] {
  const calls = new Set<string>();
  return list.filter((m) => {
    const parts = m.content ?? [];
    for (const p of parts) if (p.toolCall?.id) calls.add(p.toolCall.id);
    const results = parts.filter((p) => p.toolResult);
    return results.length === 0 || results.every((p) => calls.has(p.toolResult!.toolCallId!));
  });
}
