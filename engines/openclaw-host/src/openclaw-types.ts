// OpenClaw 2026.9.6's plugin-facing types, as its package declares them
// (dist/plugin-entry-*.d.ts, src/context-engine/types; dist/agent-harness-
// runtime-*.d.ts for the plugin API and runtime.llm): the shapes the host
// gives a plugin and reads back. Only what the host uses; an `AgentMessage`
// stays loose (plugins read the fields they know and carry the rest).
import type { OcMessage } from "./convert.js";

export type AgentMessage = OcMessage;

/** Immutable transcript identity issued by the SQLite append transaction. */
export interface TranscriptEntryAnchor {
  readonly agentId: string;
  readonly sessionId: string;
  readonly sessionKey: string;
  readonly storePath: string;
  readonly generation: string;
  readonly entryId: string;
  readonly rawSeq: number;
  readonly effectiveParentId: string | null;
  readonly activeMessagePosition: number;
  readonly idempotencyKey?: string;
}

/** The admitted user entry of one logical turn. */
export interface TranscriptTurnAdmission extends TranscriptEntryAnchor {
  readonly logicalTurnId: string;
  readonly role: "user";
}

export interface ContextEngineSessionTarget {
  agentId?: string;
  sessionId?: string;
  sessionKey?: string;
  storePath?: string;
  threadId?: string | number;
}

export type ContextEngineRuntimeMode = "normal" | "fallback" | "degraded";
export type ContextEngineSelectionSource = "configured" | "default" | "unknown";
export type ContextEngineRuntimeReasonCode =
  "provider_timeout" | "provider_unavailable" | "rate_limited" | "context_overflow" | "runtime_unavailable" | "unknown";

/** Schema v1: every unset value is `null`. */
export interface ContextEngineRuntimeSettings {
  schemaVersion: 1;
  runtime: { host: "openclaw"; mode: ContextEngineRuntimeMode; harnessId: string | null; runtimeId: string | null };
  model: { requested: string | null; resolved: string | null; provider: string | null; family: string | null };
  contextEngineSelection: { selectedId: string | null; source: ContextEngineSelectionSource };
  executionHost: { id: string | null; label: string | null };
  limits: { promptTokenBudget: number | null; maxOutputTokens: number | null };
  diagnostics: {
    fallbackReason: ContextEngineRuntimeReasonCode | null;
    degradedReason: ContextEngineRuntimeReasonCode | null;
  };
}

export interface TranscriptRewriteReplacement {
  entryId: string;
  message: AgentMessage;
}

export interface TranscriptRewriteRequest {
  replacements: TranscriptRewriteReplacement[];
  allowedRewriteSuffixEntryIds?: string[];
}

export interface TranscriptRewriteResult {
  changed: boolean;
  bytesFreed: number;
  rewrittenEntries: number;
  reason?: string;
}

export type ContextEngineMaintenanceResult = TranscriptRewriteResult;

export interface LlmCompleteMessage {
  role: "system" | "user" | "assistant";
  content: string;
}

export type ThinkLevel = string;

/** LlmDirectCompleteParams | LlmIsolatedAgentRuntimeCompleteParams. */
export interface LlmCompleteParams {
  model?: string;
  maxTokens?: number;
  temperature?: number;
  reasoning?: ThinkLevel;
  systemPrompt?: string;
  signal?: AbortSignal;
  purpose?: string;
  agentId?: string;
  messages: LlmCompleteMessage[];
  /** Provider-native constrained output (`{type: "json_object" | "json_schema" | "text", ...}`). */
  responseFormat?: Record<string, unknown>;
  requiredAuthMode?: "oauth";
  execution?: { mode: "isolated-agent-runtime"; authProfileId?: string; timeoutMs?: number };
}

export interface LlmCompleteCaller {
  kind: "plugin" | "context-engine" | "host" | "unknown";
  id?: string;
  name?: string;
}

export interface LlmCompleteUsage {
  inputTokens?: number;
  outputTokens?: number;
  cacheReadTokens?: number;
  cacheWriteTokens?: number;
  totalTokens?: number;
  costUsd?: number;
}

export interface LlmCompleteResult {
  text: string;
  provider: string;
  model: string;
  responseModel?: string;
  stopReason?: "stop" | "length" | "toolUse" | "error" | "aborted";
  agentId: string;
  usage: LlmCompleteUsage;
  execution: { mode: "direct-provider"; owner: { kind: "provider"; id: string } };
  audit: { caller: LlmCompleteCaller; purpose?: string; sessionKey?: string };
}

