// The interface an engine implements, and the helpers it uses.
import type * as pb from "./gen/pb.js";
import type { CallContext } from "./context.js";

/** How a Compact call ends: exactly one terminal event. */
export type CompactOutcome =
  | { result: pb.CompactResult }
  /** Run the gateway's built-in compaction instead (OpenClaw
   * delegateCompactionToRuntime). */
  | { delegateToHost: pb.DelegateToHost };

/** Sends CompactProgress events while Compact runs. */
export interface Progress {
  /** Waits while the caller is slow to read; throws CANCELLED once it has gone. */
  report(stage: string, done: number, total: number, message?: string): Promise<void>;
}

/**
 * A context engine. getInfo, ingest, assemble and compact are required;
 * every other method, left out, answers UNIMPLEMENTED (the gateway reads
 * that as "not implemented"). List what you implement in
 * EngineInfo.implementedMethods (the SDK adds CallTool when you declare
 * tools through `tools()`).
 *
 * Requests reach the methods already validated (ids present, roles known,
 * sizes within limits). A method that throws anything but an EngineError
 * answers INTERNAL "<Method> failed inside the engine" for that call only.
 * When the caller cancels or the deadline passes, `ctx.signal` aborts.
 */
export interface ContextEngine {
  getInfo(ctx: CallContext): Promise<pb.EngineInfo>;
  ingest(req: pb.IngestRequest__Output, ctx: CallContext): Promise<pb.IngestResult>;
  assemble(req: pb.AssembleRequest__Output, ctx: CallContext): Promise<pb.AssembleResult>;
  compact(req: pb.CompactRequest__Output, ctx: CallContext, progress: Progress): Promise<CompactOutcome>;

  bootstrap?(req: pb.BootstrapRequest__Output, ctx: CallContext): Promise<pb.BootstrapResult>;
  ingestBatch?(req: pb.IngestBatchRequest__Output, ctx: CallContext): Promise<pb.IngestBatchResult>;
  afterTurn?(req: pb.AfterTurnRequest__Output, ctx: CallContext): Promise<pb.AfterTurnResult>;
  commitTurn?(req: pb.CommitTurnRequest__Output, ctx: CallContext): Promise<pb.CommitTurnResult>;
  maintain?(req: pb.MaintainRequest__Output, ctx: CallContext): Promise<pb.MaintainResult>;
  prepareSubagentSpawn?(
    req: pb.PrepareSubagentSpawnRequest__Output,
    ctx: CallContext,
  ): Promise<pb.PrepareSubagentSpawnResult>;
  rollbackSubagentSpawn?(
    req: pb.RollbackSubagentSpawnRequest__Output,
    ctx: CallContext,
  ): Promise<pb.RollbackSubagentSpawnResult>;
  onSubagentEnded?(req: pb.OnSubagentEndedRequest__Output, ctx: CallContext): Promise<pb.OnSubagentEndedResult>;
  dispose?(ctx: CallContext): Promise<pb.DisposeResult>;
  /** The session was deleted: drop everything held for it. Idempotent. */
  forgetSession?(req: pb.ForgetSessionRequest__Output, ctx: CallContext): Promise<pb.ForgetSessionResult>;

  /** The tools the engine offers the model; added to GetInfo's `tools`
   * (with CallTool) when getInfo declares none itself. */
  tools?(): pb.ToolDefinition[];
  /** Runs a declared tool. A tool that cannot help answers toolError(...)
   * (the model reads it), never a thrown error. */
  callTool?(req: pb.CallToolRequest__Output, ctx: CallContext): Promise<pb.CallToolResult>;
}

/** A tool's result: text for the model. */
export function toolText(text: string): pb.CallToolResult {
  return { content: [{ text }], isError: false };
}

/** A tool's failure, for the model: why it could not help. */
export function toolError(text: string): pb.CallToolResult {
  return { content: [{ text }], isError: true };
}

/** A tool declaration (audience MAIN): name, what it does, its arguments'
 * JSON Schema (an object, or a JSON text). */
export function tool(
  name: string,
  description: string,
  parameters: string | Record<string, unknown>,
  audience: pb.ToolAudience = "TOOL_AUDIENCE_MAIN",
): pb.ToolDefinition {
  return {
    name,
    description,
    parametersJsonSchema: typeof parameters === "string" ? parameters : JSON.stringify(parameters),
    audience,
  };
}

/** A tool call's arguments as a JSON object, or undefined when they are not
 * one (answer toolError then). */
export function toolArguments(req: pb.CallToolRequest__Output): Record<string, unknown> | undefined {
  const text = req.argumentsJson.trim() === "" ? "{}" : req.argumentsJson;
  try {
    const v: unknown = JSON.parse(text);
    return typeof v === "object" && v !== null && !Array.isArray(v) ? (v as Record<string, unknown>) : undefined;
  } catch {
    return undefined;
  }
}

/** Message builders for tests and examples. */
export const msg = {
  user: (id: string, text: string): pb.AgentMessage => ({ id, role: "ROLE_USER", content: [{ text }] }),
  assistant: (id: string, text: string): pb.AgentMessage => ({ id, role: "ROLE_ASSISTANT", content: [{ text }] }),
  toolCall: (id: string, callId: string, name: string, argumentsJson = "{}"): pb.AgentMessage => ({
    id,
    role: "ROLE_ASSISTANT",
    content: [{ toolCall: { id: callId, name, argumentsJson } }],
  }),
  toolResult: (id: string, callId: string, text: string): pb.AgentMessage => ({
    id,
    role: "ROLE_TOOL",
    content: [{ toolResult: { toolCallId: callId, text } }],
  }),
};
