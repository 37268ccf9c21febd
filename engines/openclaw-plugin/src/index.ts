// The ctxgate plugin for OpenClaw: registers the context engine "ctxgate",
// whose calls a ctxgate gateway answers (engine.ts). Install it into
// OpenClaw by path (plugins.load.paths) or from its packed tarball, select
// it (plugins.slots.contextEngine: "ctxgate") and point it at a gateway
// (plugins.entries.ctxgate.config.endpoint); docs/openclaw.md.
import { readFileSync } from "node:fs";
import { parseConfig } from "./config.js";
import { CtxgateEngine, ENGINE_ID, type Logger } from "./engine.js";
import { type Gateway, connect } from "./gateway.js";

interface PluginApi {
  pluginConfig?: unknown;
  logger?: Partial<Logger>;
  registerContextEngine(id: string, factory: (ctx?: unknown) => unknown): void;
}

/** One connection per process, made at the first engine: OpenClaw makes an engine a turn. */
let shared: Gateway | undefined;

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
    api.registerContextEngine(ENGINE_ID, () => new CtxgateEngine((shared ??= connect(config)), config, log));
  },
};