/** ContextEngineRuntimeContext: open, with these known keys. */
export interface ContextEngineRuntimeContext {
  [key: string]: unknown;
  cwd?: string;
  allowDeferredCompactionExecution?: boolean;
  tokenBudget?: number;
  agentHarnessId?: string;
  currentTokenCount?: number;
  promptCache?: Record<string, unknown>;
  transcriptStorage?: { kind: "sqlite" };
  sessionTarget?: ContextEngineSessionTarget;
  rewriteTranscriptEntries?: (request: TranscriptRewriteRequest) => Promise<TranscriptRewriteResult>;
  llm?: { complete: (params: LlmCompleteParams) => Promise<LlmCompleteResult> };
}

/** What OpenClaw persists with a durable turn and hands commitTurn (JSON: no functions). */
export interface CommitTurnRuntimeContext {
  provider?: string;
  modelId?: string;
  modelContextWindow?: number;
  tokenBudget?: number;
}

export interface ContextEngineInfo {
  id: string;
  name: string;
  version?: string;
  acceptedHostParams?: string[];
  transcriptSemantics?: {
    currentTurnFence?: "before-current-turn-entry-v1";
    turnAdvancementIdempotency?: "atomic-idempotent-v1";
  };
  ownsCompaction?: boolean;
  turnMaintenanceMode?: "foreground" | "background";
  hostRequirements?: Partial<Record<string, { requiredCapabilities: string[]; unsupportedMessage?: string }>>;
}

export interface BootstrapParams {
  sessionId: string;
  sessionKey?: string;
  sessionTarget?: ContextEngineSessionTarget;
  sessionFile: string;
  runtimeSettings?: ContextEngineRuntimeSettings;
  runtimeContext?: ContextEngineRuntimeContext;
}

/** Bootstrap's parameters, and the call's abort signal. */
export interface MaintainParams extends BootstrapParams {
  abortSignal?: AbortSignal;
}

export interface IngestParams {
  sessionId: string;
  sessionKey?: string;
  message: AgentMessage;
  isHeartbeat?: boolean;
}

export interface IngestBatchParams {
  sessionId: string;
  sessionKey?: string;
  messages: AgentMessage[];
  isHeartbeat?: boolean;
}

export interface AfterTurnParams {
  sessionId: string;
  sessionKey?: string;
  sessionTarget?: ContextEngineSessionTarget;
  sessionFile: string;
  messages: AgentMessage[];
  prePromptMessageCount: number;
  autoCompactionSummary?: string;
  isHeartbeat?: boolean;
  tokenBudget?: number;
  runtimeSettings?: ContextEngineRuntimeSettings;
  runtimeContext?: ContextEngineRuntimeContext;
}

export interface CommitTurnParams {
  advancementKey: string;
  admission: TranscriptTurnAdmission;
  terminal: TranscriptEntryAnchor;
  messages: AgentMessage[];
  sessionId: string;
  sessionKey?: string;
  sessionTarget?: ContextEngineSessionTarget;
  runtimeSettings?: ContextEngineRuntimeSettings;
  runtimeContext?: CommitTurnRuntimeContext;
  isHeartbeat?: boolean;
}

export interface AssembleParams {
  sessionId: string;
  sessionKey?: string;
  messages: AgentMessage[];
  tokenBudget?: number;
  availableTools?: Set<string>;
  citationsMode?: string;
  model?: string;
  prompt?: string;
  runtimeSettings?: ContextEngineRuntimeSettings;
  runtimeContext?: ContextEngineRuntimeContext;
}

export interface CompactParams {
  sessionId: string;
  sessionKey: string;
  agentId?: string;
  sessionTarget?: ContextEngineSessionTarget;
  tokenBudget?: number;
  force?: boolean;
  currentTokenCount?: number;
  compactionTarget?: "budget" | "threshold";
  customInstructions?: string;
  runtimeSettings?: ContextEngineRuntimeSettings;
  runtimeContext?: ContextEngineRuntimeContext;
  abortSignal?: AbortSignal;
}

export interface PrepareSubagentSpawnParams {
  parentSessionKey: string;
  childSessionKey: string;
  contextMode?: "isolated" | "fork";
  parentSessionId?: string;
  parentSessionFile?: string;
  childSessionId?: string;
  childSessionFile?: string;
  ttlMs?: number;
}

