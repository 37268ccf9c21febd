// OpenClaw's plugin config schema helpers (src/plugins/config-schema.ts)
// and definePluginEntry (src/plugin-sdk/plugin-entry.ts), shared by the
// host's `core` and `plugin-entry` modules. The host validates no schema:
// the helpers only build what OpenClaw's would.

function error(message) {
  return { success: false, error: { issues: [{ path: [], message }] } };
}

/** A schema for plugins that intentionally accept no config keys. */
export function emptyPluginConfigSchema() {
  return {
    safeParse(value) {
      if (value === undefined) return { success: true, data: undefined };
      if (!value || typeof value !== "object" || Array.isArray(value)) return error("expected config object");
      if (Object.keys(value).length > 0) return error("config must be empty");
      return { success: true, data: value };
    },
    jsonSchema: { type: "object", additionalProperties: false, properties: {} },
  };
}

function normalizeJsonSchema(schema) {
  if (Array.isArray(schema)) return schema.map((item) => normalizeJsonSchema(item));
  if (!schema || typeof schema !== "object") return schema;
  const record = { ...schema };
  delete record.$schema;
  for (const [key, value] of Object.entries(record)) record[key] = normalizeJsonSchema(value);
  const names = record.propertyNames;
  if (names && typeof names === "object" && !Array.isArray(names) && names.type === "string")
    delete record.propertyNames;
  if (Array.isArray(record.required) && record.required.length === 0) delete record.required;
  return record;
}

/** A plugin config schema from JSON Schema (values pass unvalidated here). */
export function buildJsonPluginConfigSchema(schema, options) {
  return {
    safeParse: options?.safeParse ?? ((value) => ({ success: true, data: value })),
    ...(options?.uiHints ? { uiHints: options.uiHints } : {}),
    jsonSchema: normalizeJsonSchema(schema),
  };
}

/** A plugin config schema from a Zod-like schema (its own safeParse). */
export function buildPluginConfigSchema(schema, options) {
  const safeParse =
    options?.safeParse ??
    ((value) => {
      const result = schema.safeParse(value);
      if (result.success) return { success: true, data: result.data };
      const issues = (result.error?.issues ?? []).map((issue) => ({
        path: (issue.path ?? []).filter((s) => typeof s === "string" || typeof s === "number"),
        message: issue.message,
      }));
      return { success: false, error: { issues } };
    });
  return {
    safeParse,
    ...(options?.uiHints ? { uiHints: options.uiHints } : {}),
    jsonSchema: { type: "object", additionalProperties: true },
  };
}

function lazy(value) {
  let resolved = false;
  let cached;
  return () => {
    if (!resolved) {
      cached = typeof value === "function" ? value() : value;
      resolved = true;
    }
    return cached;
  };
}

/** The canonical entry helper for non-channel plugins. */
export function definePluginEntry({
  id,
  name,
  description,
  kind,
  configSchema = emptyPluginConfigSchema,
  reload,
  nodeHostCommands,
  securityAuditCollectors,
  register,
}) {
  const getConfigSchema = lazy(configSchema);
  return {
    id,
    name,
    description,
    ...(kind ? { kind } : {}),
    ...(reload ? { reload } : {}),
    ...(nodeHostCommands ? { nodeHostCommands } : {}),
    ...(securityAuditCollectors ? { securityAuditCollectors } : {}),
    get configSchema() {
      return getConfigSchema();
    },
    register,
  };
}

/** A permanent worker-provider rejection (plugin-entry exports it). */
export class WorkerProviderError extends Error {
  constructor(message) {
    super(message);
    this.code = "invalid_profile";
    this.name = "WorkerProviderError";
  }
}
