// OpenClaw's ContextEngine served as a ctxgate engine: the contract was
// written from it, so its methods map to the RPCs one for one. The host
// converts messages both ways, keeps the plugin's session transcripts
// (transcript.ts), passes each method the parameters OpenClaw 2026.9.6
// passes it, in OpenClaw's shapes (shapes.ts), projected through the
// engine's `acceptedHostParams` as OpenClaw does, runs every plugin call
// inside its engine call (so runtime.llm and runtime.subagent use that
// call's grant), and fires the lifecycle hooks the plugin registered.
import { randomUUID } from "node:crypto";
import {
  type CallContext,
  type CompactOutcome,
  type ContextEngine as Engine,
  EngineError,
  type Progress,
  type pb,
  messagesTokens,
  textTokens,
  toolArguments,
  toolError,
} from "@ctxgate/engine-sdk";
import { type Registry, hooksOf } from "./api.js";
import { type OcMessage, fromOpenClaw, matchBack } from "./convert.js";
import { BoundedMap } from "./bounded.js";
import { History } from "./history.js";
import type {
  ContextEngine,
  ContextEngineMethod,
  ContextEngineRuntimeContext,
  OpenClawConfig,
  OpenClawPluginServiceContext,
  PluginHooks,
  SubagentEndReason,
  TranscriptRewriteRequest,
  TranscriptRewriteResult,
  TranscriptTurnAdmission,
} from "./openclaw-types.js";
import { llmCompleteFor, within } from "./runtime.js";
import {
  admission,
  admissionTarget,
  anchor,
  commitTurnRuntimeContext,
  projectHostParams,
  runtimeContextFields,
  runtimeSettings,
  sessionTarget,
  sessionTargetToProto,
} from "./shapes.js";
import type { Tools } from "./tools.js";
import type { OcEntry, Transcripts } from "./transcript.js";

type Proto = pb.AgentMessage__Output | pb.AgentMessage;
type ParamsOf<K extends ContextEngineMethod> = Parameters<NonNullable<ContextEngine[K]>>[0];
type ResultOf<K extends ContextEngineMethod> = Awaited<ReturnType<NonNullable<ContextEngine[K]>>>;

const DELEGATED = Symbol.for("ctxgate.openclaw-host.delegateCompactionToRuntime");

/** OpenClaw's host-param names → the contract's. */
const HOST_PARAMS: Record<string, string> = {
  sessionKey: "session_key",
  prompt: "prompt",
  runtimeSettings: "runtime_settings",
  sessionTarget: "session_target",
  runtimeContext: "runtime_context",
};

const CAPABILITY_ENUMS = {
  currentTurnFence: { "before-current-turn-entry-v1": "CURRENT_TURN_FENCE_BEFORE_CURRENT_TURN_ENTRY_V1" },
  turnAdvancementIdempotency: { "atomic-idempotent-v1": "TURN_ADVANCEMENT_IDEMPOTENCY_ATOMIC_IDEMPOTENT_V1" },
} as const;

const MAINTAIN_REASONS: Record<string, string> = {
  MAINTAIN_REASON_BOOTSTRAP: "bootstrap",
  MAINTAIN_REASON_TURN: "turn",
  MAINTAIN_REASON_COMPACTION: "compaction",
};

const SUBAGENT_END_REASONS: Record<string, SubagentEndReason> = {
  SUBAGENT_END_REASON_DELETED: "deleted",
  SUBAGENT_END_REASON_COMPLETED: "completed",
  SUBAGENT_END_REASON_SWEPT: "swept",
  SUBAGENT_END_REASON_RELEASED: "released",
};

/** Subagent rollbacks kept at most (older ones are dropped: best effort). */
const MAX_ROLLBACKS = 1024;

/** Sessions whose last assembled context is remembered for afterTurn, at
 * most (the oldest is forgotten first; afterTurn then sees the transcript). */
const MAX_ASSEMBLED = 4096;

/**
 * Where the turn being answered starts in an Assemble's messages: its user
 * message, when neither it nor anything after it is in the host's
 * transcript yet (the plugin has not been told of the turn). OpenClaw
 * hands an engine the history before the turn and appends the turn to
 * what the engine assembled; `messages.length` when there is no such turn
 * (a preview of a finished one).
 */
export function pendingTurnStart(messages: readonly Proto[], holds: (id: string) => boolean): number {
  let start = messages.length - 1;
  while (start >= 0 && messages[start].role !== "ROLE_USER") start--;
  if (start < 0 || messages.slice(start).some((m) => m.id && holds(m.id))) return messages.length;
  return start;
}

/** The object without its undefined values (OpenClaw's params carry set keys). */
function defined<T extends object>(o: T): T {
  return Object.fromEntries(Object.entries(o).filter(([, v]) => v !== undefined)) as T;
}

