// Finds and imports an OpenClaw plugin: a local path (a package folder, a
// packed .tgz is installed first) or an npm spec. A package the host's own
// lock pins (package-lock.json, under its own name or an alias such as
// `lossless-claw-1`) is imported from there; any other spec is installed
// with npm into .plugins/ (cached by spec, under a lock). The entry is the
// one OpenClaw 2026.9.6 picks (`openclaw.runtimeExtensions`, else a built
// `dist/` output of a TypeScript `openclaw.extensions` entry, else the
// entry), and TypeScript is loaded with jiti as OpenClaw loads it, with
// `openclaw/plugin-sdk/*` aliased to the host's SDK.
import { execFileSync } from "node:child_process";
import { createHash } from "node:crypto";
import { existsSync, mkdirSync, readFileSync, statSync, writeFileSync } from "node:fs";
import module, { createRequire } from "node:module";
import { dirname, extname, join, resolve } from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";
import { createJiti } from "jiti";

export const HOST_ROOT = join(dirname(fileURLToPath(import.meta.url)), "..", "..");

/** The host's `openclaw/plugin-sdk` (its openclaw-sdk/ folder). */
export const SDK_ROOT = join(HOST_ROOT, "openclaw-sdk");

export type RegisterFn = (api: unknown) => unknown;

/** openclaw.plugin.json, as far as the host reads it. */
export interface PluginManifest {
  id?: string;
  name?: string;
  contracts?: { tools?: string[] };
  [key: string]: unknown;
}

