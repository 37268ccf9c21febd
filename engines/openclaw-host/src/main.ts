#!/usr/bin/env node
// The OpenClaw plugin host:
//   run.sh --plugin SPEC --listen ADDR --state-dir DIR [--plugin-config FILE]
//          [--openclaw-version V] [--agent-dir DIR] [--workspace-dir DIR]
//          [--subagent-tool NAME]... [--optional-tool NAME]...
//          [every engine flag of the SDK]
// serves the context engine of an unmodified OpenClaw plugin (host.ts) as
// a ctxgate engine.
import { join } from "node:path";
import { serveMain } from "@ctxgate/engine-sdk";
import type { OpenClawEngine } from "./engine.js";
import { type HostFlags, startHost } from "./host.js";
import { HOST_ROOT, loadPlugin } from "./loader.js";

let engine: OpenClawEngine | undefined;

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
    process.stdout.write(
      `installed ${String(loaded.packageJson["name"])}@${String(loaded.packageJson["version"])} at ${loaded.root}\n`,
    );
    process.exit(0);
  } catch (e) {
    console.error(`openclaw-host: ${e instanceof Error ? e.message : String(e)}`);
    process.exit(2);
  }
}

await serveMain(
  async (args, rest) => {
    // The flags below, as parseArgs typed them.
    engine = (await startHost(args.stateDir, rest as HostFlags)).engine;
    return engine;
  },
  {
    program: "openclaw-host",
    extra: {
      plugin: { type: "string" },
      "plugin-config": { type: "string" },
      "openclaw-version": { type: "string" },
      "agent-dir": { type: "string" },
      "workspace-dir": { type: "string" },
      "subagent-tool": { type: "string", multiple: true },
      "optional-tool": { type: "string", multiple: true },
    },
    onShutdown: async () => {
      await engine?.stop();
    },
  },
);