function optionalNumber(v: number | string | null | undefined): number | undefined {
  return v === undefined || v === null ? undefined : Number(v);
}

/** An entry id of the host's transcript → the contract message's id. */
function baseId(entryId: string): string {
  const hash = entryId.lastIndexOf("#");
  return hash > 0 && /^\d+$/.test(entryId.slice(hash + 1)) ? entryId.slice(0, hash) : entryId;
}

export interface EngineOptions {
  plugin: ContextEngine;
  registry: Registry;
  tools: Tools;
  transcripts: Transcripts;
  /** OpenClaw's root config (runtimeContext.config). */
  rootConfig: OpenClawConfig;
  /** What registered services' start/stop get. */
  serviceContext: OpenClawPluginServiceContext;
  warn: (line: string) => void;
}

export class OpenClawEngine implements Engine {
  private readonly rollbacks = new BoundedMap<string, () => void | Promise<void>>(MAX_ROLLBACKS);
  /** Per session, what the plugin last assembled (OpenClaw's agent
   * messages before the prompt): afterTurn's snapshot starts with it. */
  private readonly assembled = new BoundedMap<string, OcMessage[]>(MAX_ASSEMBLED);
  private readonly plugin: ContextEngine;
  private readonly registry: Registry;
  private readonly toolbox: Tools;
  private readonly transcripts: Transcripts;
  private readonly started: OpenClawPluginServiceContext[] = [];
  /** The gateway's history of each session, for DELTA requests (history.ts). */
  private readonly history = new History();
  /** Each held message in OpenClaw's form, converted once (a DELTA
   * Assemble hands the plugin the whole history every call). The plugin is
   * given the same objects each call, as OpenClaw gives it its session's
   * messages: one that edits them in place edits later turns' input too. */
  private readonly converted = new WeakMap<Proto, OcMessage[]>();

  constructor(private readonly o: EngineOptions) {
    this.plugin = o.plugin;
    this.registry = o.registry;
    this.toolbox = o.tools;
    this.transcripts = o.transcripts;
    // An optional method the plugin lacks is one this engine lacks: the SDK
    // answers UNIMPLEMENTED for it.
    const optional: [keyof ContextEngine, string][] = [
      ["bootstrap", "bootstrap"],
      ["afterTurn", "afterTurn"],
      ["commitTurn", "commitTurn"],
      ["maintain", "maintain"],
      ["prepareSubagentSpawn", "prepareSubagentSpawn"],
      ["prepareSubagentSpawn", "rollbackSubagentSpawn"],
      ["onSubagentEnded", "onSubagentEnded"],
    ];
    for (const [needs, method] of optional) {
      if (!this.has(needs)) Object.defineProperty(this, method, { value: undefined });
    }
    if (this.toolbox.definitions.length === 0) Object.defineProperty(this, "callTool", { value: undefined });
  }

  private has(method: keyof ContextEngine): boolean {
    return typeof this.plugin[method] === "function";
  }

  /** One plugin method call, as OpenClaw's registry makes it: the params
   * projected through the engine's current `info.acceptedHostParams`,
   * inside the engine call `ctx`. */
  private invoke<K extends ContextEngineMethod>(
    ctx: CallContext,
    method: K,
    params: ParamsOf<K>,
  ): Promise<ResultOf<K>> {
    const fn = this.plugin[method] as unknown as (p: ParamsOf<K>) => Promise<ResultOf<K>>;
    const projected = projectHostParams(this.plugin.info, method, defined(params));
    return within(ctx, () => fn.call(this.plugin, projected));
  }

