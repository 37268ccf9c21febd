// openclaw/plugin-sdk as the ctxgate OpenClaw host provides it. OpenClaw
// 2026.9.6 exports no bare `openclaw/plugin-sdk` (only its subpaths); the
// host keeps it for plugins of the 2026.5-2026.7 era that import it.
export * from "./core.js";
