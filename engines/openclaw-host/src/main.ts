#!/usr/bin/env node
// The OpenClaw plugin host:
//   run.sh --plugin SPEC --listen ADDR --state-dir DIR [--plugin-config FILE]
//          [--subagent-tool NAME]... [every engine flag of the SDK]
// loads an unmodified OpenClaw plugin (an npm spec or a local path), gives
// its register(api) the plugin API context engines use, and serves the
// context engine it registers as a ctxgate engine. Anything the plugin
// calls that the host does not provide fails here, at start, with one
// sentence naming it.
import { readFileSync } from "node:fs";
import { join, resolve } from "node:path";
import { type ContextEngine, serveMain } from "@ctxgate/engine-sdk";
import { UnsupportedApi, createPluginApi } from "./api.js";
import { OpenClawEngine } from "./engine.js";
import { HOST_ROOT, loadPlugin } from "./loader.js";
import { Subagents } from "./subagent.js";
import { Tools } from "./tools.js";
import { Transcripts } from "./transcript.js";

/** Tools known to be for sub-agents only (OpenClaw decides it inside the
 * tool; the contract says it up front). `--subagent-tool` adds to it. */
const KNOWN_SUBAGENT_TOOLS: Record<string, string[]> = { "lossless-claw": ["lcm_expand"] };

class StartError extends Error {}

let engine: OpenClawEngine | undefined;

function logger(id: string) {
  const line = (level: string, m: string) => process.stderr.write(`${new Date().toISOString()} ${level} [${id}] ${m}\n`);
  return {
    debug: (m: string) => (process.env["OPENCLAW_HOST_DEBUG"] ? line("DEBUG", m) : undefined),
    info: (m: string) => line("INFO", m),
    warn: (m: string) => line("WARN", m),
    error: (m: string) => line("ERROR", m),
  };
}

async function start(stateDir: string | undefined, rest: Record<string, unknown>): Promise<ContextEngine> {
  const spec = rest["plugin"] as string | undefined;
  if (!spec) throw new StartError("--plugin SPEC is required (an npm package spec or a local path)");
  if (!stateDir) throw new StartError("--state-dir DIR is required (the plugin's files live there)");
  const dir = resolve(stateDir);
  // OpenClaw's state directory: plugins keep their databases under it.
  process.env["OPENCLAW_STATE_DIR"] ??= dir;
  let pluginConfig: Record<string, unknown> = {};
  const configFile = rest["plugin-config"] as string | undefined;
  if (configFile) {
    try {
      const v = JSON.parse(readFileSync(configFile, "utf8")) as unknown;
      if (!v || typeof v !== "object" || Array.isArray(v)) throw new Error("it is not a JSON object");
      pluginConfig = v as Record<string, unknown>;
    } catch (e) {
      throw new StartError(`--plugin-config ${configFile}: ${e instanceof Error ? e.message : String(e)}`);
    }
  }
  const loaded = await loadPlugin(spec, join(HOST_ROOT, ".plugins"));
  const def = loaded.definition;
  const id = String((typeof def === "object" ? def.id : undefined) ?? loaded.manifest?.["id"] ?? loaded.packageJson["name"] ?? spec);
  const log = logger(id);
  const subagentOnly = new Set([...(KNOWN_SUBAGENT_TOOLS[id] ?? []), ...((rest["subagent-tool"] as string[] | undefined) ?? [])]);
  const tools = new Tools(subagentOnly);
  const subagents = new Subagents(tools, log.warn);
  const { api, registry, rootConfig } = createPluginApi({
    pluginId: id,
    pluginName: String((typeof def === "object" ? def.name : undefined) ?? id),
    source: loaded.entry,
    stateDir: dir,
    pluginConfig,
    tools,
    subagents,
    log,
  });
  const register = typeof def === "function" ? def : (def.register ?? def.activate)!;
  try {
    await register.call(def, api);
  } catch (e) {
    if (e instanceof UnsupportedApi) throw e;
    const m = e instanceof Error ? e.message : String(e);
    const missing = /(\S+) is not a function/.exec(m);
    throw new StartError(missing ? `plugin ${id} calls ${missing[1]}, which the ctxgate OpenClaw host does not provide` : `plugin ${id}'s register(api) failed: ${m}`);
  }
  if (registry.refused.length > 0) throw new UnsupportedApi(id, registry.refused[0]!);
  if (registry.engines.size === 0) throw new StartError(`plugin ${id} registered no context engine (it never called api.registerContextEngine)`);
  const [engineId, factory] = registry.engines.has(id) ? [id, registry.engines.get(id)!] : [...registry.engines.entries()][0]!;
  const plugin = await factory();
  if (!plugin || typeof plugin.assemble !== "function" || typeof plugin.ingest !== "function" || typeof plugin.compact !== "function") {
    throw new StartError(`plugin ${id}'s context engine ${engineId} lacks a required method (ingest, assemble, compact)`);
  }
  await tools.declare();
  engine = new OpenClawEngine(plugin, registry, tools, new Transcripts(dir), rootConfig);
  await engine.start();
  log.info(
    `serving context engine ${engineId} (${loaded.packageJson["name"]}@${loaded.packageJson["version"]}); tools: ${tools.definitions.map((t) => t.name).join(", ") || "none"}; commands not served: ${registry.commands.join(", ") || "none"}`,
  );
  return engine;
}

// `--install-only --plugin SPEC`: install (or find) the plugin and exit, so
// an image has it at build time.
const only = process.argv.indexOf("--install-only");
if (only >= 0) {
  const at = process.argv.indexOf("--plugin");
  const spec = at >= 0 ? process.argv[at + 1] : undefined;
  if (!spec) {
    console.error("openclaw-host: --install-only needs --plugin SPEC");
    process.exit(2);
  }
  try {
    const loaded = await loadPlugin(spec, join(HOST_ROOT, ".plugins"));
    process.stdout.write(`installed ${String(loaded.packageJson["name"])}@${String(loaded.packageJson["version"])} at ${loaded.root}\n`);
    process.exit(0);
  } catch (e) {
    console.error(`openclaw-host: ${e instanceof Error ? e.message : String(e)}`);
    process.exit(2);
  }
}

await serveMain((args, rest) => start(args.stateDir, rest), {
  program: "openclaw-host",
  extra: {
    plugin: { type: "string" },
    "plugin-config": { type: "string" },
    "subagent-tool": { type: "string", multiple: true },
  },
  onShutdown: async () => {
    await engine?.stop();
  },
});
