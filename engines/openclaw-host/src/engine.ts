// OpenClaw's ContextEngine served as a ctxgate engine: the contract was
// written from it, so its methods map to the RPCs one for one. The host
// converts messages both ways, keeps the plugin's session transcripts
// (transcript.ts), runs every plugin call inside its engine call (so
// runtime.llm and runtime.subagent use that call's grant), and fires the
// lifecycle hooks the plugin registered.
import { randomUUID } from "node:crypto";
import {
  type CallContext,
  type CompactOutcome,
  type ContextEngine,
  EngineError,
  type Progress,
  type pb,
  messagesTokens,
  textTokens,
  toolArguments,
  toolError,
} from "@ctxgate/engine-sdk";
import type { Hook, Registry } from "./api.js";
import { type OcMessage, matchBack, toOpenClaw } from "./convert.js";
import { llmComplete, within } from "./runtime.js";
import type { Tools } from "./tools.js";
import type { Transcripts } from "./transcript.js";

/** OpenClaw's ContextEngine as a plugin implements it. */
export interface ContextEngineLike {
  info: Record<string, unknown> & { id?: string; name?: string; version?: string };
  ingest(p: Record<string, unknown>): Promise<{ ingested?: boolean }>;
  assemble(p: Record<string, unknown>): Promise<{ messages: OcMessage[]; estimatedTokens?: number; promptAuthority?: string; systemPromptAddition?: string; contextProjection?: { mode?: string; epoch?: string; fingerprint?: string } }>;
  compact(p: Record<string, unknown>): Promise<Record<string, unknown>>;
  bootstrap?(p: Record<string, unknown>): Promise<{ bootstrapped?: boolean; importedMessages?: number; reason?: string }>;
  ingestBatch?(p: Record<string, unknown>): Promise<{ ingestedCount?: number }>;
  afterTurn?(p: Record<string, unknown>): Promise<void>;
  commitTurn?(p: Record<string, unknown>): Promise<{ status?: string }>;
  maintain?(p: Record<string, unknown>): Promise<{ changed?: boolean; reason?: string }>;
  prepareSubagentSpawn?(p: Record<string, unknown>): Promise<{ rollback?: () => void | Promise<void> } | undefined>;
  onSubagentEnded?(p: Record<string, unknown>): Promise<void>;
  dispose?(): Promise<void>;
}

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

/** Subagent rollbacks kept at most (older ones are dropped: best effort). */
const MAX_ROLLBACKS = 1024;

export class OpenClawEngine implements ContextEngine {
  private readonly rollbacks = new Map<string, () => void | Promise<void>>();

