// The ctxgate plugin for OpenClaw: registers the context engine "ctxgate",
// whose calls a ctxgate gateway answers (engine.ts), and the engine's tools
// as OpenClaw agent tools (tools.ts). Install it into OpenClaw by path
// (plugins.load.paths) or from its packed tarball, select it
// (plugins.slots.contextEngine: "ctxgate") and point it at a gateway
// (plugins.entries.ctxgate.config.endpoint); docs/openclaw.md.
import { readFileSync } from "node:fs";
import { parseConfig } from "./config.js";
import { CtxgateEngine, ENGINE_ID, type Logger, type OpenTurns, runEngineTool } from "./engine.js";
import { type Gateway, connect } from "./gateway.js";
import { KnownSessions } from "./history.js";
import { ENGINE_TOOL_NAMES, EngineTools, readToolsInWorker } from "./tools.js";

interface PluginApi {
  pluginConfig?: unknown;
  logger?: Partial<Logger>;
  registerContextEngine(id: string, factory: (ctx?: unknown) => unknown): void;
  registerTool?(factory: (ctx: { sessionId?: string }) => object[], opts: { names: string[] }): void;
}

/**
 * The turns open in this process. OpenClaw may load the plugin more than
 * once in one process (its tool discovery loads plugins apart from the
 * runtime that runs the engine), and a tool from one load must find the
 * turn an engine of another opened, and offer the tools the last turn's
 * context named: so both are the process's, under registered symbols, not
 * one load's.
 */
const OPEN_TURNS = Symbol.for("ctxgate.openclaw-plugin.open-turns");
const ENGINE_TOOLS = Symbol.for("ctxgate.openclaw-plugin.engine-tools");
/** Sessions whose earlier history the gateway is known to hold (history.ts). */
const KNOWN_SESSIONS = Symbol.for("ctxgate.openclaw-plugin.known-sessions");
function processWide<T>(key: symbol, make: () => T): T {
  const g = globalThis as Record<symbol, T | undefined>;
  return (g[key] ??= make());
}

export default {
  id: ENGINE_ID,
  name: "ctxgate",
  description: "A durable context engine served by a ctxgate gateway.",
  register(api: PluginApi): void {
    const config = parseConfig(api.pluginConfig, process.env, (p) => readFileSync(p));
    const log: Logger = {
      info: (m) => (api.logger?.info ?? console.error)(m),
      warn: (m) => (api.logger?.warn ?? console.error)(m),
    };
    // One connection, made at the first engine: OpenClaw makes an engine a run.
    let gateway: Gateway | undefined;
    const turns = processWide<OpenTurns>(OPEN_TURNS, () => new Map());
    const tools = processWide(ENGINE_TOOLS, () => new EngineTools(readToolsInWorker(api.pluginConfig, config.timeouts.connectMs), log.warn));
    const known = processWide(KNOWN_SESSIONS, () => new KnownSessions());
    api.registerContextEngine(ENGINE_ID, () => new CtxgateEngine((gateway ??= connect(config)), config, log, turns, tools, known));
    api.registerTool?.(
      (ctx) =>
        tools.forRun(ctx.sessionId, (sessionId, toolCallId, name, args) =>
          runEngineTool(turns, config.timeouts.toolMs, sessionId, toolCallId, name, args),
        ),
      { names: [...ENGINE_TOOL_NAMES] },
    );
  },
};