  async getInfo(): Promise<pb.EngineInfo> {
    const info = this.plugin.info;
    const methods = ["GetInfo", "Ingest", "Assemble", "Compact", "IngestBatch", "ForgetSession"];
    if (this.has("bootstrap")) methods.push("Bootstrap");
    if (this.has("afterTurn")) methods.push("AfterTurn");
    if (this.has("commitTurn")) methods.push("CommitTurn");
    if (this.has("maintain")) methods.push("Maintain");
    if (this.has("prepareSubagentSpawn")) methods.push("PrepareSubagentSpawn", "RollbackSubagentSpawn");
    if (this.has("onSubagentEnded")) methods.push("OnSubagentEnded");
    if (this.toolbox.definitions.length > 0) methods.push("CallTool");
    const out: pb.EngineInfo = {
      id: String(info.id),
      name: String(info.name),
      version: String(info.version ?? ""),
      contractVersion: "1.0",
      ownsCompaction: info.ownsCompaction === true,
      turnMaintenanceMode:
        info.turnMaintenanceMode === "background"
          ? "TURN_MAINTENANCE_MODE_BACKGROUND"
          : "TURN_MAINTENANCE_MODE_FOREGROUND",
      implementedMethods: methods,
      // The gateway sends what follows a cursor; the host rebuilds the
      // whole history the plugin is given from its own copy (history.ts).
      historyDelivery: "HISTORY_DELIVERY_DELTA",
      // The plugin keeps session state in its own store.
      replicaAffinity: "REPLICA_AFFINITY_SESSION",
      tools: this.toolbox.definitions,
    };
    if (Array.isArray(info.acceptedHostParams)) {
      // The host itself needs `host` (runtime.llm, runtime.subagent, transcript
      // reads) and the session key (tool factories, hooks); it projects what
      // the plugin gets as OpenClaw does.
      const names = new Set<string>(["host", "session_key"]);
      for (const a of info.acceptedHostParams) if (HOST_PARAMS[String(a)]) names.add(HOST_PARAMS[String(a)]!);
      out.acceptedHostParams = { params: [...names] };
    }
    const sem = info.transcriptSemantics;
    if (sem) {
      const fence = sem.currentTurnFence ? CAPABILITY_ENUMS.currentTurnFence[sem.currentTurnFence] : undefined;
      const idem = sem.turnAdvancementIdempotency
        ? CAPABILITY_ENUMS.turnAdvancementIdempotency[sem.turnAdvancementIdempotency]
        : undefined;
      out.transcriptSemantics = {
        ...(fence ? { currentTurnFence: fence } : {}),
        ...(idem && this.has("commitTurn") ? { turnAdvancementIdempotency: idem } : {}),
      };
    }
    if (info.hostRequirements) {
      out.hostRequirements = Object.entries(info.hostRequirements).map(([operation, r]) => ({
        operation,
        requiredCapabilities: r?.requiredCapabilities ?? [],
        ...(r?.unsupportedMessage ? { unsupportedMessage: r.unsupportedMessage } : {}),
      }));
    }
    return out;
  }

  /** The runtime context a plugin method gets: the contract's in OpenClaw's
   * shapes, OpenClaw's root config, and `llm` when the call may use the
   * model (its audit caller `{kind: "context-engine", id: purpose}`). */
  private runtimeContext(
    rc: pb.RuntimeContext__Output | null | undefined,
    ctx: CallContext,
    purpose: string,
  ): ContextEngineRuntimeContext {
    const out: ContextEngineRuntimeContext = { config: this.o.rootConfig, ...runtimeContextFields(rc) };
    if (ctx.host) out.llm = { complete: llmCompleteFor(() => ({ kind: "context-engine", id: purpose })) };
    return out;
  }

  /** Runs the plugin's handlers of hook `name` in order; their answers
   * (a handler is the plugin's: whatever it answers is checked by use). */
  private async hooks<K extends keyof PluginHooks>(
    name: K,
    event: PluginHooks[K][0],
    ctx: PluginHooks[K][1],
  ): Promise<(Partial<PluginHooks[K][2]> | undefined)[]> {
    const out: (Partial<PluginHooks[K][2]> | undefined)[] = [];
    for (const h of hooksOf(this.registry, name)) {
      const answer = await h({ ...event }, { ...ctx });
      out.push(answer && typeof answer === "object" ? (answer as Partial<PluginHooks[K][2]>) : undefined);
    }
    return out;
  }

  /** The session as hooks and tool factories see it. */
  private session(sessionId: string, sessionKey: string | undefined) {
    return { sessionId, sessionKey: sessionKey || sessionId };
  }

  /** The contract messages in OpenClaw's form, timed as the transcript
   * has them (a message it holds is converted once: its time is settled). */
  private openclaw(sessionId: string, messages: readonly Proto[]): OcMessage[] {
    return messages.flatMap((m) => {
      let oc = this.converted.get(m);
      if (!oc) {
        oc = this.transcripts.openclaw(sessionId, m);
        if (m.id && this.transcripts.holds(sessionId, m.id)) this.converted.set(m, oc);
      }
      return oc;
    });
  }

  /**
   * The whole history a request stands for: its messages, or for a DELTA
   * request (a cursor) what the host holds up to the cursor followed by
   * them. A gap when the host does not hold what the cursor says: the
   * session is forgotten here and the gateway resends it whole.
   */
  private whole(sessionId: string, cursor: pb.HistoryCursor__Output | null | undefined, messages: Proto[]): Proto[] {
    if (!cursor) return messages;
    const held = this.history.through(sessionId, cursor);
    if (held === undefined) {
      this.history.forget(sessionId);
      throw EngineError.historyGap();
    }
    return held.concat(messages);
  }

