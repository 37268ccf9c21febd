// The plugin's config (OpenClaw's plugins.entries.ctxgate.config), checked
// once at registration: a bad value fails the plugin's start with one
// sentence naming the key, never a turn.

export type OnGatewayDown = "fallback" | "strict";

export interface PluginConfig {
  /** host:port of the gateway's client listener. */
  target: string;
  tls: boolean;
  /** PEM of the CA that signed the gateway's certificate (TLS only). */
  ca?: Buffer;
  token?: string;
  agentId?: string;
  onGatewayDown: OnGatewayDown;
  timeouts: { connectMs: number; assembleMs: number; commitMs: number; compactMs: number; toolMs: number };
}

/** What each call waits at most for the gateway, by default (a tool: beyond the gateway's own 120 s limit of CallTool). */
export const DEFAULT_TIMEOUTS = { connectMs: 5_000, assembleMs: 30_000, commitMs: 30_000, compactMs: 300_000, toolMs: 150_000 };

const KEYS = new Set(["endpoint", "token", "tokenEnv", "caFile", "agentId", "onGatewayDown", "timeouts"]);

export class ConfigError extends Error {
  constructor(key: string, what: string) {
    super(`ctxgate plugin config: ${key} ${what}`);
    this.name = "ConfigError";
  }
}

function text(raw: Record<string, unknown>, key: string): string | undefined {
  const v = raw[key];
  if (v === undefined) return undefined;
  if (typeof v !== "string" || v.trim() === "") throw new ConfigError(key, "must be a non-blank string");
  return v.trim();
}

/** The config from OpenClaw's `pluginConfig`; `env` and `read` are the process's by default. */
export function parseConfig(
  raw: unknown,
  env: NodeJS.ProcessEnv,
  read: (path: string) => Buffer,
): PluginConfig {
  if (raw === null || typeof raw !== "object" || Array.isArray(raw)) {
    throw new ConfigError("(the plugin's config)", "must be an object with at least `endpoint`");
  }
  const r = raw as Record<string, unknown>;
  for (const k of Object.keys(r)) if (!KEYS.has(k)) throw new ConfigError(k, "is not a setting of this plugin");
  const endpoint = text(r, "endpoint");
  if (!endpoint) throw new ConfigError("endpoint", "is required (the gateway's client listener, host:port)");
  const m = /^(?:(https?):\/\/)?([^/\s]+?)\/?$/.exec(endpoint);
  if (!m || !/:\d+$/.test(m[2]!)) throw new ConfigError("endpoint", `must be host:port or http(s)://host:port, not ${JSON.stringify(endpoint)}`);
  const tls = m[1] === "https";
  const tokenEnv = text(r, "tokenEnv");
  let token = text(r, "token");
  if (tokenEnv) {
    if (token) throw new ConfigError("tokenEnv", "and token are exclusive");
    token = env[tokenEnv]?.trim() || undefined;
    if (!token) throw new ConfigError("tokenEnv", `names ${tokenEnv}, which is not set`);
  }
  const caFile = text(r, "caFile");
  if (caFile && !tls) throw new ConfigError("caFile", "needs an https:// endpoint");
  let ca: Buffer | undefined;
  if (caFile) {
    try {
      ca = read(caFile);
    } catch (e) {
      throw new ConfigError("caFile", `cannot be read: ${(e as Error).message}`);
    }
  }
  const mode = r["onGatewayDown"] ?? "fallback";
  if (mode !== "fallback" && mode !== "strict") throw new ConfigError("onGatewayDown", 'must be "fallback" or "strict"');
  const timeouts = { ...DEFAULT_TIMEOUTS };
  const t = r["timeouts"];
  if (t !== undefined) {
    if (t === null || typeof t !== "object" || Array.isArray(t)) throw new ConfigError("timeouts", "must be an object");
    for (const [k, v] of Object.entries(t)) {
      if (!(k in timeouts)) throw new ConfigError(`timeouts.${k}`, "is not a timeout of this plugin");
      if (typeof v !== "number" || !Number.isFinite(v) || v < 1 || v > 3_600_000) {
        throw new ConfigError(`timeouts.${k}`, "must be milliseconds between 1 and 3600000");
      }
      timeouts[k as keyof typeof timeouts] = Math.round(v);
    }
  }
  const agentId = text(r, "agentId");
  return {
    target: m[2]!,
    tls,
    ...(ca ? { ca } : {}),
    ...(token ? { token } : {}),
    ...(agentId ? { agentId } : {}),
    onGatewayDown: mode,
    timeouts,
  };
}
