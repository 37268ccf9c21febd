// openclaw/plugin-sdk/plugin-entry as the ctxgate OpenClaw host provides it.
export {
  WorkerProviderError,
  buildJsonPluginConfigSchema,
  buildPluginConfigSchema,
  definePluginEntry,
  emptyPluginConfigSchema,
} from "./internal/config-schema.js";
