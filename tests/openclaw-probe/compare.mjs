// Compares what the recording probe saw under the real OpenClaw with what
// it saw under engines/openclaw-host, and checks every difference against
// the allow-list:
//   node compare.mjs OPENCLAW.jsonl HOST.jsonl KNOWN-DIFFERENCES.md
// Each log holds the probe's records (index.js) and the run's turn marks,
// `{"mark":"turn N"}` lines written before each turn and `{"mark":"stop"}`
// before the engine is stopped; records before the first mark are the
// segment "start" (what happens when the engine starts).
//
// Prints every difference as one line:
//   calls: SEGMENT: openclaw m1 m2 … vs host m1 m2 …   (the methods called, in order)
//   METHOD: PATH: openclaw TYPES vs host TYPES          (the parameters' shapes, every call merged)
// PATH is `(argument)` for the value itself, else `a.b`, `a[]`, `a[].b`;
// TYPES as in shape.js, "absent" where the key is missing. A key set to
// `undefined` counts as absent here (the records keep the difference): a
// plugin reading `params.x` cannot tell them apart, and OpenClaw spreads
// many optional fields as `undefined`. `null` stays `null`. A subtree one
// side lacks altogether is one line (its root), not a line a key.
// Then the closing line; exit 1 when any difference is not listed in
// KNOWN-DIFFERENCES.md (a list item "- `LINE` — reason.").
import { readFileSync } from "node:fs";
import { flatten, merge } from "./shape.js";

const [ocFile, hostFile, knownFile] = process.argv.slice(2);
if (!ocFile || !hostFile || !knownFile) {
  console.error("usage: node compare.mjs OPENCLAW.jsonl HOST.jsonl KNOWN-DIFFERENCES.md");
  process.exit(2);
}

/** The calls of a log, grouped by segment, in order. */
function read(file) {
  const segments = new Map([["start", []]]);
  let current = "start";
  for (const line of readFileSync(file, "utf8").split("\n")) {
    if (!line.trim()) continue;
    const r = JSON.parse(line);
    if (r.mark) {
      current = r.mark;
      if (!segments.has(current)) segments.set(current, []);
    } else {
      segments.get(current).push(r);
    }
  }
  return segments;
}

const sides = { openclaw: read(ocFile), host: read(hostFile) };

// A run that did not reach the engine is not a difference to list.
const problems = [];
for (const [side, segments] of Object.entries(sides)) {
  const turns = [...segments.keys()].filter((s) => s.startsWith("turn "));
  if (turns.length === 0) problems.push(`${side}: no turn marks in the log`);
  for (const turn of turns) {
    const methods = segments.get(turn).map((r) => r.method);
    if (!methods.includes("assemble")) problems.push(`${side}: ${turn} made no assemble call (did the turn run on another engine?)`);
  }
}
if (problems.length > 0) {
  for (const p of problems) console.log(`the run is not comparable: ${p}`);
  console.log("differential: 0 calls compared, the run failed");
  process.exit(1);
}

const differences = [];

// The sequence of calls, segment by segment.
const segmentNames = [...new Set([...sides.openclaw.keys(), ...sides.host.keys()])];
for (const seg of segmentNames) {
  const seq = (side) => (sides[side].get(seg) ?? []).map((r) => r.method).join(" ") || "(none)";
  const [a, b] = [seq("openclaw"), seq("host")];
  if (a !== b) differences.push(`calls: ${seg}: openclaw ${a} vs host ${b}`);
}

// The shapes, method by method, every call of the run merged.
function shapes(segments) {
  const out = new Map();
  for (const calls of segments.values()) for (const r of calls) out.set(r.method, merge(out.get(r.method), r.shape));
  return out;
}
const byMethod = { openclaw: shapes(sides.openclaw), host: shapes(sides.host) };
const ORDER = ["factory", "bootstrap", "maintain", "assemble", "commitTurn", "afterTurn", "ingest", "ingestBatch", "compact", "dispose"];
const rank = (m) => (ORDER.includes(m) ? ORDER.indexOf(m) : ORDER.length);
const common = [...byMethod.openclaw.keys()].filter((m) => byMethod.host.has(m)).sort((x, y) => rank(x) - rank(y) || (x < y ? -1 : 1));

/** The parent of a path and whether the path is an element (`[]`) of it. */
function parent(path) {
  if (path === "(argument)") return undefined;
  if (path.endsWith("[]")) return { path: path.slice(0, -2) || "(argument)", element: true };
  const dot = path.lastIndexOf(".");
  return { path: dot < 0 ? "(argument)" : path.slice(0, dot), element: false };
}

/** Whether `path` is missing from `flat` only because its parent is not a
 * container there (that difference is the parent's line). */
function coveredByParent(flat, path) {
  const p = parent(path);
  if (!p) return false;
  const types = flat.get(p.path);
  if (types === undefined) return true;
  return !types.split("|").includes(p.element ? "array" : "object");
}

/** flatten(), with `undefined` read as "absent" (see above). */
function flat(shape) {
  const out = new Map();
  for (const [path, types] of flatten(shape)) {
    out.set(path, [...new Set(types.split("|").map((t) => (t === "undefined" ? "absent" : t)))].sort().join("|"));
  }
  return out;
}

for (const method of common) {
  const a = flat(byMethod.openclaw.get(method));
  const b = flat(byMethod.host.get(method));
  for (const path of [...new Set([...a.keys(), ...b.keys()])].sort()) {
    const [x, y] = [a.get(path), b.get(path)];
    if ((x ?? "absent") === (y ?? "absent")) continue;
    if (x === undefined && coveredByParent(a, path)) continue;
    if (y === undefined && coveredByParent(b, path)) continue;
    differences.push(`${method}: ${path}: openclaw ${x ?? "absent"} vs host ${y ?? "absent"}`);
  }
}

// The allow-list: "- `LINE` — reason." items.
const known = new Map();
const malformed = [];
for (const line of readFileSync(knownFile, "utf8").split("\n")) {
  if (!line.startsWith("- `")) continue;
  const m = /^- `(.+)` — (.+)$/.exec(line);
  if (!m || !m[2].trim()) malformed.push(line);
  else known.set(m[1], m[2].trim());
}

const calls = [...Object.values(sides)].reduce((n, segs) => n + [...segs.values()].reduce((k, c) => k + c.length, 0), 0);
const unlisted = differences.filter((d) => !known.has(d));
for (const d of differences) console.log(`${known.has(d) ? "  listed  " : "NOT LISTED"} ${d}`);
for (const k of known.keys()) if (!differences.includes(k)) console.log(`not seen (remove it from the list?): ${k}`);
for (const m of malformed) console.log(`malformed entry (want "- \`LINE\` — reason."): ${m}`);

const counts = `${calls} calls compared, ${differences.length} differences`;
if (unlisted.length > 0 || malformed.length > 0) {
  console.log(`differential: ${counts}, ${unlisted.length} not listed in ${knownFile}${malformed.length ? `, ${malformed.length} malformed entries` : ""}`);
  process.exit(1);
}
console.log(`differential: ${counts}, all listed`);
