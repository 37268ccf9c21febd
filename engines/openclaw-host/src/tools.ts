// The plugin's tools (api.registerTool): declared in EngineInfo.tools and
// run by CallTool. Registration follows OpenClaw 2026.9.6: a tool, a
// factory `(ctx) => tool | tool[]`, or `{contextVersion: 2, create(ctx)}`,
// with options `{name?, names?, optional?}`; the names must be declared in
// the manifest's `contracts.tools`. A factory is called with the session
// of the call, as OpenClaw does; a tool's failure is a result the model
// reads.
import { type CallContext, type pb, toolError } from "@ctxgate/engine-sdk";
import type {
  AnyAgentTool,
  OpenClawPluginToolContext,
  OpenClawPluginToolFactory,
  OpenClawPluginToolFactoryV2,
  OpenClawPluginToolOptions,
  ToolFactoryResult,
} from "./openclaw-types.js";

interface Registered {
  /** The names the registration declares (options and a plain tool's name). */
  names: string[];
  optional: boolean;
  factory: OpenClawPluginToolFactory;
}

export interface ToolsOptions {
  /** Tools offered to sub-agent sessions only. */
  subagentOnly: ReadonlySet<string>;
  /** Optional tools the operator allows (OpenClaw offers optional tools only when allowlisted). */
  allowOptional: ReadonlySet<string>;
  /** The manifest's `contracts.tools`; undefined when the plugin ships no manifest. */
  declaredNames: readonly string[] | undefined;
  /** The factory context every call starts from (config, dirs, agent). */
  baseContext: () => OpenClawPluginToolContext;
  warn: (line: string) => void;
}

const MAX_DESCRIPTION = 4096;

function truncateUtf8(s: string, max: number): string {
  if (Buffer.byteLength(s) <= max) return s;
  let out = s.slice(0, max);
  while (Buffer.byteLength(out) > max - 3) out = out.slice(0, -1);
  return `${out}...`;
}

function toolsOf(made: ToolFactoryResult): AnyAgentTool[] {
  return (Array.isArray(made) ? made : made ? [made] : []).filter(
    (t): t is AnyAgentTool => !!t && typeof t.name === "string",
  );
}

function isV2(tool: unknown): tool is OpenClawPluginToolFactoryV2 {
  return !!tool && typeof tool === "object" && "contextVersion" in tool;
}

export class Tools {
  private readonly registered: Registered[] = [];
  private declared: pb.ToolDefinition[] = [];
  private readonly byName = new Map<string, Registered>();
  /** Registration errors (OpenClaw reports them and drops the tool; the host fails at start). */
  readonly errors: string[] = [];

  constructor(private readonly o: ToolsOptions) {}

  register(
    tool: AnyAgentTool | OpenClawPluginToolFactory | OpenClawPluginToolFactoryV2,
    opts?: OpenClawPluginToolOptions,
  ): void {
    const declaredNames = this.o.declaredNames;
    if (!declaredNames && this.registered.length === 0) {
      this.o.warn("the plugin ships no openclaw.plugin.json: its tool names are not checked against contracts.tools");
    }
    if (declaredNames && declaredNames.length === 0) {
      this.errors.push("plugin must declare contracts.tools before registering agent tools");
      return;
    }
    const names = [...(opts?.names ?? []), ...(opts?.name ? [opts.name] : [])];
    const versioned = typeof tool !== "function" && isV2(tool);
    if (versioned && (tool.contextVersion !== 2 || typeof tool.create !== "function")) {
      this.errors.push("unsupported plugin tool context version");
      return;
    }
    let factory: OpenClawPluginToolFactory;
    if (typeof tool === "function") factory = tool;
    else if (versioned) {
      factory = (ctx) => {
        const assertInvocationCurrent = ctx.assertInvocationCurrent;
        if (!assertInvocationCurrent) throw new Error("Version 2 tool factories require host invocation authority");
        return tool.create({ ...ctx, assertInvocationCurrent });
      };
    } else {
      const plain = tool as AnyAgentTool;
      names.push(plain.name);
      factory = () => plain;
    }
    const normalized = [...new Set(names.map((n) => String(n).trim()).filter(Boolean))];
    if (declaredNames) {
      const undeclared = normalized.filter((n) => !declaredNames.includes(n));
      if (undeclared.length > 0) {
        this.errors.push(`plugin must declare contracts.tools for: ${undeclared.join(", ")}`);
        return;
      }
    }
    this.registered.push({ names: normalized, optional: opts?.optional === true, factory });
  }

  /** Calls every factory once, with no session, to learn the tools' names,
   * descriptions and schemas (at start). Optional tools not allowed are left out. */
  async declare(): Promise<pb.ToolDefinition[]> {
    const out: pb.ToolDefinition[] = [];
    for (const r of this.registered) {
      if (r.optional && !r.names.some((n) => this.o.allowOptional.has(n))) continue;
      const made = await r.factory({ ...this.o.baseContext(), assertInvocationCurrent: () => undefined });
      for (const t of toolsOf(made)) {
        if (this.byName.has(t.name)) continue;
        // A factory's tools answer to the manifest too, whatever it was registered under.
        if (this.o.declaredNames && !this.o.declaredNames.includes(t.name)) {
          this.o.warn(`tool ${JSON.stringify(t.name)} is not in the plugin's contracts.tools; it is not offered`);
          continue;
        }
        if (r.optional && !this.o.allowOptional.has(t.name)) continue;
        this.byName.set(t.name, r);
        out.push({
          name: t.name,
          description: truncateUtf8(t.description ?? t.label ?? "", MAX_DESCRIPTION),
          parametersJsonSchema: JSON.stringify(t.parameters ?? { type: "object", properties: {} }),
          audience: this.o.subagentOnly.has(t.name) ? "TOOL_AUDIENCE_SUBAGENT" : "TOOL_AUDIENCE_MAIN",
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
  async make(name: string, ctx: OpenClawPluginToolContext): Promise<AnyAgentTool | undefined> {
    const r = this.byName.get(name);
    if (!r) return undefined;
    return toolsOf(await r.factory(ctx)).find((t) => t.name === name);
  }

  /** Runs a tool; whatever goes wrong is an error result for the model. */
  async run(
    name: string,
    toolCallId: string,
    args: Record<string, unknown>,
    session: { sessionId?: string; sessionKey?: string; agentId?: string },
    ctx: CallContext,
  ): Promise<pb.CallToolResult> {
    const base = this.o.baseContext();
    const toolCtx: OpenClawPluginToolContext = {
      ...base,
      ...(session.sessionId ? { sessionId: session.sessionId } : {}),
      ...(session.sessionKey ? { sessionKey: session.sessionKey } : {}),
      ...(session.agentId ? { agentId: session.agentId } : {}),
      assertInvocationCurrent: () => ctx.check(),
    };
    let tool: AnyAgentTool | undefined;
    try {
      tool = await this.make(name, toolCtx);
    } catch (e) {
      ctx.check();
      return toolError(`${name} could not be made: ${e instanceof Error ? e.message : String(e)}`);
    }
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
