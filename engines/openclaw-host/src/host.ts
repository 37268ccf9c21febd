// Loads an unmodified OpenClaw plugin (an npm spec or a local path), gives
// its register(api) the plugin API context engines use (OpenClaw 2026.9.6's
// by default), and wraps the context engine it registers as a ctxgate
// engine (main.ts serves it; the Assemble benchmark also calls the plugin
// itself, in-process, as its floor). Anything the plugin calls that the
// host does not provide fails here, at start, with one sentence naming it.
import { mkdirSync, readFileSync } from "node:fs";
import { join, resolve } from "node:path";
import { DEFAULT_OPENCLAW_VERSION, type Registry, UnsupportedApi, createPluginApi, rootConfigFor } from "./api.js";
import { OpenClawEngine } from "./engine.js";
import { HOST_ROOT, SDK_ROOT, loadPlugin } from "./loader.js";
import type { ContextEngine, PluginLogger } from "./openclaw-types.js";
import { Subagents } from "./subagent.js";
import { Tools } from "./tools.js";
import { TranscriptReader, installBridge } from "./transcript-reader.js";
import { Transcripts } from "./transcript.js";

/** Tools known to be for sub-agents only (OpenClaw decides it inside the
 * tool; the contract says it up front). `--subagent-tool` adds to it. */
const KNOWN_SUBAGENT_TOOLS: Record<string, string[]> = { "lossless-claw": ["lcm_expand"] };

export class StartError extends Error {}

function logger(id: string): Required<PluginLogger> {
  const line = (level: string, m: string) =>
    process.stderr.write(`${new Date().toISOString()} ${level} [${id}] ${m}\n`);
  return {
    debug: (m: string) => (process.env["OPENCLAW_HOST_DEBUG"] ? line("DEBUG", m) : undefined),
    info: (m: string) => line("INFO", m),
    warn: (m: string) => line("WARN", m),
    error: (m: string) => line("ERROR", m),
  };
}

/** The OpenClaw version the host presents (runtime.version): the flag, the
 * environment, else the host SDK's package version (2026.9.6). */
function openclawVersion(flag: string | undefined): string {
  const fromSdk = () => {
    try {
      const v = (JSON.parse(readFileSync(join(SDK_ROOT, "package.json"), "utf8")) as { version?: unknown }).version;
      return typeof v === "string" && v ? v : undefined;
    } catch {
      return undefined;
    }
  };
  const v = (flag ?? process.env["OPENCLAW_HOST_OPENCLAW_VERSION"] ?? fromSdk() ?? DEFAULT_OPENCLAW_VERSION).trim();
  if (!v) throw new StartError("--openclaw-version must not be blank");
  return v;
}

function readPluginConfig(file: string | undefined): Record<string, unknown> {
  if (!file) return {};
  try {
    const v = JSON.parse(readFileSync(file, "utf8")) as unknown;
    if (!v || typeof v !== "object" || Array.isArray(v)) throw new Error("it is not a JSON object");
    return v as Record<string, unknown>;
  } catch (e) {
    throw new StartError(`--plugin-config ${file}: ${e instanceof Error ? e.message : String(e)}`);
  }
}

/** OpenClaw's registry check of a factory's engine (describeResolvedContextEngineContractError). */
function contractError(engineId: string, plugin: unknown): string | undefined {
  if (!plugin || typeof plugin !== "object") {
    return `Context engine "${engineId}" factory returned ${JSON.stringify(plugin)} instead of a ContextEngine object.`;
  }
  const candidate = plugin as Record<string, unknown>;
  const issues: string[] = [];
  const info = candidate["info"];
  if (!info || typeof info !== "object") issues.push("missing info");
  else {
    for (const field of ["id", "name"]) {
      const value = (info as Record<string, unknown>)[field];
      if (typeof value !== "string" || !value.trim()) issues.push(`missing info.${field}`);
    }
  }
  for (const method of ["ingest", "assemble", "compact"]) {
    if (typeof candidate[method] !== "function") issues.push(`missing ${method}()`);
  }
  if (issues.length === 0) return undefined;
  return `Context engine "${engineId}" factory returned an invalid ContextEngine: ${issues.join(", ")}.`;
}

/** The plugin's context engine and what it registered, and the ctxgate
 * engine serving them. */
export interface Hosted {
  engine: OpenClawEngine;
  plugin: ContextEngine;
  registry: Registry;
}

/** The host's own command-line flags (main.ts), parsed. */
export interface HostFlags {
  plugin?: string;
  "plugin-config"?: string;
  "openclaw-version"?: string;
  "agent-dir"?: string;
  "workspace-dir"?: string;
  "subagent-tool"?: string[];
  "optional-tool"?: string[];
}

