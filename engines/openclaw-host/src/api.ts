// The OpenClaw plugin API the host gives a plugin's register(api): the
// parts context-engine plugins use. What a plugin registers is kept in a
// Registry; a registration or runtime call the host does not provide
// fails at start with one sentence naming it.
import { isAbsolute, relative, resolve } from "node:path";
import type { ContextEngineLike } from "./engine.js";
import { llmComplete } from "./runtime.js";
import type { Subagents } from "./subagent.js";
import type { AgentTool, ToolFactory, Tools } from "./tools.js";

/** The model a plugin sees configured: the gateway's, whatever it is. */
export const HOST_MODEL = "ctxgate/gateway-model";

export type Hook = (event: Record<string, unknown>, ctx: Record<string, unknown>) => unknown;

/** Lifecycle hooks the host fires (the rest are kept and logged, never fired). */
export const FIRED_HOOKS = ["before_prompt_build", "before_reset", "session_end", "gateway_start", "gateway_stop"] as const;

/** Registrations of OpenClaw's plugin API that serve other kinds of plugin
 * (channels, providers, HTTP, CLI...): a context-engine host cannot honour
 * them, so a plugin that makes one fails at start. */
export const REFUSED_REGISTRATIONS = [
  "registerProvider",
  "registerChannel",
  "registerHttpRoute",
  "registerHttpHandler",
  "registerGatewayMethod",
  "registerService",
  "registerCli",
  "registerSpeechProvider",
  "registerImageGenerationProvider",
  "registerWebSearchProvider",
  "registerMemoryEmbeddingProvider",
  "registerInteractiveHandler",
  "registerHook",
] as const;

export class UnsupportedApi extends Error {
  constructor(pluginId: string, what: string) {
    super(`plugin ${pluginId} calls ${what}, which the ctxgate OpenClaw host does not provide (it hosts context engines: see docs/openclaw-plugins.md)`);
    this.name = "UnsupportedApi";
  }
}

export interface Registry {
  engines: Map<string, () => ContextEngineLike | Promise<ContextEngineLike>>;
  hooks: Map<string, Hook[]>;
  commands: string[];
  /** Calls of APIs the host does not provide, made during register(). */
  refused: string[];
}

export interface ApiOptions {
  pluginId: string;
  pluginName: string;
  source: string;
  stateDir: string;
  pluginConfig: Record<string, unknown>;
  tools: Tools;
  subagents: Subagents;
  log: { debug(m: string): void; info(m: string): void; warn(m: string): void; error(m: string): void };
}

/** The `api` object for register(api), and what it records. */
export function createPluginApi(o: ApiOptions): { api: Record<string, unknown>; registry: Registry; rootConfig: Record<string, unknown> } {
  const registry: Registry = { engines: new Map(), hooks: new Map(), commands: [], refused: [] };
  // OpenClaw's root config as a plugin reads it: this plugin's entry, and
  // a default model that names the gateway's (runtime.llm always uses the
  // gateway's model; a plugin cannot choose another).
  const rootConfig = {
    plugins: { entries: { [o.pluginId]: { enabled: true, config: o.pluginConfig } }, slots: { contextEngine: o.pluginId } },
    agents: { defaults: { model: { primary: HOST_MODEL } } },
  };
  const runtime: Record<string, unknown> = {
    version: "ctxgate-openclaw-host",
    llm: { complete: llmComplete },
    subagent: o.subagents.api(),
    config: { current: () => rootConfig, loadConfig: () => rootConfig },
  };
  const refuse = (what: string) => () => {
    registry.refused.push(what);
    throw new UnsupportedApi(o.pluginId, what);
  };
  const provided: Record<string, unknown> = {
    id: o.pluginId,
    name: o.pluginName,
    source: o.source,
    registrationMode: "full",
    config: rootConfig,
    pluginConfig: o.pluginConfig,
    runtime: new Proxy(runtime, {
      get(target, key) {
        if (typeof key === "string" && !(key in target) && /^(register|create|send|start)/.test(key)) return refuse(`api.runtime.${key}`);
        return Reflect.get(target, key);
      },
    }),
    logger: o.log,
    resolvePath: (p: string) => {
      const out = resolve(o.stateDir, p);
      const rel = relative(o.stateDir, out);
      if (rel.startsWith("..") || isAbsolute(rel)) throw new Error(`api.resolvePath(${JSON.stringify(p)}) leaves the host's --state-dir ${o.stateDir}`);
      return out;
    },
    registerContextEngine: (id: string, factory: () => ContextEngineLike | Promise<ContextEngineLike>) => {
      registry.engines.set(String(id), factory);
      o.log.info(`context engine ${id} registered`);
    },
    registerTool: (tool: AgentTool | ToolFactory, options?: { name?: string }) => {
      o.tools.register(tool, options);
    },
    registerCommand: (def: { name?: string; description?: string }) => {
      const name = String(def?.name ?? "(unnamed)");
      registry.commands.push(name);
      o.log.info(`command /${name} registered; not served (ctxgate has no chat commands)`);
    },
    on: (event: string, handler: Hook) => {
      const list = registry.hooks.get(event) ?? [];
      list.push(handler);
      registry.hooks.set(event, list);
      if (!(FIRED_HOOKS as readonly string[]).includes(event)) o.log.info(`hook ${event} registered; ctxgate has no such event, so it never fires`);
    },
  };
  for (const name of REFUSED_REGISTRATIONS) provided[name] = refuse(`api.${name}`);
  const api = new Proxy(provided, {
    get(target, key) {
      if (typeof key === "string" && !(key in target) && /^register[A-Z]/.test(key)) return refuse(`api.${key}`);
      return Reflect.get(target, key);
    },
  });
  return { api, registry, rootConfig };
}