  constructor(
    private readonly plugin: ContextEngineLike,
    private readonly registry: Registry,
    private readonly toolbox: Tools,
    private readonly transcripts: Transcripts,
    /** OpenClaw's root config (runtimeContext.config, as OpenClaw passes it). */
    private readonly rootConfig: Record<string, unknown>,
  ) {
    // An optional method the plugin lacks is one this engine lacks: the SDK
    // answers UNIMPLEMENTED for it.
    const optional: [keyof ContextEngineLike, string][] = [
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
    if (toolbox.definitions.length === 0) Object.defineProperty(this, "callTool", { value: undefined });
  }

  private has(method: keyof ContextEngineLike): boolean {
    return typeof this.plugin[method] === "function";
  }

  async getInfo(): Promise<pb.EngineInfo> {
    const info = this.plugin.info ?? {};
    const methods = ["GetInfo", "Ingest", "Assemble", "Compact", "IngestBatch", "ForgetSession"];
    if (this.has("bootstrap")) methods.push("Bootstrap");
    if (this.has("afterTurn")) methods.push("AfterTurn");
    if (this.has("commitTurn")) methods.push("CommitTurn");
    if (this.has("maintain")) methods.push("Maintain");
    if (this.has("prepareSubagentSpawn")) methods.push("PrepareSubagentSpawn", "RollbackSubagentSpawn");
    if (this.has("onSubagentEnded")) methods.push("OnSubagentEnded");
    if (this.toolbox.definitions.length > 0) methods.push("CallTool");
    const out: pb.EngineInfo = {
      id: String(info.id ?? "openclaw-plugin"),
      name: String(info.name ?? info.id ?? "OpenClaw plugin"),
      version: String(info.version ?? ""),
      contractVersion: "1.0",
      ownsCompaction: info["ownsCompaction"] === true,
      turnMaintenanceMode: info["turnMaintenanceMode"] === "background" ? "TURN_MAINTENANCE_MODE_BACKGROUND" : "TURN_MAINTENANCE_MODE_FOREGROUND",
      implementedMethods: methods,
      historyDelivery: "HISTORY_DELIVERY_FULL",
      // The plugin keeps session state in its own store.
      replicaAffinity: "REPLICA_AFFINITY_SESSION",
      tools: this.toolbox.definitions,
    };
    const accepted = info["acceptedHostParams"];
    if (Array.isArray(accepted)) {
      // The host itself needs `host` (runtime.llm, runtime.subagent) and
      // the session key (tool factories, hooks).
      const names = new Set<string>(["host", "session_key"]);
      for (const a of accepted) if (HOST_PARAMS[String(a)]) names.add(HOST_PARAMS[String(a)]!);
      out.acceptedHostParams = { params: [...names] };
    }
    const sem = info["transcriptSemantics"] as Record<string, string> | undefined;
    if (sem) {
      const fence = CAPABILITY_ENUMS.currentTurnFence[sem["currentTurnFence"] as keyof typeof CAPABILITY_ENUMS.currentTurnFence];
      const idem = CAPABILITY_ENUMS.turnAdvancementIdempotency[sem["turnAdvancementIdempotency"] as keyof typeof CAPABILITY_ENUMS.turnAdvancementIdempotency];
      out.transcriptSemantics = {
        ...(fence ? { currentTurnFence: fence } : {}),
        ...(idem && this.has("commitTurn") ? { turnAdvancementIdempotency: idem } : {}),
      };
    }
    const reqs = info["hostRequirements"] as Record<string, { requiredCapabilities?: string[]; unsupportedMessage?: string }> | undefined;
    if (reqs) {
      out.hostRequirements = Object.entries(reqs).map(([operation, r]) => ({
        operation,
        requiredCapabilities: r?.requiredCapabilities ?? [],
        ...(r?.unsupportedMessage ? { unsupportedMessage: r.unsupportedMessage } : {}),
      }));
    }
    return out;
  }

  /** The runtime context a plugin method gets: the contract's fields in
   * OpenClaw's names, with the call's model capability. */
  private runtimeContext(rc: pb.RuntimeContext__Output | null | undefined, host: boolean, extra: Record<string, unknown> = {}): Record<string, unknown> {
    const out: Record<string, unknown> = { transcriptStorage: { kind: "sqlite" }, config: this.rootConfig, ...extra };
    if (rc) {
      for (const [k, v] of Object.entries(rc)) {
        if (k.startsWith("_") || v === undefined || v === null || k === "extra" || k === "transcriptStorage") continue;
        if (typeof v === "string" && v === "" && k !== "cwd") continue;
        out[k] = v;
      }
      for (const [k, v] of Object.entries(rc.extra ?? {})) {
        try {
          out[k] = JSON.parse(v) as unknown;
        } catch {
          out[k] = v;
        }
      }
    }
    if (host) out["llm"] = { complete: llmComplete };
    return out;
  }

  private async hooks(name: string, event: Record<string, unknown>, ctx: Record<string, unknown>): Promise<unknown[]> {
    const out: unknown[] = [];
    for (const h of this.registry.hooks.get(name) ?? ([] as Hook[])) out.push(await h(event, ctx));
    return out;
  }

  private session(sessionId: string, sessionKey: string | undefined) {
    return { sessionId, sessionKey: sessionKey || sessionId };
  }

  async bootstrap(req: pb.BootstrapRequest__Output, ctx: CallContext): Promise<pb.BootstrapResult> {
    // Mirror the gateway's transcript first, when the grant allows reading it.
    if (ctx.host?.allows("read_transcript")) {
      const entries = await ctx.host.readTranscript(ctx, true);
      const messages = entries.map((e) => e.message).filter((m): m is pb.AgentMessage__Output => !!m);
      this.transcripts.append(req.sessionId, messages);
    }
    const r = await within(ctx, () =>
      this.plugin.bootstrap!({
        ...this.session(req.sessionId, req.sessionKey),
        sessionFile: this.transcripts.ensure(req.sessionId),
        runtimeContext: this.runtimeContext(req.runtimeContext, !!ctx.host),
      }),
    );
    return {
      bootstrapped: r?.bootstrapped === true,
      ...(typeof r?.importedMessages === "number" ? { importedMessages: r.importedMessages } : {}),
      ...(r?.reason ? { reason: r.reason } : {}),
    };
  }

  async ingest(req: pb.IngestRequest__Output, ctx: CallContext): Promise<pb.IngestResult> {
    // Idempotent by message id, whatever the plugin does with repeats.
    if (this.transcripts.append(req.sessionId, [req.message!]).length === 0) return { ingested: false };
    let ingested = false;
    for (const message of toOpenClaw(req.message!)) {
      const r = await within(ctx, () => this.plugin.ingest({ ...this.session(req.sessionId, req.sessionKey), message, isHeartbeat: req.isHeartbeat }));
      ingested ||= r?.ingested !== false;
    }
    return { ingested };
  }

  async ingestBatch(req: pb.IngestBatchRequest__Output, ctx: CallContext): Promise<pb.IngestBatchResult> {
    const fresh = this.transcripts.append(req.sessionId, req.messages);
    if (fresh.length === 0) return { ingestedCount: 0 };
    const messages = fresh.flatMap(toOpenClaw);
    if (this.plugin.ingestBatch) {
      const r = await within(ctx, () => this.plugin.ingestBatch!({ ...this.session(req.sessionId, req.sessionKey), messages, isHeartbeat: req.isHeartbeat }));
      return { ingestedCount: Number(r?.ingestedCount ?? fresh.length) };
    }
    let n = 0;
    for (const message of messages) {
      const r = await within(ctx, () => this.plugin.ingest({ ...this.session(req.sessionId, req.sessionKey), message, isHeartbeat: req.isHeartbeat }));
      if (r?.ingested !== false) n++;
    }
    return { ingestedCount: n };
  }

  async assemble(req: pb.AssembleRequest__Output, ctx: CallContext): Promise<pb.AssembleResult> {
    const session = this.session(req.sessionId, req.sessionKey);
    const messages = req.messages.flatMap(toOpenClaw);
    // before_prompt_build → the system prompt addition. The gateway counts
    // the addition within the budget (OpenClaw keeps its system prompt
    // apart), so the plugin assembles within what the addition leaves.
    const built = (await within(ctx, () => this.hooks("before_prompt_build", { prompt: req.prompt ?? "", messages }, session))) as {
      prependSystemContext?: string;
      appendSystemContext?: string;
    }[];
    const before = built.map((b) => b?.prependSystemContext).filter((t): t is string => !!t);
    const after = built.map((b) => b?.appendSystemContext).filter((t): t is string => !!t);
    const hookTokens = textTokens([...before, ...after].join("\n\n"));
    const budget = req.tokenBudget === undefined || req.tokenBudget === null ? undefined : Math.max(1, Number(req.tokenBudget) - hookTokens);
    const r = await within(ctx, () =>
      this.plugin.assemble({
        ...session,
        messages,
        ...(budget !== undefined ? { tokenBudget: budget } : {}),
        availableTools: new Set(req.availableTools),
        ...(req.citationsMode ? { citationsMode: req.citationsMode } : {}),
        ...(req.model ? { model: req.model } : {}),
        ...(req.prompt ? { prompt: req.prompt } : {}),
        runtimeContext: this.runtimeContext(req.runtimeContext, !!ctx.host),
      }),
    );
    // What the plugin may give back: the session's transcript (whose
    // fingerprints are computed once) and what this request adds to it.
    const held = this.transcripts.messages(req.sessionId);
    const known = [...held, ...req.messages.filter((m) => !this.transcripts.holds(req.sessionId, m.id))];
    const out = matchBack(r?.messages ?? [], known);
    const additions = [...before, ...(r?.systemPromptAddition ? [r.systemPromptAddition] : []), ...after];
    const result: pb.AssembleResult = {
      messages: out,
      estimatedTokens: typeof r?.estimatedTokens === "number" && Number.isFinite(r.estimatedTokens) ? Math.max(0, Math.round(r.estimatedTokens)) : messagesTokens(out),
      promptAuthority: r?.promptAuthority === "preassembly_may_overflow" ? "PROMPT_AUTHORITY_PREASSEMBLY_MAY_OVERFLOW" : "PROMPT_AUTHORITY_ASSEMBLED",
    };
    if (additions.length > 0) result.systemPromptAddition = additions.join("\n\n");
    const proj = r?.contextProjection;
    if (proj?.mode === "thread_bootstrap" && proj.epoch) {
      result.projection = { mode: "PROJECTION_MODE_THREAD_BOOTSTRAP", epoch: proj.epoch, ...(proj.fingerprint ? { fingerprint: proj.fingerprint } : {}) };
    }
    return result;
  }

  async compact(req: pb.CompactRequest__Output, ctx: CallContext, progress: Progress): Promise<CompactOutcome> {
    await progress.report("compacting", 0, 0, "the plugin is compacting");
    const rc = req.runtimeContext;
    const r = await within(ctx, () =>
      this.plugin.compact({
        ...this.session(req.sessionId, req.sessionKey),
        sessionFile: this.transcripts.ensure(req.sessionId),
        ...(req.agentId ? { agentId: req.agentId } : {}),
        ...(req.tokenBudget !== undefined && req.tokenBudget !== null ? { tokenBudget: Number(req.tokenBudget) } : {}),
        force: req.force,
        ...(req.currentTokenCount !== undefined && req.currentTokenCount !== null ? { currentTokenCount: Number(req.currentTokenCount) } : {}),
        compactionTarget: req.compactionTarget === "COMPACTION_TARGET_THRESHOLD" ? "threshold" : "budget",
        ...(req.customInstructions ? { customInstructions: req.customInstructions } : {}),
        runtimeContext: this.runtimeContext(rc, !!ctx.host),
        abortSignal: ctx.signal,
      }),
    );
    const delegated = (r as Record<symbol, { customInstructions?: string } | undefined>)?.[DELEGATED];
    if (delegated) {
      return { delegateToHost: { reason: "the plugin delegated compaction to the host", ...(delegated.customInstructions ? { customInstructions: delegated.customInstructions } : {}) } };
    }
    const result = (r?.["result"] ?? {}) as Record<string, unknown>;
    const ok = r?.["ok"] === true;
    const compacted = ok && r?.["compacted"] === true;
    const num = (v: unknown) => (typeof v === "number" && Number.isFinite(v) ? Math.max(0, Math.round(v)) : undefined);
    const out: pb.CompactResult = { ok, compacted, tokensBefore: num(result["tokensBefore"]) ?? 0 };
    const reason = r?.["reason"] ?? r?.["error"];
    if (typeof reason === "string" && reason) out.reason = reason;
    if (typeof result["summary"] === "string") out.summary = result["summary"];
    if (typeof result["firstKeptEntryId"] === "string") out.firstKeptEntryId = result["firstKeptEntryId"];
    const after = num(result["tokensAfter"]);
    if (after !== undefined) out.tokensAfter = after;
    if (result["details"] !== undefined) out.detailsJson = JSON.stringify(result["details"]);
    return { result: out };
  }

  async afterTurn(req: pb.AfterTurnRequest__Output, ctx: CallContext): Promise<pb.AfterTurnResult> {
    // The turn is in the transcript before the plugin hears of it (as in
    // OpenClaw, where the session file has the turn by then).
    this.transcripts.append(req.sessionId, req.messages);
    await within(ctx, () =>
      this.plugin.afterTurn!({
        ...this.session(req.sessionId, req.sessionKey),
        sessionFile: this.transcripts.ensure(req.sessionId),
        messages: req.messages.flatMap(toOpenClaw),
        prePromptMessageCount: req.messages.slice(0, Number(req.prePromptMessageCount)).flatMap(toOpenClaw).length,
        ...(req.autoCompactionSummary ? { autoCompactionSummary: req.autoCompactionSummary } : {}),
        isHeartbeat: req.isHeartbeat,
        ...(req.tokenBudget !== undefined && req.tokenBudget !== null ? { tokenBudget: Number(req.tokenBudget) } : {}),
        runtimeContext: this.runtimeContext(req.runtimeContext, !!ctx.host),
      }),
    );
    return {};
  }

  async commitTurn(req: pb.CommitTurnRequest__Output, ctx: CallContext): Promise<pb.CommitTurnResult> {
    this.transcripts.append(req.sessionId, req.messages);
    const r = await within(ctx, () =>
      this.plugin.commitTurn!({
        ...this.session(req.sessionId, req.sessionKey),
        advancementKey: req.advancementKey,
        admission: req.admission,
        terminal: req.terminal,
        messages: req.messages.flatMap(toOpenClaw),
        isHeartbeat: req.isHeartbeat,
        runtimeContext: this.runtimeContext(req.runtimeContext, !!ctx.host),
      }),
    );
    if (r?.status === "committed") return { status: "COMMIT_STATUS_COMMITTED" };
    if (r?.status === "duplicate") return { status: "COMMIT_STATUS_DUPLICATE" };
    throw EngineError.failedPrecondition(`the plugin's commitTurn answered status ${JSON.stringify(r?.status)}`);
  }

  async maintain(req: pb.MaintainRequest__Output, ctx: CallContext): Promise<pb.MaintainResult> {
    const replacements: pb.TranscriptReplacement[] = [];
    const rewriteTranscriptEntries = async (request: { replacements?: { entryId?: string; message?: OcMessage }[] }) => {
      const known = new Map(this.transcripts.messages(req.sessionId).map((m) => [m.id!, m]));
      let n = 0;
      for (const rep of request?.replacements ?? []) {
        const id = String(rep.entryId ?? "");
        if (!known.has(id) || !rep.message) continue;
        const [proto] = matchBack([rep.message], []);
        replacements.push({ entryId: id, message: { ...proto!, id } });
        n++;
      }
      return { changed: n > 0, bytesFreed: 0, rewrittenEntries: n };
    };
    const reason = req.reason === "MAINTAIN_REASON_BOOTSTRAP" ? "bootstrap" : req.reason === "MAINTAIN_REASON_COMPACTION" ? "compaction" : "turn";
    const r = await within(ctx, () =>
      this.plugin.maintain!({
        ...this.session(req.sessionId, req.sessionKey),
        sessionFile: this.transcripts.ensure(req.sessionId),
        reason,
        runtimeContext: this.runtimeContext(req.runtimeContext, !!ctx.host, { rewriteTranscriptEntries }),
        abortSignal: ctx.signal,
      }),
    );
    return { replacements, changed: r?.changed === true, ...(r?.reason ? { reason: r.reason } : {}) };
  }

  async prepareSubagentSpawn(req: pb.PrepareSubagentSpawnRequest__Output, ctx: CallContext): Promise<pb.PrepareSubagentSpawnResult> {
    const r = await within(ctx, () =>
      this.plugin.prepareSubagentSpawn!({
        parentSessionKey: req.parentSessionKey,
        childSessionKey: req.childSessionKey,
        contextMode: req.contextMode === "SUBAGENT_CONTEXT_MODE_FORK" ? "fork" : "isolated",
        ...(req.parentSessionId ? { parentSessionId: req.parentSessionId, parentSessionFile: this.transcripts.pathOf(req.parentSessionId) } : {}),
        ...(req.childSessionId ? { childSessionId: req.childSessionId, childSessionFile: this.transcripts.pathOf(req.childSessionId) } : {}),
        ...(req.ttlMs !== undefined && req.ttlMs !== null ? { ttlMs: Number(req.ttlMs) } : {}),
      }),
    );
    if (!r || typeof r.rollback !== "function") return { prepared: !!r };
    if (this.rollbacks.size >= MAX_ROLLBACKS) this.rollbacks.delete(this.rollbacks.keys().next().value!);
    const token = randomUUID();
    this.rollbacks.set(token, r.rollback);
    return { prepared: true, rollbackToken: token };
  }

  async rollbackSubagentSpawn(req: pb.RollbackSubagentSpawnRequest__Output, ctx: CallContext): Promise<pb.RollbackSubagentSpawnResult> {
    const rollback = this.rollbacks.get(req.rollbackToken);
    this.rollbacks.delete(req.rollbackToken);
    if (rollback) await within(ctx, () => rollback());
    return {};
  }

  async onSubagentEnded(req: pb.OnSubagentEndedRequest__Output, ctx: CallContext): Promise<pb.OnSubagentEndedResult> {
    const reasons: Record<string, string> = {
      SUBAGENT_END_REASON_DELETED: "deleted",
      SUBAGENT_END_REASON_COMPLETED: "completed",
      SUBAGENT_END_REASON_SWEPT: "swept",
      SUBAGENT_END_REASON_RELEASED: "released",
    };
    await within(ctx, () =>
      this.plugin.onSubagentEnded!({
        childSessionKey: req.childSessionKey,
        reason: reasons[String(req.reason)] ?? "completed",
        ...(req.agentDir ? { agentDir: req.agentDir } : {}),
        ...(req.workspaceDir ? { workspaceDir: req.workspaceDir } : {}),
      }),
    );
    return {};
  }

  /** ForgetSession: OpenClaw's session_end hook with reason "deleted",
   * and the host's transcript of the session dropped. */
  async forgetSession(req: pb.ForgetSessionRequest__Output, ctx: CallContext): Promise<pb.ForgetSessionResult> {
    const session = this.session(req.sessionId, req.sessionKey);
    await within(ctx, () => this.hooks("session_end", { ...session, reason: "deleted" }, { ...session, ...(req.agentId ? { agentId: req.agentId } : {}) }));
    this.transcripts.forget(req.sessionId);
    return {};
  }

  async callTool(req: pb.CallToolRequest__Output, ctx: CallContext): Promise<pb.CallToolResult> {
    const args = toolArguments(req);
    if (!args) return toolError("the arguments are not a JSON object");
    const session = { ...this.session(req.sessionId, req.sessionKey), ...(req.agentId ? { agentId: req.agentId } : {}) };
    return within(ctx, () => this.toolbox.run(req.name, req.toolCallId, args, session, ctx));
  }

  /** gateway_start: after register and the engine's creation. */
  async start(): Promise<void> {
    await this.hooks("gateway_start", {}, {});
  }

  /** Drain: gateway_stop, then the engine's dispose. */
  async stop(): Promise<void> {
    try {
      await this.hooks("gateway_stop", { reason: "shutdown" }, {});
    } finally {
      await this.plugin.dispose?.();
    }
  }
}