  /**
   * The admission as OpenClaw counts: its position and parent in OpenClaw
   * messages, which outnumber the contract's where an earlier tool message
   * answered several calls. The contract's values when the host's
   * transcript does not place the admitted entry, or places it after
   * another parent than the gateway's (its copy differs: keep the gateway's).
   */
  private inOpenClawUnits(sessionId: string, a: TranscriptTurnAdmission): TranscriptTurnAdmission {
    const place = this.transcripts.openClawPlace(sessionId, a.entryId);
    const parent = place?.parentEntryId ?? null;
    if (!place || (parent === null ? a.effectiveParentId !== null : baseId(parent) !== a.effectiveParentId)) return a;
    return Object.freeze({
      ...a,
      activeMessagePosition: a.activeMessagePosition + place.extra,
      effectiveParentId: place.parentEntryId,
    });
  }

  private remember(sessionId: string, assembled: OcMessage[]): void {
    this.assembled.set(sessionId, assembled);
  }

  /**
   * afterTurn's conversation as OpenClaw gives it: the agent's messages,
   * which are what the plugin assembled for the turn followed by the
   * turn's own — not the whole transcript (a plugin measures the live
   * context by it). The whole visible snapshot when nothing was assembled
   * here (legacy answered, or the host restarted).
   */
  private snapshot(
    sessionId: string,
    all: Proto[],
    pre: number,
  ): { messages: OcMessage[]; prePromptMessageCount: number } {
    const turn = this.openclaw(sessionId, all.slice(pre));
    const assembled = this.assembled.get(sessionId);
    this.assembled.delete(sessionId);
    const before = assembled ?? this.openclaw(sessionId, all.slice(0, pre));
    return { messages: [...before, ...turn], prePromptMessageCount: before.length };
  }

  async bootstrap(req: pb.BootstrapRequest__Output, ctx: CallContext): Promise<pb.BootstrapResult> {
    // Mirror the gateway's transcript first, when the grant allows reading it.
    if (ctx.host?.allows("read_transcript")) {
      const entries = await ctx.host.readTranscript(ctx, true);
      const messages = entries.map((e) => e.message).filter((m): m is pb.AgentMessage__Output => !!m);
      this.transcripts.append(req.sessionId, messages);
      // What the gateway may adopt as held (a cursor over the visible
      // history); if it differs, the first DELTA call finds the gap.
      this.history.forget(req.sessionId);
      this.history.acknowledge(req.sessionId, messages);
    }
    const r = await this.invoke(ctx, "bootstrap", {
      sessionId: req.sessionId,
      sessionKey: req.sessionKey,
      sessionTarget: sessionTarget(req.sessionTarget),
      // A real JSONL file: plugins of OpenClaw's file-backed era read it.
      sessionFile: this.transcripts.ensure(req.sessionId),
      runtimeSettings: runtimeSettings(req.runtimeSettings),
      runtimeContext: this.runtimeContext(req.runtimeContext, ctx, "context-engine.bootstrap"),
    });
    return {
      bootstrapped: r?.bootstrapped === true,
      ...(typeof r?.importedMessages === "number" ? { importedMessages: r.importedMessages } : {}),
      ...(r?.reason ? { reason: r.reason } : {}),
    };
  }

  async ingest(req: pb.IngestRequest__Output, ctx: CallContext): Promise<pb.IngestResult> {
    // Idempotent by message id, whatever the plugin does with repeats.
    if (this.transcripts.append(req.sessionId, [req.message!]).length === 0) {
      this.history.acknowledge(req.sessionId, [req.message!]);
      return { ingested: false };
    }
    let ingested = false;
    for (const message of this.openclaw(req.sessionId, [req.message!])) {
      const r = await this.invoke(ctx, "ingest", {
        sessionId: req.sessionId,
        sessionKey: req.sessionKey,
        message,
        isHeartbeat: req.isHeartbeat,
      });
      ingested ||= r?.ingested !== false;
    }
    this.history.acknowledge(req.sessionId, [req.message!]);
    return { ingested };
  }

  async ingestBatch(req: pb.IngestBatchRequest__Output, ctx: CallContext): Promise<pb.IngestBatchResult> {
    const ingestedCount = await this.tellPlugin(req, ctx);
    // Held once the plugin took them (a resync resends what it holds).
    this.history.acknowledge(req.sessionId, req.messages);
    return { ingestedCount };
  }

  /** The batch's messages the transcript did not hold, told the plugin. */
  private async tellPlugin(req: pb.IngestBatchRequest__Output, ctx: CallContext): Promise<number> {
    const fresh = this.transcripts.append(req.sessionId, req.messages);
    if (fresh.length === 0) return 0;
    const messages = this.openclaw(req.sessionId, fresh);
    const base = { sessionId: req.sessionId, sessionKey: req.sessionKey, isHeartbeat: req.isHeartbeat };
    if (this.has("ingestBatch")) {
      const r = await this.invoke(ctx, "ingestBatch", { ...base, messages });
      return Number(r?.ingestedCount ?? fresh.length);
    }
    let n = 0;
    for (const message of messages) {
      const r = await this.invoke(ctx, "ingest", { ...base, message });
      if (r?.ingested !== false) n++;
    }
    return n;
  }

