// The plugin's tools (api.registerTool): declared in EngineInfo.tools and
// run by CallTool. A factory is called with the session of the call, as
// OpenClaw does; a tool's failure is a result the model reads.
import { type CallContext, type pb, toolError } from "@ctxgate/engine-sdk";

export interface AgentTool {
  name: string;
  label?: string;
  description?: string;
  parameters?: unknown;
  execute: (toolCallId: string, params: Record<string, unknown>, signal?: AbortSignal) => unknown;
}

export interface ToolContext {
  sessionId?: string;
  sessionKey?: string;
  agentId?: string;
  [k: string]: unknown;
}

export type ToolFactory = (ctx: ToolContext) => AgentTool | AgentTool[] | null | undefined | Promise<AgentTool | AgentTool[] | null | undefined>;

interface Registered {
  name?: string;
  factory: ToolFactory;
}

const MAX_DESCRIPTION = 4096;

function truncateUtf8(s: string, max: number): string {
  if (Buffer.byteLength(s) <= max) return s;
  let out = s.slice(0, max);
  while (Buffer.byteLength(out) > max - 3) out = out.slice(0, -1);
  return `${out}...`;
}

export class Tools {
  private readonly registered: Registered[] = [];
  private declared: pb.ToolDefinition[] = [];
  private readonly byName = new Map<string, Registered>();

  constructor(private readonly subagentOnly: ReadonlySet<string>) {}

  register(toolOrFactory: AgentTool | ToolFactory, options?: { name?: string; names?: string[] }): void {
    const factory: ToolFactory = typeof toolOrFactory === "function" ? (toolOrFactory as ToolFactory) : () => toolOrFactory;
    const name = options?.name ?? (typeof toolOrFactory === "object" ? toolOrFactory.name : undefined);
    this.registered.push(name === undefined ? { factory } : { name, factory });
  }

  /** Calls every factory once with a blank session to learn the tools'
   * names, descriptions and schemas (at start). */
  async declare(): Promise<pb.ToolDefinition[]> {
    const out: pb.ToolDefinition[] = [];
    for (const r of this.registered) {
      const made = await r.factory({ sessionId: "", sessionKey: "" });
      for (const t of (Array.isArray(made) ? made : made ? [made] : []) as AgentTool[]) {
        if (!t || typeof t.name !== "string") continue;
        this.byName.set(t.name, r);
        out.push({
          name: t.name,
          description: truncateUtf8(t.description ?? t.label ?? "", MAX_DESCRIPTION),
          parametersJsonSchema: JSON.stringify(t.parameters ?? { type: "object", properties: {} }),
          audience: this.subagentOnly.has(t.name) ? "TOOL_AUDIENCE_SUBAGENT" : "TOOL_AUDIENCE_MAIN",
        });
      }
    }
    this.declared = out;
    return out;
  }

  get definitions(): pb.ToolDefinition[] {
    return this.declared;
  }

  /** The tool `name` made for the session of `ctx`. */
  async make(name: string, ctx: ToolContext): Promise<AgentTool | undefined> {
    const r = this.byName.get(name);
    if (!r) return undefined;
    const made = await r.factory(ctx);
    return ((Array.isArray(made) ? made : made ? [made] : []) as AgentTool[]).find((t) => t?.name === name);
  }

  /** Runs a tool; whatever goes wrong is an error result for the model. */
  async run(name: string, toolCallId: string, args: Record<string, unknown>, session: ToolContext, ctx: CallContext): Promise<pb.CallToolResult> {
    const tool = await this.make(name, session);
    if (!tool) return toolError(`unknown tool ${JSON.stringify(name)}`);
    try {
      const result = await tool.execute(toolCallId, args, ctx.signal);
      return toToolResult(result);
    } catch (e) {
      ctx.check();
      return toolError(`${name} failed: ${e instanceof Error ? e.message : String(e)}`);
    }
  }
}

/** An OpenClaw tool result ({content: [{type:"text", text}], details},
 * a string, or anything else) as the contract's text result. */
export function toToolResult(result: unknown): pb.CallToolResult {
  if (typeof result === "string") return { content: [{ text: result }] };
  const r = (result ?? {}) as { content?: unknown; isError?: unknown; details?: unknown };
  const texts: string[] = [];
  if (Array.isArray(r.content)) {
    for (const b of r.content as { type?: string; text?: string }[]) {
      if (b && b.type === "text" && typeof b.text === "string") texts.push(b.text);
      else if (b && typeof b === "object") texts.push(`[${b.type ?? "content"}]`);
    }
  } else if (typeof r.content === "string") texts.push(r.content);
  if (texts.length === 0) texts.push(JSON.stringify(r.details ?? result ?? null));
  return { content: texts.map((text) => ({ text })), isError: r.isError === true };
}