export type SubagentEndReason = "deleted" | "completed" | "swept" | "released";

export interface OnSubagentEndedParams {
  childSessionKey: string;
  reason: SubagentEndReason;
  agentDir?: string;
  workspaceDir?: string;
}

export interface AssembleResult {
  messages: AgentMessage[];
  estimatedTokens: number;
  promptAuthority?: "assembled" | "preassembly_may_overflow";
  systemPromptAddition?: string;
  contextProjection?: { mode: "per_turn" | "thread_bootstrap"; epoch?: string; fingerprint?: string };
}

export interface CompactResult {
  ok: boolean;
  compacted: boolean;
  reason?: string;
  result?: {
    summary?: string;
    firstKeptEntryId?: string;
    tokensBefore: number;
    tokensAfter?: number;
    details?: unknown;
    sessionId?: string;
    sessionTarget?: ContextEngineSessionTarget;
  };
}

export interface BootstrapResult {
  bootstrapped: boolean;
  importedMessages?: number;
  reason?: string;
}

/** OpenClaw's ContextEngine as a plugin implements it. */
export interface ContextEngine {
  readonly info: ContextEngineInfo;
  bootstrap?(params: BootstrapParams): Promise<BootstrapResult>;
  maintain?(params: MaintainParams): Promise<ContextEngineMaintenanceResult>;
  ingest(params: IngestParams): Promise<{ ingested: boolean }>;
  ingestBatch?(params: IngestBatchParams): Promise<{ ingestedCount: number }>;
  afterTurn?(params: AfterTurnParams): Promise<void>;
  commitTurn?(params: CommitTurnParams): Promise<{ status: "committed" | "duplicate" }>;
  assemble(params: AssembleParams): Promise<AssembleResult>;
  compact(params: CompactParams): Promise<CompactResult>;
  prepareSubagentSpawn?(
    params: PrepareSubagentSpawnParams,
  ): Promise<{ rollback: () => void | Promise<void> } | undefined>;
  onSubagentEnded?(params: OnSubagentEndedParams): Promise<void>;
  dispose?(): Promise<void>;
}

/** The methods OpenClaw's registry guards (projects host params for). */
export type ContextEngineMethod =
  | "bootstrap"
  | "maintain"
  | "ingest"
  | "ingestBatch"
  | "afterTurn"
  | "commitTurn"
  | "assemble"
  | "compact"
  | "prepareSubagentSpawn"
  | "onSubagentEnded";

export interface ContextEngineFactoryContext {
  config?: OpenClawConfig;
  agentDir?: string;
  workspaceDir?: string;
}

export type ContextEngineFactory = (ctx: ContextEngineFactoryContext) => ContextEngine | Promise<ContextEngine>;

/** OpenClaw's root config, as far as the host fills it. */
export interface OpenClawConfig {
  plugins: {
    entries: Record<string, { enabled: boolean; config: Record<string, unknown> }>;
    slots: { contextEngine: string };
  };
  agents: { defaults: { model: { primary: string }; workspace?: string } };
  [key: string]: unknown;
}

export interface PluginLogger {
  debug?: (message: string) => void;
  info: (message: string) => void;
  warn: (message: string) => void;
  error: (message: string) => void;
}

/** registerService's service and the context its start/stop get. */
export interface OpenClawPluginServiceContext {
  config: OpenClawConfig;
  workspaceDir?: string;
  stateDir: string;
  logger: PluginLogger;
}

export interface OpenClawPluginService {
  id: string;
  reload?: { configPrefixes: readonly string[] };
  start: (ctx: OpenClawPluginServiceContext) => void | Promise<void>;
  stop?: (ctx: OpenClawPluginServiceContext) => void | Promise<void>;
}

export interface OpenClawPluginCommandDefinition {
  name: string;
  description?: string;
  acceptsArgs?: boolean;
  requireAuth?: boolean;
  handler?: unknown;
}

/** before_prompt_build (OpenClaw's PluginHookBeforePromptBuildEvent). */
export interface PluginHookBeforePromptBuildEvent {
  prompt: string;
  currentUserMessage?: string;
  currentUserMessageId?: string;
  /** Session messages prepared for this run. */
  messages: unknown[];
}

/** What a before_prompt_build handler may answer; the host uses the two
 * system-context fields (the contract's system prompt addition). */
