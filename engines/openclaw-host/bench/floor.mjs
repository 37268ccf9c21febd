// The floor of an Assemble under the host: the plugin called in-process,
// as OpenClaw calls it, on the same sessions as assemble.mjs (its history
// ingested with the plugin's ingestBatch; then, timed, what OpenClaw runs
// of the plugin to build a turn's context — its before_prompt_build hooks
// and assemble, given the history before the turn in OpenClaw's form
// (converted once, outside the timing) and the budget the hooks' system
// context leaves, as the host gives it).
//   node bench/floor.mjs --plugin SPEC --plugin-config FILE --state-dir DIR --sizes 1000,10000 --budget 8000 [--calls N]
// Prints one JSON row a size on stdout.
import { toOpenClaw } from "@ctxgate/engine-sdk/openclaw";
import { messagesTokens, textTokens } from "@ctxgate/engine-sdk";
import { hooksOf } from "../dist/src/api.js";
import { startHost } from "../dist/src/host.js";
import { history, nextTurn, timed } from "./history.mjs";

const args = process.argv.slice(2);
const opt = (name) => {
  const i = args.indexOf(name);
  return i >= 0 ? args[i + 1] : undefined;
};
const sizes = (opt("--sizes") ?? "1000,10000").split(",").map(Number);
const budget = Number(opt("--budget") ?? "8000");
// Logs go to stderr, rows to stdout.
console.info = console.log = (...a) => process.stderr.write(a.join(" ") + "\n");
const { plugin, registry } = await startHost(opt("--state-dir"), { plugin: opt("--plugin"), "plugin-config": opt("--plugin-config") });
for (const n of sizes) {
  const sessionId = `floor-${n}`;
  const openclaw = (list) => list.flatMap((m) => toOpenClaw(m, m.createdAtUnixMs));
  const h = history(n);
  for (let i = 0; i < n; i += 1000) {
    const messages = openclaw(h.slice(i, i + 1000));
    if (typeof plugin.ingestBatch === "function") await plugin.ingestBatch({ sessionId, sessionKey: sessionId, messages });
    else for (const message of messages) await plugin.ingest({ sessionId, sessionKey: sessionId, message });
  }
  const next = nextTurn(n);
  const messages = openclaw(h);
  const session = { sessionId, sessionKey: sessionId };
  const turn = async () => {
    const built = [];
    for (const hook of hooksOf(registry, "before_prompt_build")) built.push(await hook({ prompt: "", messages }, session));
    const system = built.flatMap((b) => [b?.prependSystemContext, b?.appendSystemContext]).filter(Boolean);
    const tokenBudget = Math.max(1, budget - textTokens(system.join("\n\n")) - messagesTokens([next]));
    return plugin.assemble({ ...session, messages, tokenBudget, availableTools: new Set() });
  };
  const calls = opt("--calls");
  const r = await timed(calls ? Number(calls) : n >= 10_000 ? 60 : 300, turn);
  const kept = Array.isArray(r.out?.messages) ? r.out.messages.length + 1 : 0;
  process.stdout.write(JSON.stringify({ n, rounds: r.rounds, p50: r.p50, p99: r.p99, kept, tokens: r.out?.estimatedTokens }) + "\n");
}
process.exit(0);