  async assemble(req: pb.AssembleRequest__Output, ctx: CallContext): Promise<pb.AssembleResult> {
    const session = this.session(req.sessionId, req.sessionKey);
    const all = this.whole(req.sessionId, req.cursor, req.messages);
    // As in OpenClaw, the plugin assembles the history before the turn,
    // within what the turn leaves of the budget, and the turn follows what
    // it returns: no plugin can drop the request it is answering.
    const from = pendingTurnStart(all, (id) => this.transcripts.holds(req.sessionId, id));
    const pending = all.slice(from);
    const messages = this.openclaw(req.sessionId, all.slice(0, from));
    // before_prompt_build → the system prompt addition. The gateway counts
    // the addition within the budget (OpenClaw keeps its system prompt
    // apart), so the plugin assembles within what the addition leaves.
    const built = await within(ctx, () =>
      this.hooks("before_prompt_build", { prompt: req.prompt ?? "", messages }, session),
    );
    const text = (t: unknown): t is string => typeof t === "string" && t !== "";
    const before = built.map((b) => b?.prependSystemContext).filter(text);
    const after = built.map((b) => b?.appendSystemContext).filter(text);
    const reserved = textTokens([...before, ...after].join("\n\n")) + messagesTokens(pending);
    const budget =
      req.tokenBudget === undefined || req.tokenBudget === null
        ? undefined
        : Math.max(1, Number(req.tokenBudget) - reserved);
    const r = await this.invoke(ctx, "assemble", {
      sessionId: req.sessionId,
      sessionKey: req.sessionKey,
      messages,
      tokenBudget: budget,
      availableTools: new Set(req.availableTools),
      citationsMode: req.citationsMode || undefined,
      model: req.model || undefined,
      runtimeSettings: runtimeSettings(req.runtimeSettings),
      runtimeContext: this.runtimeContext(req.runtimeContext, ctx, "context-engine.assemble"),
      prompt: req.prompt || undefined,
    });
    const assembled = Array.isArray(r?.messages) ? r.messages : [];
    this.remember(req.sessionId, assembled);
    // What the plugin may give back: the history the request stands for —
    // for a FULL request the session's transcript (whose fingerprints are
    // computed once) and what the request adds to it; a DELTA request's is
    // held already.
    const known = req.cursor
      ? all
      : [
          ...this.transcripts.messages(req.sessionId),
          ...req.messages.filter((m) => !this.transcripts.holds(req.sessionId, m.id)),
        ];
    const turn = new Set(pending.map((m) => m.id));
    const out = [...matchBack(assembled, known).filter((m) => !turn.has(m.id ?? "")), ...pending];
    const additions = [...before, ...(r?.systemPromptAddition ? [r.systemPromptAddition] : []), ...after];
    const estimate = r?.estimatedTokens;
    const result: pb.AssembleResult = {
      messages: out,
      estimatedTokens:
        typeof estimate === "number" && Number.isFinite(estimate)
          ? Math.max(0, Math.round(estimate)) + messagesTokens(pending)
          : messagesTokens(out),
      promptAuthority:
        r?.promptAuthority === "preassembly_may_overflow"
          ? "PROMPT_AUTHORITY_PREASSEMBLY_MAY_OVERFLOW"
          : "PROMPT_AUTHORITY_ASSEMBLED",
    };
    if (additions.length > 0) result.systemPromptAddition = additions.join("\n\n");
    const proj = r?.contextProjection;
    if (proj?.mode === "thread_bootstrap" && proj.epoch) {
      result.projection = {
        mode: "PROJECTION_MODE_THREAD_BOOTSTRAP",
        epoch: proj.epoch,
        ...(proj.fingerprint ? { fingerprint: proj.fingerprint } : {}),
      };
    }
    return result;
  }

