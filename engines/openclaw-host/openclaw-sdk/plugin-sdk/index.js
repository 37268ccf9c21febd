// openclaw/plugin-sdk as the ctxgate OpenClaw host provides it.
export * from "./core.js";
