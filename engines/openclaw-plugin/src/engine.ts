// The context engine this plugin registers in OpenClaw: a durable engine
// (transcriptSemantics + commitTurn, so OpenClaw 2026.8+ runs it) whose
// every call a ctxgate gateway answers. One OpenClaw turn is one harness
// turn at the gateway (ctxgate.v1.Harness/DriveTurn): the turn's first
// assemble opens it (the prompt is its user message) and takes its
// context; commitTurn appends what the model and tools produced and ends
// it accepted, so the gateway stores the turn once and delivers it to its
// engine through its outbox (CommitTurn exactly once). The gateway does
// the rest as for any turn: replicas, deadlines, quarantine that heals,
// its legacy engine while the configured one is out. A session OpenClaw
// held before the plugin ran it is imported once first (history.ts).
//
// OpenClaw quarantines an engine that throws for the life of its process,
// so a gateway that cannot be reached degrades per call (onGatewayDown:
// "fallback", the default): assemble answers with OpenClaw's own messages,
// and commitTurn throws, which leaves the commit in OpenClaw's durable
// outbox to be retried before its next turn (a retry finds its turn at the
// gateway by its advancement key and answers duplicate).
import { fromOpenClaw, type OcMessage, textOfContent, toOpenClaw } from "@ctxgate/engine-sdk/openclaw";
import type { PluginConfig } from "./config.js";
import { Drive } from "./drive.js";
import { type Gateway, orNone, unary } from "./gateway.js";
import type { AgentMessage } from "./gen/contextengine/v1/AgentMessage.js";
import type { Begin } from "./gen/ctxgate/v1/Begin.js";
import type { CompactionEvent__Output } from "./gen/ctxgate/v1/CompactionEvent.js";
import type { Context__Output } from "./gen/ctxgate/v1/Context.js";
import type { GetTranscriptResult__Output } from "./gen/ctxgate/v1/GetTranscriptResult.js";
import type { EndSubagentResult__Output } from "./gen/ctxgate/v1/EndSubagentResult.js";
import type { SessionInfo__Output } from "./gen/ctxgate/v1/SessionInfo.js";
import type { SpawnSubagentResult__Output } from "./gen/ctxgate/v1/SpawnSubagentResult.js";
import { type KnownSessions, turnsOf } from "./history.js";
import { type EngineTools, type ToolAnswer, toolError } from "./tools.js";

export const ENGINE_ID = "ctxgate";

/** Metadata the plugin stamps on a turn's last message at the gateway. */
export const ADVANCEMENT_KEY = "openclaw.advancementKey";
export const ENTRY_ID = "openclaw.entryId";

/** OpenClaw's embedded runner, as the gateway's host profile names it. */
const HOST = { id: "agent-harness:openclaw", label: "OpenClaw" };
const TURN_CAPABILITIES = ["bootstrap", "assemble-before-prompt", "after-turn", "maintain", "compact", "runtime-llm-complete"];
/** A commit retried after its process ended: the turn is recorded, not assembled. */
const CAPTURE_CAPABILITIES = ["bootstrap", "after-turn", "maintain", "compact"];
/** A window when OpenClaw names none (its own default). */
const DEFAULT_WINDOW = 200_000;
/** Transcript pages a retried commit reads back at most, looking for its key. */
const MAX_LOOKBACK_PAGES = 20;

export interface Logger {
  info(message: string): void;
  warn(message: string): void;
}

type Params = Record<string, unknown>;

interface OpenTurn {
  drive: Drive;
  /**
   * The gateway's entry ids of what the turn holds there: its user
   * message(s), then engine tool calls and their results. OpenClaw shows
   * the model its own copies after the context, so a context assembled
   * again (after a compaction) leaves them out.
   */
  ownIds: Set<string>;
  /** What assemble answered (the tool loop's assembles answer the same). */
  assembled: { messages: OcMessage[]; estimatedTokens: number; systemPromptAddition?: string };
  /** Engine tool calls the gateway holds already: the call (appended), and its result. */
  calls: Set<string>;
  results: Set<string>;
  /** Engine tools run one at a time in a turn (one stream; OpenClaw may run calls in parallel). */
  lane: Promise<unknown>;
}