export interface PluginHookBeforePromptBuildResult {
  systemPrompt?: string;
  prependContext?: string;
  appendContext?: string;
  toolsAllow?: string[];
  prependSystemContext?: string;
  appendSystemContext?: string;
}

export type PluginHookSessionEndReason =
  | "new"
  | "reset"
  | "idle"
  | "daily"
  | "compaction"
  | "deleted"
  | "shutdown"
  | "restart"
  | "unknown";

export interface PluginHookSessionEndEvent {
  sessionId: string;
  sessionKey?: string;
  messageCount: number;
  durationMs?: number;
  reason?: PluginHookSessionEndReason;
  sessionFile?: string;
  transcriptArchived?: boolean;
  nextSessionId?: string;
  nextSessionKey?: string;
}

export interface PluginHookSessionContext {
  agentId?: string;
  sessionId: string;
  sessionKey?: string;
}

/** The hooks the host fires: event, context and answer of each, as
 * OpenClaw types them — but gateway_start, whose OpenClaw event names the
 * gateway's port: a host serving one engine has no gateway port to give. */
export interface PluginHooks {
  before_prompt_build: [PluginHookBeforePromptBuildEvent, PluginHookSessionContext, PluginHookBeforePromptBuildResult];
  session_end: [PluginHookSessionEndEvent, PluginHookSessionContext, void];
  gateway_start: [Record<string, never>, Record<string, never>, void];
  gateway_stop: [{ reason?: string }, Record<string, never>, void];
}

export interface PluginHookRegistrationOptions {
  priority?: number;
  timeoutMs?: number;
  [key: string]: unknown;
}

export interface OpenClawPluginHookOptions {
  name?: string;
  description?: string;
  register?: boolean;
  entry?: unknown;
}

export interface OpenClawPluginCliRegistrationOptions {
  parentPath?: readonly string[];
  commands?: readonly string[];
  descriptors?: readonly unknown[];
}

/** An agent tool (pi-agent-core's AgentTool as plugins build it). */
export interface AnyAgentTool {
  name: string;
  label?: string;
  description?: string;
  parameters?: unknown;
  execute: (toolCallId: string, params: Record<string, unknown>, signal?: AbortSignal, onUpdate?: unknown) => unknown;
}

/** The trusted context a tool factory is called with. */
export interface OpenClawPluginToolContext {
  config?: OpenClawConfig;
  runtimeConfig?: OpenClawConfig;
  getRuntimeConfig?: () => OpenClawConfig | undefined;
  workspaceDir?: string;
  agentDir?: string;
  agentId?: string;
  sessionKey?: string;
  sessionId?: string;
  activeModel?: { provider?: string; modelId?: string };
  sandboxed?: boolean;
  senderIsOwner?: boolean;
  /** Version 2 factories: throws once the engine call the tool runs in is over. */
  assertInvocationCurrent?: () => void;
}

export type ToolFactoryResult = AnyAgentTool | AnyAgentTool[] | null | undefined;
export type OpenClawPluginToolFactory = (ctx: OpenClawPluginToolContext) => ToolFactoryResult;
export interface OpenClawPluginToolFactoryV2 {
  contextVersion: 2;
  create: (ctx: OpenClawPluginToolContext & { assertInvocationCurrent: () => void }) => ToolFactoryResult;
}

export interface OpenClawPluginToolOptions {
  name?: string;
  names?: string[];
  optional?: boolean;
}

/** readVisibleSessionTranscriptMessageEntries' scope (SessionTranscriptReadScope). */
export interface SessionTranscriptReadScope {
  sessionId: string;
  sessionKey?: string;
  agentId?: string;
  storePath?: string;
  sessionFile?: string;
  threadId?: string | number;
}

export interface VisibleSessionTranscriptMessageEntry {
  entryId: string;
  parentId: string | null;
  seq: number;
  message: AgentMessage;
  role: string;
  createdAt?: string;
  idempotencyKey?: string;
}

export type SessionTranscriptVisibleMessageDelta =
  | {
      kind: "page";
      cursor: string;
      entries: VisibleSessionTranscriptMessageEntry[];
      hasMore: boolean;
      requiredBytes?: number;
      serializedBytes: number;
    }
  | {
      kind: "reset";
      cursor: string;
      reason: "invalid_cursor" | "scope_mismatch" | "generation_mismatch" | "anchor_missing" | "anchor_moved";
    }
  | { kind: "missing" }
  | { kind: "unavailable"; reason: "projection_rebuilding" };
