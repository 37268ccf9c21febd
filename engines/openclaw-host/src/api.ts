// The OpenClaw plugin API the host gives a plugin's register(api): the
// parts context-engine plugins use, in OpenClaw 2026.9.6's shapes. What a
// plugin registers is kept in a Registry. Registrations for other kinds of
// plugin that context engines also make (CLI, gateway methods, legacy
// hooks, chat commands) are logged and not served; services are started
// and stopped with the host; a registration the host cannot honour at all
// (providers, channels, HTTP...) fails at start with one sentence naming it.
import { isAbsolute, relative, resolve } from "node:path";
import type {
  AnyAgentTool,
  ContextEngineFactory,
  OpenClawConfig,
  OpenClawPluginCliRegistrationOptions,
  OpenClawPluginCommandDefinition,
  OpenClawPluginHookOptions,
  OpenClawPluginService,
  OpenClawPluginToolFactory,
  OpenClawPluginToolFactoryV2,
  OpenClawPluginToolOptions,
  PluginHookRegistrationOptions,
  PluginLogger,
} from "./openclaw-types.js";
import { llmCompleteFor } from "./runtime.js";
import type { Subagents } from "./subagent.js";
import type { Tools } from "./tools.js";

/** The model a plugin sees configured: the gateway's, whatever it is. */
export const HOST_MODEL = "ctxgate/gateway-model";

/** The OpenClaw version the host presents by default (runtime.version). */
export const DEFAULT_OPENCLAW_VERSION = "2026.9.6";

export type Hook = (event: Record<string, unknown>, ctx: Record<string, unknown>) => unknown;

/** OpenClaw 2026.9.6's typed hook names (src/plugins/hook-types.ts). */
export const PLUGIN_HOOK_NAMES: ReadonlySet<string> = new Set([
  "before_model_resolve",
  "agent_turn_prepare",
  "before_prompt_build",
  "before_agent_reply",
  "model_call_started",
  "model_call_ended",
  "llm_input",
  "llm_output",
  "before_agent_finalize",
  "agent_end",
  "before_compaction",
  "after_compaction",
  "before_reset",
  "inbound_claim",
  "channel_pairing_requested",
  "message_received",
  "message_sending",
  "reply_payload_sending",
  "message_sent",
  "before_tool_call",
  "after_tool_call",
  "tool_result_persist",
  "before_message_write",
  "session_start",
  "session_end",
  "subagent_delivery_target",
  "subagent_spawned",
  "subagent_progress",
  "subagent_ended",
  "gateway_start",
  "gateway_stop",
  "heartbeat_prompt_contribution",
  "cron_reconciled",
  "cron_changed",
  "skill_proposal_evaluate",
  "skill_proposal_changed",
  "skill_changed",
  "before_dispatch",
  "reply_dispatch",
  "before_install",
  "before_agent_run",
  "resolve_exec_env",
]);

/** Hooks the host fires (the other known names are kept and logged, never fired). */
export const FIRED_HOOKS: ReadonlySet<string> = new Set([
  "before_prompt_build",
  "session_end",
  "gateway_start",
  "gateway_stop",
]);

/** Registrations of OpenClaw's plugin API that serve other kinds of plugin
 * (channels, providers, HTTP...): a context-engine host cannot honour them,
 * so a plugin that makes one fails at start. */
export const REFUSED_REGISTRATIONS = [
  "registerProvider",
  "registerChannel",
  "registerHttpRoute",
  "registerHttpHandler",
  "registerSpeechProvider",
  "registerImageGenerationProvider",
  "registerWebSearchProvider",
  "registerMemoryEmbeddingProvider",
  "registerInteractiveHandler",
] as const;

export class UnsupportedApi extends Error {
  constructor(pluginId: string, what: string) {
    super(
      `plugin ${pluginId} calls ${what}, which the ctxgate OpenClaw host does not provide ` +
        `(it hosts context engines: see docs/openclaw-plugins.md)`,
    );
    this.name = "UnsupportedApi";
  }
}

interface HookEntry {
  handler: Hook;
  priority: number;
}

export interface Registry {
  engines: Map<string, ContextEngineFactory>;
  hooks: Map<string, HookEntry[]>;
  commands: string[];
  services: OpenClawPluginService[];
  /** Registrations logged and not served (CLI, gateway methods, legacy hooks). */
  notServed: string[];
  /** Calls of APIs the host does not provide, made during register(). */
  refused: string[];
}

/** The handlers of `name`, higher priority first (registration order within one). */
export function hooksOf(registry: Registry, name: string): Hook[] {
  return (registry.hooks.get(name) ?? []).map((h) => h.handler);
}

export interface ApiOptions {
  pluginId: string;
  pluginName: string;
  pluginVersion?: string;
  source: string;
  rootDir: string;
  stateDir: string;
  pluginConfig: Record<string, unknown>;
  /** OpenClaw's root config (rootConfigFor). */
  rootConfig: OpenClawConfig;
  /** runtime.version: the OpenClaw version the host presents. */
  openclawVersion: string;
  tools: Tools;
  subagents: Subagents;
  log: Required<PluginLogger>;
}

/** OpenClaw's root config as a plugin reads it: this plugin's entry, and a
 * default model that names the gateway's (runtime.llm always uses the
 * gateway's model; a plugin cannot choose another). */