  async compact(req: pb.CompactRequest__Output, ctx: CallContext, progress: Progress): Promise<CompactOutcome> {
    await progress.report("compacting", 0, 0, "the plugin is compacting");
    // OpenClaw 2026.9 passes no sessionFile to compact.
    const r = await this.invoke(ctx, "compact", {
      sessionId: req.sessionId,
      sessionKey: req.sessionKey,
      agentId: req.agentId || undefined,
      sessionTarget: sessionTarget(req.sessionTarget),
      tokenBudget: optionalNumber(req.tokenBudget),
      currentTokenCount: optionalNumber(req.currentTokenCount),
      compactionTarget: req.compactionTarget === "COMPACTION_TARGET_THRESHOLD" ? "threshold" : "budget",
      customInstructions: req.customInstructions || undefined,
      force: req.force,
      runtimeContext: this.runtimeContext(req.runtimeContext, ctx, "context-engine.compaction"),
      runtimeSettings: runtimeSettings(req.runtimeSettings),
      abortSignal: ctx.signal,
    });
    const delegated = (r as unknown as Record<symbol, { customInstructions?: string } | undefined>)?.[DELEGATED];
    if (delegated) {
      return {
        delegateToHost: {
          reason: "the plugin delegated compaction to the host",
          ...(delegated.customInstructions ? { customInstructions: delegated.customInstructions } : {}),
        },
      };
    }
    const result = r?.result;
    const ok = r?.ok === true;
    const compacted = ok && r?.compacted === true;
    const num = (v: unknown) => (typeof v === "number" && Number.isFinite(v) ? Math.max(0, Math.round(v)) : undefined);
    const out: pb.CompactResult = { ok, compacted, tokensBefore: num(result?.tokensBefore) ?? 0 };
    const reason = r?.reason ?? (r as unknown as { error?: unknown })?.error;
    if (typeof reason === "string" && reason) out.reason = reason;
    if (typeof result?.summary === "string") out.summary = result.summary;
    if (typeof result?.firstKeptEntryId === "string") out.firstKeptEntryId = baseId(result.firstKeptEntryId);
    const after = num(result?.tokensAfter);
    if (after !== undefined) out.tokensAfter = after;
    if (result?.details !== undefined) out.detailsJson = JSON.stringify(result.details);
    // A compaction successor: where the session continues.
    if (typeof result?.sessionId === "string" && result.sessionId.trim()) out.sessionId = result.sessionId;
    if (result?.sessionTarget && typeof result.sessionTarget === "object") {
      out.sessionTarget = sessionTargetToProto(result.sessionTarget);
    }
    return { result: out };
  }

  async afterTurn(req: pb.AfterTurnRequest__Output, ctx: CallContext): Promise<pb.AfterTurnResult> {
    const all = this.whole(req.sessionId, req.cursor, req.messages);
    const pre = all.length - req.messages.length + Number(req.prePromptMessageCount);
    // The turn is in the transcript before the plugin hears of it (as in
    // OpenClaw, where the session file has the turn by then).
    this.transcripts.append(req.sessionId, req.messages);
    const { messages, prePromptMessageCount } = this.snapshot(req.sessionId, all, pre);
    await this.invoke(ctx, "afterTurn", {
      sessionId: req.sessionId,
      sessionKey: req.sessionKey,
      sessionTarget: sessionTarget(req.sessionTarget),
      sessionFile: this.transcripts.ensure(req.sessionId),
      messages,
      prePromptMessageCount,
      autoCompactionSummary: req.autoCompactionSummary || undefined,
      isHeartbeat: req.isHeartbeat,
      tokenBudget: optionalNumber(req.tokenBudget),
      runtimeSettings: runtimeSettings(req.runtimeSettings),
      runtimeContext: this.runtimeContext(req.runtimeContext, ctx, "context-engine.afterTurn"),
    });
    // The gateway moves the cursor over the request's messages now; a
    // FULL request's are the whole visible history.
    if (req.cursor) this.history.advance(req.sessionId, req.cursor, req.messages);
    else {
      this.history.forget(req.sessionId);
      this.history.acknowledge(req.sessionId, req.messages);
    }
    return {};
  }

  /**
   * commitTurn as OpenClaw's turn outbox calls it: flat anchors, the
   * session's identity from the admission, its target, and the persisted
   * runtime context (no functions, no runtime settings). Positions count
   * OpenClaw messages: a contract tool message answering N calls is N of
   * them, so the terminal's position is the admission's plus the range's
   * OpenClaw messages, less one.
   */
  async commitTurn(req: pb.CommitTurnRequest__Output, ctx: CallContext): Promise<pb.CommitTurnResult> {
    this.transcripts.append(req.sessionId, req.messages);
    const messages = this.openclaw(req.sessionId, req.messages);
    const admitted = this.inOpenClawUnits(req.sessionId, admission(req.admission));
    const terminal = Object.freeze({
      ...anchor(req.terminal),
      activeMessagePosition: admitted.activeMessagePosition + Math.max(0, messages.length - 1),
    });
    const r = await this.invoke(ctx, "commitTurn", {
      advancementKey: req.advancementKey,
      admission: admitted,
      terminal,
      messages,
      sessionId: admitted.sessionId,
      sessionKey: admitted.sessionKey,
      sessionTarget: admissionTarget(admitted),
      isHeartbeat: req.isHeartbeat,
      runtimeContext: commitTurnRuntimeContext(req.runtimeContext),
    });
    if (r?.status === "committed" || r?.status === "duplicate") {
      // The gateway's cursor moves over the committed turn.
      this.history.acknowledge(req.sessionId, req.messages);
      return { status: r.status === "committed" ? "COMMIT_STATUS_COMMITTED" : "COMMIT_STATUS_DUPLICATE" };
    }
    throw EngineError.failedPrecondition(`the plugin's commitTurn answered status ${JSON.stringify(r?.status)}`);
  }

