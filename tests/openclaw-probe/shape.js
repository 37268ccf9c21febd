// The shape of a value: its keys and JS types, recursively, so two callers
// of the same method can be compared without comparing values.
//
// A shape is { t: [type…], k?: { key: shape }, e?: shape }:
//   t  the types seen, sorted: "string" "number" "boolean" "bigint" "symbol"
//      "null" "undefined" (a key set to undefined, not a missing key)
//      "function" "Set" "Map" "object" (a plain object) "array", a class
//      name for other instances ("AbortSignal", "Date", …), "absent" (the
//      key was missing from some of the objects merged), and for a few
//      discriminator keys (ENUM_KEYS) the literal value, e.g. "\"user\"";
//   k  an object's keys (every plain object merged at this place);
//   e  an array's elements, all merged into one shape (no `e` when every
//      array seen here was empty).
// `config` keys are recorded as their type only: their contents are the
// user's configuration, which differs between the two setups by design.

/** Keys whose string values are an enum: their value is part of the shape. */
export const ENUM_KEYS = new Set(["role", "type", "kind", "mode", "stopReason", "status"]);
/** Keys recorded by type only. */
export const OPAQUE_KEYS = new Set(["config"]);
const MAX_DEPTH = 12;

function typeOf(v, key) {
  if (v === null) return "null";
  if (v === undefined) return "undefined";
  if (typeof v === "function") return "function";
  if (typeof v === "string" && ENUM_KEYS.has(key)) return JSON.stringify(v);
  if (typeof v !== "object") return typeof v;
  if (Array.isArray(v)) return "array";
  if (v instanceof Set) return "Set";
  if (v instanceof Map) return "Map";
  const proto = Object.getPrototypeOf(v);
  if (proto === null || proto === Object.prototype) return "object";
  // Objects made in another realm (vm contexts) have another Object.
  const name = proto.constructor?.name;
  return !name || name === "Object" ? "object" : name;
}

/** The shape of `v` (found under `key`). */
export function shapeOf(v, key = "", depth = 0, seen = new WeakSet()) {
  const t = typeOf(v, key);
  if (OPAQUE_KEYS.has(key) || depth >= MAX_DEPTH) return { t: [t] };
  if (t === "object") {
    if (seen.has(v)) return { t: ["cycle"] };
    seen.add(v);
    const k = {};
    for (const name of Object.keys(v).sort()) k[name] = shapeOf(v[name], name, depth + 1, seen);
    seen.delete(v);
    return { t: [t], k };
  }
  if (t === "array") {
    let e;
    for (const item of v) e = merge(e, shapeOf(item, key, depth + 1, seen));
    return e ? { t: [t], e } : { t: [t] };
  }
  return { t: [t] };
}

/** Two shapes seen at one place, as one. */
export function merge(a, b) {
  if (!a) return b;
  if (!b) return a;
  const t = [...new Set([...a.t, ...b.t])].sort();
  const out = { t };
  if (a.k || b.k) {
    const k = {};
    for (const name of new Set([...Object.keys(a.k ?? {}), ...Object.keys(b.k ?? {})])) {
      const [x, y] = [a.k?.[name], b.k?.[name]];
      // A key one object lacks is "absent" there (if that side had objects).
      const absent = { t: ["absent"] };
      k[name] = merge(x ?? (a.k ? absent : undefined), y ?? (b.k ? absent : undefined));
    }
    out.k = Object.fromEntries(Object.entries(k).sort(([x], [y]) => (x < y ? -1 : x > y ? 1 : 0)));
  }
  if (a.e || b.e) out.e = merge(a.e, b.e);
  return out;
}

/** `shape` as path → "type|type" lines: `(argument)` (the value itself),
 * `a`, `a.b`, `a[]`, `a[].b`. */
export function flatten(shape, path = "", out = new Map()) {
  out.set(path || "(argument)", shape.t.join("|"));
  for (const [name, s] of Object.entries(shape.k ?? {})) flatten(s, path ? `${path}.${name}` : name, out);
  if (shape.e) flatten(shape.e, `${path}[]`, out);
  return out;
}