/**
 * The turns open at the gateway, by OpenClaw session id, from the first
 * assemble to commitTurn: shared by the engines OpenClaw makes (one a run)
 * and the engine tools, which run inside them.
 */
export type OpenTurns = Map<string, OpenTurn>;

const str = (v: unknown): string | undefined => (typeof v === "string" && v.trim() !== "" ? v : undefined);
const num = (v: unknown): number | undefined => (typeof v === "number" && Number.isFinite(v) && v > 0 ? v : undefined);
const tokensOf = (text: string): number => Math.ceil(text.length / 4);

/**
 * A gateway context as OpenClaw's assemble answers it: OpenClaw appends the
 * turn's prompt itself, so the context's copy of the user message goes
 * (and its tokens, `userTokens`, from the estimate).
 */
function withoutTurn(context: Context__Output, turn: Set<string>, userTokens: number): OpenTurn["assembled"] {
  return {
    messages: context.messages.filter((m) => !turn.has(m.id)).flatMap((m) => toOpenClaw(m)),
    estimatedTokens: Math.max(0, Number(context.estimatedTokens) - userTokens),
    ...(context.systemPromptAddition ? { systemPromptAddition: context.systemPromptAddition } : {}),
  };
}

export class CtxgateEngine {
  readonly info = {
    id: ENGINE_ID,
    name: "ctxgate",
    version: "0.1.0",
    // The gateway compacts (through its engine, or built in): OpenClaw must not.
    ownsCompaction: true,
    transcriptSemantics: {
      currentTurnFence: "before-current-turn-entry-v1",
      turnAdvancementIdempotency: "atomic-idempotent-v1",
    },
  };
  /** The turns this engine opened and has not committed (dispose aborts those). */
  private readonly mine = new Map<string, OpenTurn>();

  constructor(
    private readonly gateway: Gateway,
    private readonly config: PluginConfig,
    private readonly log: Logger,
    private readonly turns: OpenTurns,
    private readonly tools: EngineTools,
    private readonly known: KnownSessions,
  ) {}

  /** The gateway session an OpenClaw session is: its agent and its key. */
  private session(params: Params): { agentId: string; sessionKey: string } {
    const sessionKey = str(params["sessionKey"]) ?? str(params["sessionId"]) ?? "";
    const agentId = this.config.agentId ?? /^agent:([^:]+):/.exec(sessionKey)?.[1] ?? "main";
    return { agentId, sessionKey };
  }

  /**
   * A failed gateway call: OpenClaw's answer for it in fallback mode (what
   * that means, `instead`, is in the warning), else an error.
   */
  private degrade<T>(operation: string, e: unknown, fallback: () => T, instead = "OpenClaw's own messages answer this turn"): T {
    const why = `ctxgate: ${operation} could not reach an answer from the gateway at ${this.config.target}: ${(e as Error).message}`;
    if (this.config.onGatewayDown === "strict") throw new Error(why);
    this.log.warn(`${why}; ${instead}`);
    return fallback();
  }

  async ingest(): Promise<{ ingested: boolean }> {
    // A durable engine hears of turns through commitTurn alone.
    return { ingested: false };
  }