  async maintain(req: pb.MaintainRequest__Output, ctx: CallContext): Promise<pb.MaintainResult> {
    const replacements: pb.TranscriptReplacement[] = [];
    const allowed = new Set<string>();
    const rewriteTranscriptEntries = async (request: TranscriptRewriteRequest): Promise<TranscriptRewriteResult> =>
      this.rewrite(req.sessionId, request, replacements, allowed);
    const reason = MAINTAIN_REASONS[String(req.reason)] ?? "turn";
    const target = sessionTarget(req.sessionTarget);
    const r = await this.invoke(ctx, "maintain", {
      sessionId: req.sessionId,
      sessionKey: req.sessionKey,
      sessionTarget: target,
      sessionFile: this.transcripts.ensure(req.sessionId),
      runtimeSettings: runtimeSettings(req.runtimeSettings),
      runtimeContext: {
        ...this.runtimeContext(req.runtimeContext, ctx, `context-engine.${reason}.maintenance`),
        ...(target ? { sessionTarget: target } : {}),
        rewriteTranscriptEntries,
      },
      abortSignal: ctx.signal,
    });
    // The gateway applies the rewrite under the same message ids and keeps
    // the cursor: the held copy would keep the old content. Forgotten, the
    // next DELTA call finds a gap and the gateway resends the history.
    if (replacements.length > 0) this.history.forget(req.sessionId);
    return {
      replacements,
      ...(allowed.size > 0 ? { allowedRewriteSuffixEntryIds: [...allowed] } : {}),
      changed: r?.changed === true,
      ...(r?.reason ? { reason: r.reason } : {}),
    };
  }

  /**
   * runtimeContext.rewriteTranscriptEntries, as OpenClaw's transcript
   * rewrite counts it (blank ids dropped, a replacement equal to the
   * entry's message skipped, bytesFreed the bytes the changed entries
   * shrink by): the changes become MaintainResult.replacements, which the
   * gateway validates and applies as a new branch.
   */
  private async rewrite(
    sessionId: string,
    request: TranscriptRewriteRequest,
    replacements: pb.TranscriptReplacement[],
    allowed: Set<string>,
  ): Promise<TranscriptRewriteResult> {
    const wanted = new Map<string, OcMessage>();
    for (const rep of request?.replacements ?? []) {
      if (typeof rep?.entryId === "string" && rep.entryId.trim() && rep.message) wanted.set(rep.entryId, rep.message);
    }
    if (wanted.size === 0)
      return { changed: false, bytesFreed: 0, rewrittenEntries: 0, reason: "no replacements requested" };
    const entries = this.transcripts.entries(sessionId);
    if (entries.length === 0) return { changed: false, bytesFreed: 0, rewrittenEntries: 0, reason: "empty session" };
    let bytesFreed = 0;
    let rewritten = 0;
    // Per contract message: its OpenClaw messages with the replacements in.
    const changed = new Map<string, { proto: OcEntry["proto"]; parts: OcEntry[]; messages: OcMessage[] }>();
    for (const e of entries) {
      const replacement = wanted.get(e.entryId);
      if (!replacement) continue;
      const before = JSON.stringify(e.message);
      const after = JSON.stringify(replacement);
      if (before === after) continue;
      rewritten++;
      bytesFreed += Math.max(0, Buffer.byteLength(before) - Buffer.byteLength(after));
      const id = e.proto.id!;
      let group = changed.get(id);
      if (!group) {
        const parts = entries.filter((x) => x.proto.id === id);
        group = { proto: e.proto, parts, messages: parts.map((x) => x.message) };
        changed.set(id, group);
      }
      group.messages[group.parts.indexOf(e)] = replacement;
    }
    if (rewritten === 0) {
      return { changed: false, bytesFreed: 0, rewrittenEntries: 0, reason: "no changed matching message entries" };
    }
    for (const [id, group] of changed) {
      const made = group.messages.map((m) => fromOpenClaw(m, id));
      const message: pb.AgentMessage = {
        ...made[0]!,
        content: made.flatMap((m) => m.content ?? []),
        createdAtUnixMs: Number(group.proto.createdAtUnixMs ?? 0),
        metadata: { ...(group.proto.metadata ?? {}) },
      };
      const at = replacements.findIndex((r) => r.entryId === id);
      if (at >= 0) replacements[at] = { entryId: id, message };
      else replacements.push({ entryId: id, message });
    }
    for (const s of request.allowedRewriteSuffixEntryIds ?? [])
      if (typeof s === "string" && s.trim()) allowed.add(baseId(s));
    return { changed: true, bytesFreed, rewrittenEntries: rewritten };
  }

