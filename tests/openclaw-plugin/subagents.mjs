// The plugin's subagent calls against the live gateway of run.sh (the
// plugin's engine made as OpenClaw makes it, and called as OpenClaw calls
// prepareSubagentSpawn / onSubagentEnded / the spawn's rollback): a forked
// child exists at the gateway with the parent's history, the engine
// prepared it, and each end — OpenClaw's, and a failed spawn's rollback —
// reaches the gateway once.
//   node subagents.mjs GATEWAY PARENT_SESSION_KEY
// Prints one line; exits 1 with what differs.
import { parseConfig } from "../../engines/openclaw-plugin/dist/src/config.js";
import { CtxgateEngine } from "../../engines/openclaw-plugin/dist/src/engine.js";
import { connect, orNone, unary } from "../../engines/openclaw-plugin/dist/src/gateway.js";
import { KnownSessions } from "../../engines/openclaw-plugin/dist/src/history.js";
import { EngineTools } from "../../engines/openclaw-plugin/dist/src/tools.js";

const [gatewayAddr, parentKey] = process.argv.slice(2);
const fail = (why) => {
  console.error(`subagents: ${why}`);
  process.exit(1);
};
const warnings = [];
const log = { info: () => {}, warn: (m) => warnings.push(m) };
const config = parseConfig({ endpoint: gatewayAddr }, {}, () => Buffer.alloc(0));
const gateway = connect(config);
const engine = new CtxgateEngine(gateway, config, log, new Map(), new EngineTools(() => ({ tools: [] }), log.warn), new KnownSessions());
const ref = (sessionKey) => ({ agentId: "main", sessionKey });
const session = (key) => unary(gateway, "GetSession", ref(key), 10_000);
// Whether `key` is a subagent still: an ended child's session may be gone (NOT_FOUND) or no longer a subagent.
const endAgain = async (key) => (await orNone(unary(gateway, "EndSubagent", { child: ref(key), reason: "released" }, 10_000)))?.ended === true;

const parent = await session(parentKey);
const child = `${parentKey}:subagent:${process.pid}-1`;
const spawned = await engine.prepareSubagentSpawn({ parentSessionKey: parentKey, childSessionKey: child, contextMode: "fork", ttlMs: 600_000 });
if (typeof spawned?.rollback !== "function") fail(`prepareSubagentSpawn answered ${JSON.stringify(spawned)}, not a rollback: ${warnings.join("; ")}`);
const forked = await session(child);
if (!(forked.entries > 0)) fail(`the forked child holds ${forked.entries} entries (the parent ${parent.entries})`);
await engine.onSubagentEnded({ childSessionKey: child, reason: "completed" });
if (await endAgain(child)) fail("the child was still a subagent after onSubagentEnded");

const failed = `${parentKey}:subagent:${process.pid}-2`;
const again = await engine.prepareSubagentSpawn({ parentSessionKey: parentKey, childSessionKey: failed });
await again.rollback();
if (await endAgain(failed)) fail("the child was still a subagent after the spawn's rollback");
if (warnings.length > 0) fail(`warnings: ${warnings.join("; ")}`);
gateway.close();
console.log(`subagents: a forked child of ${forked.entries} entries (the parent ${parent.entries}); ended once by onSubagentEnded, once by a rollback`);
