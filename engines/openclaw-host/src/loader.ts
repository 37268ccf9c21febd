// Finds and imports an OpenClaw plugin: a local path (a package folder, a
// packed .tgz is installed first) or an npm spec. A package the host's own
// lock pins (package-lock.json) is imported from there; any other spec is
// installed with npm into .plugins/ (cached by spec, under a lock).
import { execFileSync } from "node:child_process";
import { createHash } from "node:crypto";
import { existsSync, mkdirSync, readFileSync, statSync, writeFileSync } from "node:fs";
import { createRequire } from "node:module";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";

export const HOST_ROOT = join(dirname(fileURLToPath(import.meta.url)), "..", "..");

export interface LoadedPlugin {
  /** The package's folder. */
  root: string;
  /** The module imported (OpenClaw's `openclaw.extensions` entry, else `main`). */
  entry: string;
  packageJson: Record<string, unknown>;
  manifest: Record<string, unknown> | undefined;
  /** The module's plugin definition: `{ id, register(api) }` or a function. */
  definition: { id?: string; name?: string; register?: (api: unknown) => unknown; activate?: (api: unknown) => unknown } | ((api: unknown) => unknown);
}

export class PluginLoadError extends Error {}

/** `@scope/name@1.2.3` → (`@scope/name`, `1.2.3`). */
function splitSpec(spec: string): { name: string; version?: string } {
  const at = spec.lastIndexOf("@");
  if (at > 0) return { name: spec.slice(0, at), version: spec.slice(at + 1) };
  return { name: spec };
}

function readJson(path: string): Record<string, unknown> | undefined {
  try {
    return JSON.parse(readFileSync(path, "utf8")) as Record<string, unknown>;
  } catch {
    return undefined;
  }
}

/** The installed folder of package `name` resolved from `from`, if any. */
function installed(name: string, from: string): string | undefined {
  try {
    const req = createRequire(join(from, "noop.js"));
    return dirname(req.resolve(`${name}/package.json`));
  } catch {
    const guess = join(from, "node_modules", name);
    return existsSync(join(guess, "package.json")) ? guess : undefined;
  }
}

function npmInstall(spec: string, cacheDir: string): string {
  const dir = join(cacheDir, createHash("sha256").update(spec).digest("hex").slice(0, 16));
  const done = join(dir, ".installed");
  if (!existsSync(done)) {
    mkdirSync(dir, { recursive: true });
    writeFileSync(join(dir, "package.json"), JSON.stringify({ name: "ctxgate-openclaw-plugin", private: true }));
    try {
      execFileSync("npm", ["install", "--no-audit", "--no-fund", "--loglevel=error", "--omit=dev", "--omit=peer", spec], { cwd: dir, stdio: ["ignore", "inherit", "inherit"] });
    } catch {
      throw new PluginLoadError(`npm could not install the plugin ${spec}`);
    }
    writeFileSync(done, spec);
  }
  const deps = (readJson(join(dir, "package.json"))?.["dependencies"] ?? {}) as Record<string, string>;
  const name = Object.keys(deps)[0];
  if (!name) throw new PluginLoadError(`npm installed nothing for ${spec}`);
  return join(dir, "node_modules", name);
}

/** Where the plugin `spec` lives, installing it when it must. */
export function locate(spec: string, cacheDir: string): string {
  const local = resolve(spec);
  if (existsSync(local) && statSync(local).isDirectory()) return local;
  if (existsSync(local) && /\.(tgz|tar\.gz)$/.test(local)) return npmInstall(local, cacheDir);
  const { name, version } = splitSpec(spec);
  const pinned = installed(name, HOST_ROOT);
  if (pinned) {
    const have = String(readJson(join(pinned, "package.json"))?.["version"] ?? "");
    if (!version || version === have) return pinned;
  }
  return npmInstall(spec, cacheDir);
}

export async function loadPlugin(spec: string, cacheDir: string): Promise<LoadedPlugin> {
  const root = locate(spec, cacheDir);
  const packageJson = readJson(join(root, "package.json")) ?? {};
  const manifest = readJson(join(root, "openclaw.plugin.json"));
  const openclaw = packageJson["openclaw"] as { extensions?: string[] } | undefined;
  const relativeEntry = openclaw?.extensions?.[0] ?? (packageJson["main"] as string | undefined) ?? "index.js";
  const entry = resolve(root, relativeEntry);
  if (!existsSync(entry)) throw new PluginLoadError(`the plugin ${spec} has no entry module ${relativeEntry}`);
  let mod: Record<string, unknown>;
  try {
    mod = (await import(pathToFileURL(entry).href)) as Record<string, unknown>;
  } catch (e) {
    throw new PluginLoadError(`the plugin ${spec} failed to load: ${e instanceof Error ? e.message : String(e)}`);
  }
  const def = (mod["default"] ?? mod) as LoadedPlugin["definition"];
  const register = typeof def === "function" ? def : (def?.register ?? def?.activate);
  if (typeof register !== "function") throw new PluginLoadError(`the plugin ${spec} exports no register(api) (nor a function)`);
  return { root, entry, packageJson, manifest, definition: def };
}