export function rootConfigFor(
  pluginId: string,
  pluginConfig: Record<string, unknown>,
  workspaceDir: string,
): OpenClawConfig {
  return {
    plugins: { entries: { [pluginId]: { enabled: true, config: pluginConfig } }, slots: { contextEngine: pluginId } },
    agents: { defaults: { model: { primary: HOST_MODEL }, workspace: workspaceDir } },
  };
}

/** The `api` object for register(api), and what it records. */
export function createPluginApi(o: ApiOptions): { api: Record<string, unknown>; registry: Registry } {
  const registry: Registry = {
    engines: new Map(),
    hooks: new Map(),
    commands: [],
    services: [],
    notServed: [],
    refused: [],
  };
  const rootConfig = o.rootConfig;
  const runtime: Record<string, unknown> = {
    version: o.openclawVersion,
    llm: { complete: llmCompleteFor(() => ({ kind: "plugin", id: o.pluginId, name: o.pluginName })) },
    subagent: o.subagents.api(),
    config: { current: () => rootConfig, loadConfig: () => rootConfig },
  };
  const refuse = (what: string) => () => {
    registry.refused.push(what);
    throw new UnsupportedApi(o.pluginId, what);
  };
  const notServed = (what: string, why: string) => {
    registry.notServed.push(what);
    o.log.info(`${what} registered; not served (${why})`);
  };
  const provided: Record<string, unknown> = {
    id: o.pluginId,
    name: o.pluginName,
    ...(o.pluginVersion ? { version: o.pluginVersion } : {}),
    source: o.source,
    rootDir: o.rootDir,
    registrationMode: "full",
    config: rootConfig,
    pluginConfig: o.pluginConfig,
    runtime: new Proxy(runtime, {
      get(target, key) {
        if (typeof key === "string" && !(key in target) && /^(register|create|send|start)/.test(key)) {
          return refuse(`api.runtime.${key}`);
        }
        return Reflect.get(target, key);
      },
    }),
    logger: o.log,
    resolvePath: (p: string) => {
      const out = resolve(o.stateDir, p);
      const rel = relative(o.stateDir, out);
      if (rel.startsWith("..") || isAbsolute(rel)) {
        throw new Error(`api.resolvePath(${JSON.stringify(p)}) leaves the host's --state-dir ${o.stateDir}`);
      }
      return out;
    },
    registerContextEngine: (id: string, factory: ContextEngineFactory) => {
      registry.engines.set(String(id), factory);
      o.log.info(`context engine ${id} registered`);
    },
    registerTool: (
      tool: AnyAgentTool | OpenClawPluginToolFactory | OpenClawPluginToolFactoryV2,
      opts?: OpenClawPluginToolOptions,
    ) => o.tools.register(tool, opts),
    registerCommand: (def: OpenClawPluginCommandDefinition) => {
      const name = String(def?.name ?? "(unnamed)");
      registry.commands.push(name);
      notServed(`command /${name}`, "ctxgate has no chat commands");
    },
    registerCli: (_registrar: unknown, opts?: OpenClawPluginCliRegistrationOptions) => {
      const names = [...(opts?.commands ?? [])].join(", ");
      notServed(`CLI${names ? ` commands ${names}` : " registrar"}`, "the host runs no OpenClaw CLI");
    },
    registerGatewayMethod: (method: string) => {
      notServed(`gateway method ${String(method)}`, "ctxgate's gateway has its own API");
    },
    registerHook: (events: string | string[], _handler: unknown, opts?: OpenClawPluginHookOptions) => {
      const list = (Array.isArray(events) ? events : [events]).join(", ");
      notServed(`legacy hook ${opts?.name ?? "(unnamed)"} for ${list}`, "the host fires typed hooks (api.on) only");
    },
    registerService: (service: OpenClawPluginService) => {
      if (!service || typeof service.start !== "function") {
        o.log.warn(`service ${String(service?.id)} has no start(); ignored`);
        return;
      }
      registry.services.push(service);
      o.log.info(`service ${service.id} registered; started with the host, stopped at its drain`);
    },
    on: (hookName: string, handler: Hook, opts?: PluginHookRegistrationOptions) => {
      if (!PLUGIN_HOOK_NAMES.has(hookName)) {
        o.log.warn(`unknown typed hook "${String(hookName)}" ignored`);
        return;
      }
      const list = registry.hooks.get(hookName) ?? [];
      const priority = opts?.priority;
      list.push({ handler, priority: typeof priority === "number" && Number.isFinite(priority) ? priority : 0 });
      // Higher priority first; a stable sort keeps registration order within one.
      list.sort((a, b) => b.priority - a.priority);
      registry.hooks.set(hookName, list);
      if (!FIRED_HOOKS.has(hookName))
        o.log.info(`hook ${hookName} registered; ctxgate has no such event, so it never fires`);
    },
  };
  for (const name of REFUSED_REGISTRATIONS) provided[name] = refuse(`api.${name}`);
  const api = new Proxy(provided, {
    get(target, key) {
      if (typeof key === "string" && !(key in target) && /^register[A-Z]/.test(key)) return refuse(`api.${key}`);
      return Reflect.get(target, key);
    },
  });
  return { api, registry };
}
