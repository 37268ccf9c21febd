// openclaw/plugin-sdk/logging-core as the ctxgate OpenClaw host provides
// it: redactSensitiveText, which plugins run over what they log or store.
// The patterns are the common part of OpenClaw's defaults (vendor tokens,
// bearer and basic credentials, key=value secrets, URL passwords, PEM
// blocks), masked as OpenClaw masks them (`abcdef…wxyz`, `***` when short).

const MIN_LENGTH = 18;
const KEEP_START = 6;

const SECRET_KEYS =
  String.raw`(?:api[-_]?key|apikey|api[-_]?token|access[-_]?token|refresh[-_]?token|auth[-_]?token|` +
  String.raw`client[-_]?secret|secret|password|passwd|token|private[-_]?key)`;

const DEFAULT_PATTERNS = [
  String.raw`\b(sk-[A-Za-z0-9_-]{8,})\b`,
  String.raw`(ghp_[A-Za-z0-9]{10,})`,
  String.raw`(github_pat_[A-Za-z0-9_]{10,})`,
  String.raw`(gh[ousr]_[A-Za-z0-9]{10,})`,
  String.raw`(glpat-[A-Za-z0-9._=\-]{20,})`,
  String.raw`(xox[baprs]-[A-Za-z0-9-]{10,})`,
  String.raw`(xapp-[A-Za-z0-9-]{10,})`,
  String.raw`(gsk_[A-Za-z0-9_-]{10,})`,
  String.raw`(AIza[0-9A-Za-z\-_]{20,})`,
  String.raw`(ya29\.[0-9A-Za-z_\-./+=]{10,})`,
  String.raw`(eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,})`,
  String.raw`(sk_(?:live|test)_[A-Za-z0-9]{10,})`,
  String.raw`(npm_[A-Za-z0-9]{10,})`,
  String.raw`(pypi-[A-Za-z0-9_-]{10,})`,
  String.raw`(hf_[A-Za-z0-9]{10,})`,
  String.raw`(xai-[A-Za-z0-9]{30,})`,
  String.raw`\b(A[KS]IA[A-Z0-9]{16})\b`,
  String.raw`\bBearer\s+([A-Za-z0-9._~+/=-]{8,})`,
  /\bAuthorization:\s*Basic\s+([A-Za-z0-9+/=]{8,})/gi,
  String.raw`\b(?:https?|wss?|ftp):\/\/[^\/\s:@]*:([^\/\s@]+)@`,
  String.raw`\b(?:postgres(?:ql)?|mysql|mongodb(?:\+srv)?|rediss?|amqps?):\/\/[^:\s/@]*:([^@\s]+)@`,
  new RegExp(String.raw`(?:^|[\s,;{(])["']?[A-Za-z0-9_.-]*${SECRET_KEYS}["']?\s*[:=]\s*["']?([^\s"',;})]{4,})`, "gi"),
  new RegExp(String.raw`--${SECRET_KEYS}(?:=|\s+)["']?([^\s"']+)`, "gi"),
];

const PEM = /-----BEGIN ([A-Z0-9 ]*PRIVATE KEY)-----[\s\S]*?-----END \1-----/g;

function compile(raw) {
  if (raw instanceof RegExp) return raw.flags.includes("g") ? raw : new RegExp(raw.source, `${raw.flags}g`);
  if (typeof raw !== "string" || !raw.trim()) return undefined;
  const m = /^\/(.+)\/([dgimsuvy]*)$/s.exec(raw);
  try {
    return m ? new RegExp(m[1], m[2].includes("g") ? m[2] : `${m[2]}g`) : new RegExp(raw, "g");
  } catch {
    return undefined;
  }
}

let defaults;

function maskToken(token) {
  if (token === "***") return token;
  if (token.length < MIN_LENGTH) return "***";
  return `${token.slice(0, KEEP_START)}…${token.slice(-4)}`;
}

function redactWith(text, patterns) {
  let out = text.replace(PEM, (_match, label) => `-----BEGIN ${label}-----\n***\n-----END ${label}-----`);
  for (const re of patterns) {
    out = out.replace(re, (match, ...rest) => {
      const groups = rest.slice(0, -2).filter((g) => typeof g === "string" && g.length > 0);
      const secret = groups.at(-1);
      if (!secret) return maskToken(match);
      const at = match.lastIndexOf(secret);
      return `${match.slice(0, at)}${maskToken(secret)}${match.slice(at + secret.length)}`;
    });
  }
  return out;
}

/** OpenClaw's redactSensitiveText(text, options?): `options.mode: "off"`
 * leaves the text; `options.patterns` (strings, `/re/flags` or RegExps)
 * replace the defaults. */
export function redactSensitiveText(text, options) {
  if (!text) return text;
  if (options?.mode === "off") return text;
  const custom = options?.patterns?.length ? options.patterns.map(compile).filter(Boolean) : undefined;
  defaults ??= DEFAULT_PATTERNS.map(compile).filter(Boolean);
  return redactWith(String(text), custom ?? defaults);
}

/** Tool payloads are redacted with the same patterns here. */
export function redactToolPayloadText(text) {
  return redactSensitiveText(text);
}

/** A value of a field known to be sensitive: masked whole. */
export function redactSensitiveFieldValue(value) {
  return typeof value === "string" && value ? maskToken(value) : value;
}

/** OpenClaw's subsystem logger, writing to stderr as the host logs. */
export function createSubsystemLogger(subsystem) {
  const line = (level, message) =>
    process.stderr.write(
      `${new Date().toISOString()} ${level} [${subsystem}] ${redactSensitiveText(String(message))}\n`,
    );
  const logger = {
    subsystem,
    debug: (m) => (process.env.OPENCLAW_HOST_DEBUG ? line("DEBUG", m) : undefined),
    info: (m) => line("INFO", m),
    warn: (m) => line("WARN", m),
    error: (m) => line("ERROR", m),
    child: (name) => createSubsystemLogger(`${subsystem}/${name}`),
  };
  return logger;
}

export function getChildLogger(bindings) {
  return createSubsystemLogger(typeof bindings?.module === "string" ? bindings.module : "plugin");
}