  async assemble(params: Params): Promise<OpenTurn["assembled"]> {
    const sessionId = String(params["sessionId"] ?? "");
    const open = this.turns.get(sessionId);
    if (open && this.mine.get(sessionId) === open) return open.assembled; // the tool loop: the turn's context holds until it commits
    // Another engine's turn left open in this process (a run that never committed nor disposed): it ends aborted.
    if (open) this.forget(sessionId, open);
    const history = (params["messages"] as OcMessage[] | undefined) ?? [];
    const own = () => ({ messages: history, estimatedTokens: 0 });
    const prompt = str(params["prompt"]);
    if (!prompt) return own(); // no user turn to open (a heartbeat's assemble): OpenClaw's history
    const budget = num(params["tokenBudget"]);
    const settings = (params["runtimeSettings"] ?? {}) as { limits?: { maxOutputTokens?: number | null } };
    const reserve = num(settings.limits?.maxOutputTokens) ?? 1_024;
    const begin: Begin = {
      session: this.session(params),
      host: { ...HOST, capabilities: TURN_CAPABILITIES },
      model: {
        id: str(params["model"]) ?? "openclaw",
        contextWindow: budget !== undefined ? Math.ceil(budget) + tokensOf(prompt) + reserve : DEFAULT_WINDOW,
        maxOutputTokens: reserve,
      },
      userMessages: [fromOpenClaw({ role: "user", content: prompt }, "")],
      busyPolicy: "BUSY_POLICY_ENQUEUE",
    };
    const availableTools = params["availableTools"];
    // OpenClaw lists the engine's tools among its own (this plugin offers them): the gateway wants its own only.
    if (availableTools instanceof Set) begin.availableTools = [...availableTools].map(String).filter((t) => !this.tools.has(t));
    const drive = new Drive(this.gateway);
    try {
      if (history.length > 0 && !this.known.has(sessionId)) await this.importIfNew(params, sessionId, history);
      const wait = this.config.timeouts.assembleMs;
      drive.send({ begin });
      const admitted = await drive.until("admitted", wait);
      const selected = await drive.until("engineSelected", wait);
      const context = await drive.until("context", wait);
      if (selected.warning) this.log.warn(`ctxgate: ${selected.warning}`);
      for (const w of drive.warnings) this.log.warn(`ctxgate: ${w}`);
      const ownIds = new Set(admitted.entryIds);
      const assembled = withoutTurn(context, ownIds, tokensOf(prompt));
      this.tools.update(context.engineTools);
      const turn = { drive, ownIds, assembled, calls: new Set<string>(), results: new Set<string>(), lane: Promise.resolve() };
      this.turns.set(sessionId, turn);
      this.mine.set(sessionId, turn);
      return assembled;
    } catch (e) {
      drive.cancel();
      return this.degrade("assemble", e, own);
    }
  }

  async commitTurn(params: Params): Promise<{ status: "committed" | "duplicate" }> {
    const sessionId = String(params["sessionId"] ?? "");
    const key = String(params["advancementKey"] ?? "");
    const messages = (params["messages"] as OcMessage[] | undefined) ?? [];
    const terminal = (params["terminal"] ?? {}) as { entryId?: string };
    const mine = this.mine.get(sessionId);
    let open: OpenTurn | undefined;
    if (mine) {
      await mine.lane; // a tool still running in the turn finishes first (one stream)
      // A tool run that failed mid-way aborted the turn: it is recorded whole, as a retry is.
      open = this.turns.get(sessionId) === mine ? mine : undefined;
      this.forget(sessionId, mine);
    }
    const wait = this.config.timeouts.commitMs;
    let drive = open?.drive;
    try {
      if (!drive) {
        // Retried (OpenClaw's outbox, maybe in a later process): the turn may be stored already.
        if (await this.committed(params, key)) return { status: "duplicate" };
        const user = messages[0];
        if (user?.role !== "user") throw new Error("the turn's messages do not start with its user message");
        drive = await this.capture(params, [user], wait);
      }
      // The user message went in when the turn opened, engine tool calls and
      // their results as they ran; the rest follows.
      const rest = withoutHeld(messages.slice(1), open).map((m) => fromOpenClaw(m, ""));
      const last = rest.at(-1);
      if (last) {
        last.metadata = { ...last.metadata, [ADVANCEMENT_KEY]: key, ...(terminal.entryId ? { [ENTRY_ID]: terminal.entryId } : {}) };
        drive.send({ append: { messages: rest as AgentMessage[] } });
        await drive.until("appended", wait);
      }
      drive.send({ end: { outcome: "TURN_OUTCOME_ACCEPTED" } });
      const ended = await drive.until("ended", wait);
      drive.finish();
      for (const w of drive.warnings) this.log.warn(`ctxgate: ${w}`);
      if (!ended.engineCommitted) this.log.info("ctxgate: the gateway stored the turn; its engine gets it from the gateway's outbox");
      return { status: "committed" };
    } catch (e) {
      drive?.cancel();
      // Thrown, the commit stays in OpenClaw's durable outbox and is retried before the next turn.
      throw new Error(`ctxgate: commitTurn ${key} could not complete at the gateway at ${this.config.target}: ${(e as Error).message}`);
    }
  }

