// The per-call context an engine method receives.
import { EngineError } from "./errors.js";
import type { HostClient } from "./host.js";
import type { TraceParent } from "./trace.js";

/** What the server knows about one call: its deadline, an AbortSignal that
 * fires when the caller cancels or the deadline passes (its `reason` is an
 * EngineError: CANCELLED or DEADLINE_EXCEEDED), the host callback client
 * when the call carried a usable grant, and the trace it belongs to. */
export class CallContext {
  constructor(
    /** Aborts on client cancel or deadline. Hand it to any work you start. */
    readonly signal: AbortSignal,
    /** When the caller stops waiting (ms since the epoch); undefined: no deadline. */
    readonly deadline: number | undefined,
    /** Host callbacks (ReadTranscript, LlmComplete), when the call carried a grant
     * for an endpoint this engine may call back. */
    readonly host: HostClient | undefined,
    /** The caller's trace context (`traceparent`), when it sent one. */
    readonly trace: TraceParent | undefined,
    /** This method's own span in that trace: the parent its callbacks send. */
    readonly span: TraceParent | undefined,
  ) {}

  /** A context with no deadline, no host, a signal that never fires (tests). */
  static detached(): CallContext {
    return new CallContext(new AbortController().signal, undefined, undefined, undefined, undefined);
  }

  /** Milliseconds left before the deadline; undefined: no deadline. */
  remainingMs(): number | undefined {
    return this.deadline === undefined ? undefined : Math.max(0, this.deadline - Date.now());
  }

  /** Throws the cancellation (CANCELLED or DEADLINE_EXCEEDED) once the call
   * is over: a cheap check for loops. */
  check(): void {
    if (this.signal.aborted) {
      const r: unknown = this.signal.reason;
      throw r instanceof EngineError ? r : EngineError.cancelled();
    }
  }
}