  async prepareSubagentSpawn(
    req: pb.PrepareSubagentSpawnRequest__Output,
    ctx: CallContext,
  ): Promise<pb.PrepareSubagentSpawnResult> {
    const r = await this.invoke(ctx, "prepareSubagentSpawn", {
      parentSessionKey: req.parentSessionKey,
      childSessionKey: req.childSessionKey,
      contextMode: req.contextMode === "SUBAGENT_CONTEXT_MODE_FORK" ? "fork" : "isolated",
      ...(req.parentSessionId
        ? { parentSessionId: req.parentSessionId, parentSessionFile: this.transcripts.pathOf(req.parentSessionId) }
        : {}),
      ...(req.childSessionId
        ? { childSessionId: req.childSessionId, childSessionFile: this.transcripts.pathOf(req.childSessionId) }
        : {}),
      ttlMs: optionalNumber(req.ttlMs),
    });
    if (!r || typeof r.rollback !== "function") return { prepared: !!r };
    const token = randomUUID();
    this.rollbacks.set(token, r.rollback);
    return { prepared: true, rollbackToken: token };
  }

  async rollbackSubagentSpawn(
    req: pb.RollbackSubagentSpawnRequest__Output,
    ctx: CallContext,
  ): Promise<pb.RollbackSubagentSpawnResult> {
    const rollback = this.rollbacks.get(req.rollbackToken);
    this.rollbacks.delete(req.rollbackToken);
    if (rollback) await within(ctx, () => rollback());
    return {};
  }

  async onSubagentEnded(req: pb.OnSubagentEndedRequest__Output, ctx: CallContext): Promise<pb.OnSubagentEndedResult> {
    await this.invoke(ctx, "onSubagentEnded", {
      childSessionKey: req.childSessionKey,
      reason: SUBAGENT_END_REASONS[String(req.reason)] ?? "completed",
      agentDir: req.agentDir || undefined,
      workspaceDir: req.workspaceDir || undefined,
    });
    return {};
  }

  /** ForgetSession: OpenClaw's session_end hook with reason "deleted",
   * and the host's transcript of the session dropped. */
  async forgetSession(req: pb.ForgetSessionRequest__Output, ctx: CallContext): Promise<pb.ForgetSessionResult> {
    const session = this.session(req.sessionId, req.sessionKey);
    const hookCtx = { ...session, ...(req.agentId ? { agentId: req.agentId } : {}) };
    const messageCount = this.transcripts.entries(req.sessionId).length;
    const sessionFile = this.transcripts.pathOf(req.sessionId);
    await within(ctx, () =>
      this.hooks("session_end", { ...session, messageCount, reason: "deleted", sessionFile }, hookCtx),
    );
    this.transcripts.forget(req.sessionId);
    this.history.forget(req.sessionId);
    return {};
  }

  async callTool(req: pb.CallToolRequest__Output, ctx: CallContext): Promise<pb.CallToolResult> {
    const args = toolArguments(req);
    if (!args) return toolError("the arguments are not a JSON object");
    const session = {
      ...this.session(req.sessionId, req.sessionKey),
      ...(req.agentId ? { agentId: req.agentId } : {}),
    };
    return within(ctx, () => this.toolbox.run(req.name, req.toolCallId, args, session, ctx));
  }

  /** gateway_start (after register and the engine's creation), then the
   * plugin's services, in registration order. */
  async start(): Promise<void> {
    await this.hooks("gateway_start", {}, {});
    for (const service of this.registry.services) {
      await service.start(this.o.serviceContext);
      this.started.push(this.o.serviceContext);
    }
  }

  /** Drain: gateway_stop, the services stopped (last started first), then
   * the engine's dispose. */
  async stop(): Promise<void> {
    try {
      await this.hooks("gateway_stop", { reason: "shutdown" }, {});
    } finally {
      for (const service of this.registry.services.slice(0, this.started.length).reverse()) {
        try {
          await service.stop?.(this.o.serviceContext);
        } catch (e) {
          this.o.warn(`service ${service.id} failed to stop: ${e instanceof Error ? e.message : String(e)}`);
        }
      }
      this.started.length = 0;
      await this.plugin.dispose?.();
    }
  }
}