  /** A turn recorded without assembling, begun with its user message(s) and admitted. */
  private async capture(params: Params, users: OcMessage[], wait: number): Promise<Drive> {
    const context = (params["runtimeContext"] ?? {}) as { modelId?: string; provider?: string; modelContextWindow?: number };
    const drive = new Drive(this.gateway);
    drive.send({
      begin: {
        session: this.session(params),
        host: { ...HOST, capabilities: CAPTURE_CAPABILITIES },
        model: {
          id: str(context.modelId) ?? str(params["model"]) ?? "openclaw",
          provider: str(context.provider) ?? "",
          contextWindow: num(context.modelContextWindow) ?? DEFAULT_WINDOW,
        },
        userMessages: users.map((m) => fromOpenClaw(m, "")),
        busyPolicy: "BUSY_POLICY_ENQUEUE",
      },
    });
    try {
      await drive.until("admitted", wait);
      await drive.until("engineSelected", wait);
      return drive;
    } catch (e) {
      drive.cancel();
      throw e;
    }
  }

  /**
   * OpenClaw's history of a session the gateway holds nothing of (it ran
   * before the plugin did) goes there first, once, turn by turn
   * (history.ts). A session the gateway holds is not compared: its turns
   * came through the plugin. Throws when the gateway cannot be asked or
   * refuses a turn; turns already imported stay.
   */
  private async importIfNew(params: Params, sessionId: string, history: OcMessage[]): Promise<void> {
    const wait = this.config.timeouts.commitMs;
    const session = this.session(params);
    const info = await orNone(unary<SessionInfo__Output>(this.gateway, "GetSession", session, wait));
    if (info && info.entries > 0) return this.known.add(sessionId);
    const turns = turnsOf(history);
    if ("refused" in turns) {
      this.log.warn(`ctxgate: OpenClaw's earlier history of ${session.sessionKey} stays out of the gateway: ${turns.refused}`);
      return this.known.add(sessionId);
    }
    let done = 0;
    try {
      for (const turn of turns) {
        const drive = await this.capture(params, turn.users, wait);
        try {
          if (turn.rest.length > 0) {
            drive.send({ append: { messages: turn.rest.map((m) => fromOpenClaw(m, "")) as AgentMessage[] } });
            await drive.until("appended", wait);
          }
          drive.send({ end: { outcome: "TURN_OUTCOME_ACCEPTED" } });
          await drive.until("ended", wait);
          drive.finish();
        } catch (e) {
          drive.cancel();
          throw e;
        }
        done++;
      }
    } catch (e) {
      const left = done > 0 ? `; the gateway holds its first ${done} of ${turns.length} earlier turns and will not import the rest` : "";
      throw new Error(`importing OpenClaw's earlier history failed at turn ${done + 1}: ${(e as Error).message}${left}`);
    }
    this.known.add(sessionId);
    this.log.info(`ctxgate: imported ${turns.length} earlier turn(s) of ${session.sessionKey} (${history.length} messages) into the gateway`);
  }

  /** Whether the gateway holds the turn of `key` (stamped on its last message). */
  private async committed(params: Params, key: string): Promise<boolean> {
    let pageToken = "";
    for (let page = 0; page < MAX_LOOKBACK_PAGES; page++) {
      const request = { session: this.session(params), pageToken };
      const r = await orNone(unary<GetTranscriptResult__Output>(this.gateway, "GetTranscript", request, this.config.timeouts.commitMs));
      if (!r) return false; // NOT_FOUND: no such session yet
      if (r.entries.some((e) => e.message?.metadata?.[ADVANCEMENT_KEY] === key)) return true;
      if (!r.nextPageToken) return false;
      pageToken = r.nextPageToken;
    }
    return false;
  }

