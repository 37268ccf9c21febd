// W3C Trace Context (`traceparent`), as proto/src/trace.rs reads and
// writes it: an engine method's span is a child of the caller's, and the
// method's callbacks carry the method's span as their parent.
import { randomBytes } from "node:crypto";

export const TRACE_HEADER = "traceparent";

export class TraceParent {
  constructor(
    readonly traceId: Buffer,
    readonly parentId: Buffer,
    readonly flags: number,
  ) {}

  /** A valid version-00 header with non-zero ids, or undefined. */
  static parse(value: string | undefined): TraceParent | undefined {
    if (!value) return undefined;
    const m = /^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$/.exec(value.trim());
    if (!m) return undefined;
    const trace = Buffer.from(m[1]!, "hex");
    const parent = Buffer.from(m[2]!, "hex");
    if (trace.every((b) => b === 0) || parent.every((b) => b === 0)) return undefined;
    return new TraceParent(trace, parent, parseInt(m[3]!, 16));
  }

  /** A new sampled trace. */
  static root(): TraceParent {
    return new TraceParent(nonZero(16), nonZero(8), 1);
  }

  /** The same trace with a new span id: what this hop sends on. */
  child(): TraceParent {
    return new TraceParent(this.traceId, nonZero(8), this.flags);
  }

  get sampled(): boolean {
    return (this.flags & 1) === 1;
  }

  traceIdHex(): string {
    return this.traceId.toString("hex");
  }

  toString(): string {
    return `00-${this.traceId.toString("hex")}-${this.parentId.toString("hex")}-${this.flags
      .toString(16)
      .padStart(2, "0")}`;
  }
}

function nonZero(n: number): Buffer {
  const b = randomBytes(n);
  if (b.every((x) => x === 0)) b[0] = 1;
  return b;
}