export interface LoadedPlugin {
  /** The package's folder. */
  root: string;
  /** The module imported (see entryOf). */
  entry: string;
  packageJson: Record<string, unknown>;
  manifest: PluginManifest | undefined;
  /** The module's plugin definition: `{ id, register(api) }` or a function. */
  definition: { id?: string; name?: string; register?: RegisterFn } | RegisterFn;
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
      execFileSync(
        "npm",
        ["install", "--no-audit", "--no-fund", "--loglevel=error", "--omit=dev", "--omit=peer", spec],
        { cwd: dir, stdio: ["ignore", "inherit", "inherit"] },
      );
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

/** A package the host's lock pins, under its own name or an alias
 * (`"lossless-claw-1": "file:vendor/…-1.0.0-beta.4.tgz"`), of `version` if given. */
function pinnedPackage(name: string, version: string | undefined): string | undefined {
  const deps = (readJson(join(HOST_ROOT, "package.json"))?.["dependencies"] ?? {}) as Record<string, string>;
  for (const alias of [name, ...Object.keys(deps).filter((d) => d !== name)]) {
    const dir = installed(alias, HOST_ROOT);
    if (!dir) continue;
    const pkg = readJson(join(dir, "package.json"));
    if (alias !== name && pkg?.["name"] !== name) continue;
    if (!version || version === String(pkg?.["version"] ?? "")) return dir;
  }
  return undefined;
}

/** Where the plugin `spec` lives, installing it when it must. */
export function locate(spec: string, cacheDir: string): string {
  const local = resolve(spec);
  if (existsSync(local) && statSync(local).isDirectory()) return local;
  if (existsSync(local) && /\.(tgz|tar\.gz)$/.test(local)) return npmInstall(local, cacheDir);
  const { name, version } = splitSpec(spec);
  return pinnedPackage(name, version) ?? npmInstall(spec, cacheDir);
}

const TS_EXTENSIONS = [".ts", ".tsx", ".mts", ".cts", ".mtsx", ".ctsx"];

function isTypeScript(path: string): boolean {
  return TS_EXTENSIONS.includes(extname(path).toLowerCase());
}

/** OpenClaw's listBuiltRuntimeEntryCandidates: where a TypeScript entry's build output may be. */
export function builtEntryCandidates(entry: string): string[] {
  if (!isTypeScript(entry)) return [];
  const normalized = entry.replace(/\\/g, "/");
  const withoutExtension = normalized.replace(/\.[^.]+$/u, "");
  const relative = withoutExtension.replace(/^\.\//u, "");
  const dist = relative.startsWith("src/") ? `./dist/${relative.slice(4)}` : `./dist/${relative}`;
  const ext = extname(normalized).toLowerCase();
  const outputs =
    ext === ".mts" ? [".mjs", ".js", ".cjs"] : ext === ".cts" ? [".cjs", ".js", ".mjs"] : [".js", ".mjs", ".cjs"];
  const bases = [dist, ...(relative.startsWith("src/") ? [`./dist/${relative}`] : []), withoutExtension];
  return bases.flatMap((base) => outputs.map((o) => `${base}${o}`));
}

/** The entry OpenClaw loads: `openclaw.runtimeExtensions[0]` (the same
 * length as `extensions`), else for a TypeScript `extensions[0]` its built
 * output when there is one, else `extensions[0]`; `main`, `index.js` for a
 * package that names none. */
export function entryOf(root: string, packageJson: Record<string, unknown>, spec: string): string {
  const oc = (packageJson["openclaw"] ?? {}) as { extensions?: unknown; runtimeExtensions?: unknown };
  const list = (v: unknown) =>
    Array.isArray(v) ? v.filter((x): x is string => typeof x === "string" && !!x.trim()) : [];
  const extensions = list(oc.extensions);
  const runtime = list(oc.runtimeExtensions);
  if (runtime.length > 0 && runtime.length !== extensions.length) {
    throw new PluginLoadError(
      `the plugin ${spec} has ${runtime.length} openclaw.runtimeExtensions ` +
        `for ${extensions.length} openclaw.extensions`,
    );
  }
  if (runtime[0]) return resolve(root, runtime[0]);
  const declared = extensions[0] ?? (packageJson["main"] as string | undefined) ?? "index.js";
  for (const candidate of builtEntryCandidates(declared)) {
    if (existsSync(resolve(root, candidate))) return resolve(root, candidate);
  }
  return resolve(root, declared);
}

const SDK_SPECIFIER = /^(?:@openclaw|openclaw)\/plugin-sdk(?:\/(.+))?$/;

/** The host SDK module for `openclaw/plugin-sdk[/sub]`, if it has it. */
export function sdkModule(specifier: string): string | undefined {
  const m = SDK_SPECIFIER.exec(specifier);
  if (!m) return undefined;
  const file = join(SDK_ROOT, "plugin-sdk", `${m[1] ?? "index"}.js`);
  return existsSync(file) ? file : undefined;
}

type ResolveHook = (
  specifier: string,
  context: unknown,
  next: (specifier: string, context: unknown) => unknown,
) => unknown;

let aliased = false;

/** `openclaw/plugin-sdk/*` → the host's SDK for every import and require,
 * whatever `openclaw` the plugin's own node_modules holds (OpenClaw aliases
 * it the same way). Needs module.registerHooks (Node ≥ 22.15); without it,
 * plugins resolve the host's `openclaw` package by the usual lookup. */
export function aliasPluginSdk(): void {
  const register = (module as unknown as { registerHooks?: (hooks: { resolve: ResolveHook }) => unknown })
    .registerHooks;
  if (aliased || typeof register !== "function") return;
  aliased = true;
  register({
    resolve(specifier, context, next) {
      const file = sdkModule(specifier);
      return file ? { url: pathToFileURL(file).href, shortCircuit: true } : next(specifier, context);
    },
  });
}

/** OpenClaw's jiti for TypeScript entries (plugin-module-loader-cache.ts). */
async function importTypeScript(entry: string): Promise<Record<string, unknown>> {
  const alias: Record<string, string> = {};
  for (const prefix of ["openclaw/plugin-sdk", "@openclaw/plugin-sdk"]) alias[prefix] = join(SDK_ROOT, "plugin-sdk");
  const jiti = createJiti(entry, {
    interopDefault: true,
    // fsCache: jiti's default (node_modules/.cache/jiti or the temp dir; JITI_FS_CACHE overrides).
    nativeModules: ["openclaw", ...(process.env["JITI_NATIVE_MODULES"] ?? "").split(",").filter(Boolean)],
    extensions: [...TS_EXTENSIONS, ".js", ".mjs", ".cjs", ".json"],
    alias,
    tryNative: false,
  });
  return (await jiti.import(entry)) as Record<string, unknown>;
}

/** OpenClaw's resolvePluginModuleExport: a function or a `register`,
 * following `default` chains (`activate` is not accepted). */
function definitionOf(mod: unknown): LoadedPlugin["definition"] | undefined {
  let v: unknown = mod;
  for (let depth = 0; depth < 4 && v; depth++) {
    if (typeof v === "function") return v as RegisterFn;
    const o = v as { register?: unknown; default?: unknown; module?: unknown };
    if (typeof o.register === "function") return o as LoadedPlugin["definition"];
    v = o.default ?? o.module;
  }
  return undefined;
}

export async function loadPlugin(spec: string, cacheDir: string): Promise<LoadedPlugin> {
  aliasPluginSdk();
  const root = locate(spec, cacheDir);
  const packageJson = readJson(join(root, "package.json")) ?? {};
  const manifest = readJson(join(root, "openclaw.plugin.json")) as PluginManifest | undefined;
  const entry = entryOf(root, packageJson, spec);
  if (!existsSync(entry)) throw new PluginLoadError(`the plugin ${spec} has no entry module ${entry}`);
  let mod: unknown;
  try {
    mod = isTypeScript(entry) ? await importTypeScript(entry) : await import(pathToFileURL(entry).href);
  } catch (e) {
    throw new PluginLoadError(`the plugin ${spec} failed to load: ${e instanceof Error ? e.message : String(e)}`);
  }
  const definition = definitionOf(mod);
  if (!definition) throw new PluginLoadError(`the plugin ${spec} exports no register(api) (nor a function)`);
  return { root, entry, packageJson, manifest, definition };
}