  async compact(params: Params): Promise<Record<string, unknown>> {
    const instructions = str(params["customInstructions"]);
    const open = this.mine.get(String(params["sessionId"] ?? ""));
    if (open) {
      await open.lane;
      return this.compactInTurn(open, instructions);
    }
    try {
      const done = await new Promise<CompactionEvent__Output["done"]>((resolve, reject) => {
        let last: CompactionEvent__Output["done"];
        const call = this.gateway.gateway.Compact(
          { session: this.session(params), ...(instructions ? { customInstructions: instructions } : {}) },
          this.gateway.metadata(),
          { deadline: Date.now() + this.config.timeouts.compactMs },
        );
        call.on("data", (e: CompactionEvent__Output) => {
          if (e.done) last = e.done;
        });
        call.on("error", reject);
        call.on("end", () => resolve(last));
      });
      return {
        ok: true,
        compacted: done?.compacted === true,
        ...(done?.reason ? { reason: done.reason } : {}),
        result: { tokensBefore: Number(done?.tokensBefore ?? 0), tokensAfter: Number(done?.tokensAfter ?? 0) },
      };
    } catch (e) {
      const reason = `ctxgate unreachable: ${(e as Error).message}`;
      return this.degrade("compact", e, () => ({ ok: false, compacted: false, reason }), "nothing was compacted");
    }
  }

  /**
   * Compaction while the turn is open (OpenClaw's overflow recovery): the
   * session is the turn's until it ends, so it goes through the turn, and
   * the turn's context is assembled again for the model's next call.
   */
  private async compactInTurn(open: OpenTurn, instructions: string | undefined): Promise<Record<string, unknown>> {
    const wait = this.config.timeouts.compactMs;
    try {
      open.drive.send({ compact: instructions ? { customInstructions: instructions } : {} });
      const done = await open.drive.until("compactionDone", wait);
      open.drive.send({ assemble: { pending: [] } });
      const context = await open.drive.until("context", wait);
      open.assembled = withoutTurn(context, open.ownIds, 0);
      return {
        ok: true,
        compacted: done.compacted,
        ...(done.reason ? { reason: done.reason } : {}),
        result: { tokensBefore: Number(done.tokensBefore), tokensAfter: Number(done.tokensAfter) },
      };
    } catch (e) {
      return this.degrade("compact", e, () => ({ ok: false, compacted: false, reason: `ctxgate: ${(e as Error).message}` }), "nothing was compacted");
    }
  }

  /**
   * OpenClaw is about to run a subagent: the gateway makes its child
   * session (`fork`: from the parent's visible history) and tells the
   * engine, so the child's turns start where the engine expects them. The
   * rollback (OpenClaw's spawn failed) ends the child again.
   */
  async prepareSubagentSpawn(params: Params): Promise<{ rollback(): Promise<void> } | undefined> {
    const parentKey = str(params["parentSessionKey"]);
    const childKey = str(params["childSessionKey"]);
    if (!parentKey || !childKey) return undefined; // nothing to name at the gateway
    const parent = this.session({ sessionKey: parentKey });
    const child = this.session({ sessionKey: childKey });
    const ttl = num(params["ttlMs"]);
    try {
      await unary<SpawnSubagentResult__Output>(this.gateway, "SpawnSubagent", {
        parent,
        childSessionKey: childKey,
        contextMode: params["contextMode"] === "fork" ? "fork" : "isolated",
        ...(ttl !== undefined ? { ttlMs: Math.ceil(ttl) } : {}),
      }, this.config.timeouts.commitMs);
    } catch (e) {
      return this.degrade("prepareSubagentSpawn", e, () => undefined, "the subagent runs without the gateway's preparation");
    }
    return { rollback: () => this.endSubagent(child, "deleted") };
  }

  async onSubagentEnded(params: Params): Promise<void> {
    const childKey = str(params["childSessionKey"]);
    if (childKey) await this.endSubagent(this.session({ sessionKey: childKey }), String(params["reason"] ?? "released"));
  }

  /** Ends a child at the gateway; OpenClaw does not wait on this, so a failure is a warning. */
  private async endSubagent(child: { agentId: string; sessionKey: string }, reason: string): Promise<void> {
    try {
      await unary<EndSubagentResult__Output>(this.gateway, "EndSubagent", { child, reason }, this.config.timeouts.commitMs);
    } catch (e) {
      this.log.warn(`ctxgate: the gateway at ${this.config.target} did not hear that subagent ${child.sessionKey} ended (${reason}): ${(e as Error).message}`);
    }
  }

