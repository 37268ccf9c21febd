// What tests/openclaw-plugin/run.sh checks after OpenClaw's turns: the
// gateway's copy of the session against OpenClaw's own transcript (roles in
// order; each turn's last message carries OpenClaw's entry id), and how
// often the engine holds each turn (once: the window and Python engines'
// commits tables, lossless-claw's user messages).
// Turns imported from before the plugin (the first IMPORTED) carry no
// entry id.
//   node check.mjs OPENCLAW_DB SESSION_KEY GATEWAY ENGINE ENGINE_STATE_DIR TURNS [IMPORTED]
// Prints one line; exits 1 with the difference.
import { DatabaseSync } from "node:sqlite";
import { connect } from "../../engines/openclaw-plugin/dist/src/gateway.js";
import { parseConfig } from "../../engines/openclaw-plugin/dist/src/config.js";

const [openclawDb, sessionKey, gatewayAddr, engineKind, engineDir, turnsArg, importedArg] = process.argv.slice(2);
const turns = Number(turnsArg);
const imported = Number(importedArg ?? 0);
const fail = (why) => {
  console.error(`check: ${why}`);
  process.exit(1);
};

// OpenClaw's transcript: the session's message events, in order.
const oc = new DatabaseSync(openclawDb, { readOnly: true });
const ocMessages = oc
  .prepare("SELECT event_json FROM transcript_events WHERE event_json IS NOT NULL ORDER BY session_id, seq")
  .all()
  .map((r) => JSON.parse(r.event_json))
  .filter((e) => e.type === "message" && e.message);
const ROLE = { user: "ROLE_USER", assistant: "ROLE_ASSISTANT", toolResult: "ROLE_TOOL" };
const ocRoles = ocMessages.map((e) => ROLE[e.message.role] ?? e.message.role);

// The gateway's copy, page by page.
const gw = connect(parseConfig({ endpoint: gatewayAddr }, {}, () => Buffer.alloc(0)));
const entries = [];
let pageToken = "";
do {
  const r = await new Promise((resolve, reject) =>
    gw.gateway.GetTranscript({ session: { agentId: "main", sessionKey }, pageToken }, gw.metadata(), (e, v) =>
      e ? reject(e) : resolve(v),
    ),
  );
  entries.push(...r.entries.filter((e) => e.message));
  pageToken = r.nextPageToken;
} while (pageToken);
gw.close();
const gwRoles = entries.map((e) => e.message.role);
if (JSON.stringify(gwRoles) !== JSON.stringify(ocRoles)) {
  fail(`roles differ:\n  openclaw ${ocRoles.join(" ")}\n  gateway  ${gwRoles.join(" ")}`);
}
let stamped = 0;
entries.forEach((e, i) => {
  const id = e.message.metadata?.["openclaw.entryId"];
  if (id === undefined) return;
  stamped++;
  if (id !== ocMessages[i].id) fail(`message ${i}: the gateway's carries OpenClaw id ${id}, OpenClaw's is ${ocMessages[i].id}`);
});
if (stamped !== turns - imported) fail(`${stamped} of the gateway's messages carry OpenClaw's terminal entry id, not ${turns - imported}`);
const userTexts = ocMessages.filter((e) => e.message.role === "user").length;
if (userTexts !== turns) fail(`OpenClaw holds ${userTexts} user messages, not ${turns}`);

// What the engine holds: each turn once — the durable engines' commits
// (window: one row a CommitTurn key; lossless-claw: its user messages),
// the after-turn Python engine's messages (one row a message id).
const HELD = {
  window: ["window.sqlite", "SELECT COUNT(*) AS n FROM commits", turns, "turns"],
  python: ["recency.sqlite", "SELECT COUNT(*) AS n FROM messages", entries.length, "messages"],
  lossless: ["lcm.db", "SELECT COUNT(*) AS n FROM messages WHERE role = 'user'", turns, "turns"],
};
const [file, query, want, unit] = HELD[engineKind] ?? fail(`no engine ${engineKind}`);
const engine = new DatabaseSync(`${engineDir}/${file}`, { readOnly: true });
const held = engine.prepare(query).get().n;
if (held !== want) fail(`the ${engineKind} engine holds ${held} ${unit}, not ${want}`);
console.log(
  `check: ${entries.length} messages alike in OpenClaw and the gateway (roles, order, ${stamped} terminal ids); the ${engineKind} engine holds ${held} ${unit}, once each`,
);