/** Loads the plugin `flags.plugin` and starts the engine that serves it. */
export async function startHost(stateDir: string | undefined, flags: HostFlags): Promise<Hosted> {
  const spec = flags.plugin;
  if (!spec) throw new StartError("--plugin SPEC is required (an npm package spec or a local path)");
  if (!stateDir) throw new StartError("--state-dir DIR is required (the plugin's files live there)");
  const dir = resolve(stateDir);
  const version = openclawVersion(flags["openclaw-version"]);
  // OpenClaw's state directory: plugins keep their databases under it.
  process.env["OPENCLAW_STATE_DIR"] ??= dir;
  // Where OpenClaw would put the main agent's files and workspace.
  const agentDir = resolve(flags["agent-dir"] ?? join(dir, "agents", "main", "agent"));
  const workspaceDir = resolve(flags["workspace-dir"] ?? join(dir, "workspace"));
  mkdirSync(agentDir, { recursive: true });
  mkdirSync(workspaceDir, { recursive: true });
  const pluginConfig = readPluginConfig(flags["plugin-config"]);
  const loaded = await loadPlugin(spec, join(HOST_ROOT, ".plugins"));
  const def = loaded.definition;
  const exportedId = typeof def === "object" ? def.id : undefined;
  const manifestId = loaded.manifest?.id;
  if (exportedId && manifestId && exportedId !== manifestId) {
    throw new StartError(
      `plugin ${spec} exports id ${exportedId}, its manifest (openclaw.plugin.json) says ${manifestId}`,
    );
  }
  const id = String(exportedId ?? manifestId ?? loaded.packageJson["name"] ?? spec);
  const log = logger(id);
  const subagentOnly = new Set([
    ...(KNOWN_SUBAGENT_TOOLS[id] ?? []),
    ...(flags["subagent-tool"] ?? []),
  ]);
  const transcripts = new Transcripts(dir);
  const rootConfig = rootConfigFor(id, pluginConfig, workspaceDir);
  const tools = new Tools({
    subagentOnly,
    allowOptional: new Set(flags["optional-tool"] ?? []),
    declaredNames: loaded.manifest ? (loaded.manifest.contracts?.tools ?? []) : undefined,
    baseContext: () => ({
      config: rootConfig,
      runtimeConfig: rootConfig,
      getRuntimeConfig: () => rootConfig,
      workspaceDir,
      agentDir,
      agentId: "main",
      sandboxed: false,
    }),
    warn: log.warn,
  });
  const subagents = new Subagents(tools, log.warn);
  const pluginVersion = loaded.packageJson["version"];
  const { api, registry } = createPluginApi({
    pluginId: id,
    pluginName: String((typeof def === "object" ? def.name : undefined) ?? loaded.manifest?.name ?? id),
    ...(typeof pluginVersion === "string" ? { pluginVersion } : {}),
    source: loaded.entry,
    rootDir: loaded.root,
    stateDir: dir,
    pluginConfig,
    rootConfig,
    openclawVersion: version,
    tools,
    subagents,
    log,
  });
  const register = typeof def === "function" ? def : def.register!;
  try {
    const returned = register.call(def, api) as unknown;
    if (returned && typeof (returned as Promise<unknown>).then === "function") {
      // OpenClaw requires register to be synchronous; the host waits for it.
      log.warn("register(api) returned a promise: OpenClaw requires a synchronous register; the host awaits it");
      await returned;
    }
  } catch (e) {
    if (e instanceof UnsupportedApi) throw e;
    const m = e instanceof Error ? e.message : String(e);
    const missing = /(\S+) is not a function/.exec(m);
    throw new StartError(
      missing
        ? `plugin ${id} calls ${missing[1]}, which the ctxgate OpenClaw host does not provide`
        : `plugin ${id}'s register(api) failed: ${m}`,
    );
  }
  if (registry.refused.length > 0) throw new UnsupportedApi(id, registry.refused[0]!);
  if (tools.errors.length > 0) throw new StartError(`plugin ${id}: ${tools.errors.join("; ")}`);
  if (registry.engines.size === 0) {
    throw new StartError(`plugin ${id} registered no context engine (it never called api.registerContextEngine)`);
  }
  const [engineId, factory] = registry.engines.has(id)
    ? [id, registry.engines.get(id)!]
    : [...registry.engines.entries()][0]!;
  // OpenClaw makes one engine per logical turn; the host makes one for the
  // process (see docs/openclaw-plugins.md).
  let plugin: ContextEngine;
  try {
    plugin = await factory({ config: rootConfig, agentDir, workspaceDir });
  } catch (e) {
    throw new StartError(
      `plugin ${id}'s context engine ${engineId} factory failed: ${e instanceof Error ? e.message : String(e)}`,
    );
  }
  const invalid = contractError(engineId, plugin);
  if (invalid) throw new StartError(`plugin ${id}: ${invalid}`);
  await tools.declare();
  installBridge(new TranscriptReader(transcripts));
  const engine = new OpenClawEngine({
    plugin,
    registry,
    tools,
    transcripts,
    rootConfig,
    serviceContext: { config: rootConfig, workspaceDir, stateDir: dir, logger: log },
    warn: log.warn,
  });
  await engine.start();
  const name = `${String(loaded.packageJson["name"])}@${String(loaded.packageJson["version"])}`;
  log.info(
    `serving context engine ${engineId} (${name}) as OpenClaw ${version}; ` +
      `tools: ${tools.definitions.map((t) => t.name).join(", ") || "none"}; ` +
      `not served: ${registry.notServed.join(", ") || "nothing"}`,
  );
  return { engine, plugin, registry };
}