  async maintain(): Promise<{ changed: boolean; bytesFreed: number; rewrittenEntries: number }> {
    // The gateway maintains after each turn it ends.
    return { changed: false, bytesFreed: 0, rewrittenEntries: 0 };
  }

  async dispose(): Promise<void> {
    // A turn OpenClaw never committed (it failed or was aborted) ends aborted at the gateway.
    for (const [sessionId, turn] of this.mine) {
      turn.drive.cancel();
      this.forget(sessionId, turn);
    }
  }

  /** `turn` is no longer open (committed, or dropped): a later run's turn of the session stays. */
  private forget(sessionId: string, turn: OpenTurn): void {
    if (this.turns.get(sessionId) === turn) this.turns.delete(sessionId);
    if (this.mine.get(sessionId) === turn) this.mine.delete(sessionId);
  }
}

/**
 * Runs an engine tool the model called, inside the session's open turn:
 * the call is appended as an assistant message of its own (the gateway
 * runs only calls it holds), the gateway runs it at the engine and holds
 * the result as the call's answer. Whatever goes wrong is a result the
 * model reads, never a thrown tool.
 */
export function runEngineTool(
  turns: OpenTurns,
  timeoutMs: number,
  sessionId: string,
  toolCallId: string,
  name: string,
  args: unknown,
): Promise<ToolAnswer> {
  const open = turns.get(sessionId);
  if (!open) {
    return Promise.resolve(toolError(`${name} is not available: this turn is not running at the ctxgate gateway (OpenClaw's own context answered it)`));
  }
  const run = open.lane.then(() => runInTurn(turns, sessionId, open, timeoutMs, toolCallId, name, args));
  open.lane = run;
  return run;
}

async function runInTurn(
  turns: OpenTurns,
  sessionId: string,
  open: OpenTurn,
  timeoutMs: number,
  toolCallId: string,
  name: string,
  args: unknown,
): Promise<ToolAnswer> {
  if (turns.get(sessionId) !== open) return toolError(`${name} is not available: the turn ended at the ctxgate gateway`);
  try {
    if (!open.calls.has(toolCallId)) {
      const call = { role: "assistant", content: [{ type: "toolCall", id: toolCallId, name, arguments: args ?? {} }] };
      open.drive.send({ append: { messages: [fromOpenClaw(call, "") as AgentMessage] } });
      const appended = await open.drive.until("appended", timeoutMs);
      open.calls.add(toolCallId);
      for (const id of appended.entryIds) open.ownIds.add(id);
    }
    open.drive.send({ callTool: { toolCallId } });
    const answered = await open.drive.until("toolResult", timeoutMs);
    open.results.add(toolCallId);
    open.ownIds.add(answered.entryId);
    const result = answered.message ? toOpenClaw(answered.message)[0] : undefined;
    const text = textOfContent(result?.content).join("");
    return { content: [{ type: "text", text }], details: { ctxgate: true, isError: result?.["isError"] === true } };
  } catch (e) {
    // What the gateway holds of the call is unknown now: the turn ends
    // aborted there, and commitTurn records it whole (as a retried commit).
    open.drive.cancel();
    if (turns.get(sessionId) === open) turns.delete(sessionId);
    return toolError(`${name} failed at the ctxgate gateway: ${(e as Error).message}`);
  }
}

/**
 * A turn's messages less what the gateway holds already: engine tool calls
 * (an assistant message left with nothing else goes) and their results.
 */
export function withoutHeld(messages: OcMessage[], open: Pick<OpenTurn, "calls" | "results"> | undefined): OcMessage[] {
  if (!open || open.calls.size === 0) return messages;
  return messages.flatMap((m) => {
    if (m.role === "toolResult") return open.results.has(String(m["toolCallId"] ?? "")) ? [] : [m];
    if (m.role !== "assistant" || !Array.isArray(m.content)) return [m];
    const content = (m.content as { type?: string; id?: string }[]).filter((b) => !(b.type === "toolCall" && open.calls.has(String(b.id))));
    if (content.length === m.content.length) return [m];
    return content.length > 0 ? [{ ...m, content }] : [];
  });
}
