// The gateway's history of each session as this host acknowledged it, so
// the host can be a DELTA engine: the gateway sends a cursor and what
// follows it, and the host rebuilds the whole array a plugin expects (as
// OpenClaw passes it) from what it holds. Unlike the plugin's transcript
// file (transcript.ts, append-only, what OpenClaw's session file would
// be), this is the gateway's *visible* history: a message resent under its
// id (a rewrite, resynced) replaces the one held, and a history the gateway
// restructured (a compaction summary first) no longer matches the cursor's
// count, so the host reports a gap, forgets the session and the gateway
// resends it whole (IngestBatch). In memory only: after a restart, or once
// evicted, a session costs one such resync.
import type { pb } from "@ctxgate/engine-sdk";
import { BoundedMap } from "./bounded.js";

type Proto = pb.AgentMessage__Output | pb.AgentMessage;

interface Held {
  messages: Proto[];
  /** Message id → its index in `messages`. */
  at: Map<string, number>;
}

/** Sessions held at once; the least recently used is forgotten first. */
export const MAX_HELD_SESSIONS = 1024;

export class History {
  private readonly sessions: BoundedMap<string, Held>;

  constructor(maxSessions = MAX_HELD_SESSIONS) {
    this.sessions = new BoundedMap(maxSessions);
  }

  /** The session's copy (an empty one if none), marked most recently used. */
  private use(sessionId: string): Held {
    const held = this.sessions.use(sessionId);
    if (held) return held;
    const made = { messages: [], at: new Map() };
    this.sessions.set(sessionId, made);
    return made;
  }

  /** How many sessions are held. */
  get size(): number {
    return this.sessions.size;
  }

  /**
   * Acknowledged messages, in the gateway's order: a new id is appended, a
   * held one replaced in place (its content may have been rewritten). A
   * batch that does not follow the copy's order (a held id that is not the
   * next one, a new id after a held one that was not the last) shows the
   * copy is stale: it is started again from that message, so the next
   * cursor finds a gap and the gateway resends the history whole.
   */
  acknowledge(sessionId: string, messages: readonly Proto[]): void {
    let held = this.use(sessionId);
    /** Where the batch's previous message sits in the copy. */
    let previous: number | undefined;
    for (const m of messages) {
      const id = m.id ?? "";
      const i = held.at.get(id);
      const next = previous === undefined ? undefined : previous + 1;
      if (i !== undefined && (next === undefined || i === next)) {
        held.messages[i] = m;
        previous = i;
        continue;
      }
      if (i === undefined && (next === undefined || next === held.messages.length)) {
        previous = held.messages.push(m) - 1;
        held.at.set(id, previous);
        continue;
      }
      this.forget(sessionId);
      held = this.use(sessionId);
      held.at.set(id, 0);
      held.messages.push(m);
      previous = 0;
    }
  }

  /** The session held, when it holds exactly what the cursor says: the
   * messages up to and including `cursor.messageId`, `cursor.messageCount`
   * of them (an empty cursor: none), perhaps more after them. */
  private covering(sessionId: string, cursor: pb.HistoryCursor__Output): Held | undefined {
    const count = Number(cursor.messageCount);
    if (!cursor.messageId) return count === 0 ? this.use(sessionId) : undefined;
    const held = this.sessions.get(sessionId);
    const i = held?.at.get(cursor.messageId);
    // The cursor names the last message in branch order, which for a
    // compaction's summary (shown first, stored after what it keeps) is
    // the first of the `count` held.
    const summary = i === 0 && count > 1 && held!.messages.length >= count;
    return i !== undefined && (i + 1 === count || summary) ? this.use(sessionId) : undefined;
  }

  /** The whole history a DELTA request's cursor stands for (the request's
   * messages follow it); undefined on a gap. */
  through(sessionId: string, cursor: pb.HistoryCursor__Output): Proto[] | undefined {
    return this.covering(sessionId, cursor)?.messages.slice(0, Number(cursor.messageCount));
  }

  /** Keeps only what the cursor covers (messages acknowledged after it are
   * not on the gateway's branch: an after-turn that failed, a turn
   * aborted), then acknowledges `after`. False, holding nothing, on a gap. */
  advance(sessionId: string, cursor: pb.HistoryCursor__Output, after: readonly Proto[]): boolean {
    const held = this.covering(sessionId, cursor);
    if (!held) {
      this.forget(sessionId);
      return false;
    }
    for (const dropped of held.messages.splice(Number(cursor.messageCount))) held.at.delete(dropped.id ?? "");
    this.acknowledge(sessionId, after);
    return true;
  }

  forget(sessionId: string): void {
    this.sessions.delete(sessionId);
  }
}
