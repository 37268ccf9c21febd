// A session OpenClaw held before the plugin ran it (its history from the
// in-process `legacy` engine, or another one) has nothing at the gateway:
// its engine would start blind and the gateway's copy would miss the
// start. So the plugin imports it once, at the turn's first assemble,
// before the turn opens: each earlier turn (from its user message to the
// next one) becomes one captured harness turn, recorded as it was and
// delivered to the engine as any turn (CommitTurn or AfterTurn, in order).
import type { OcMessage } from "@ctxgate/engine-sdk/openclaw";

export interface PastTurn {
  /** The turn's user message(s): a harness turn begins with them. */
  users: OcMessage[];
  /** What followed: assistant messages, tool results. */
  rest: OcMessage[];
}

/** Sessions whose import this process has settled, at most this many remembered. */
const MAX_KNOWN = 4_096;

/**
 * OpenClaw's history as turns, each from a user message (consecutive ones
 * open one turn together) to the next. A history that starts with
 * anything but a user message has no turn to put it in: the reason why.
 */
export function turnsOf(history: OcMessage[]): PastTurn[] | { refused: string } {
  const turns: PastTurn[] = [];
  for (const m of history) {
    const last = turns.at(-1);
    if (m.role === "user") {
      if (last && last.rest.length === 0) last.users.push(m);
      else turns.push({ users: [m], rest: [] });
    } else if (last) {
      last.rest.push(m);
    } else {
      return { refused: `the history starts with a message of role ${String(m.role)}, not with a user message` };
    }
  }
  return turns;
}

/**
 * The sessions this process knows the gateway holds (imported, or found
 * there): their later turns skip the check. Bounded: past MAX_KNOWN it
 * starts over, which costs one more check a session.
 */
export class KnownSessions {
  private readonly known = new Set<string>();

  has(sessionId: string): boolean {
    return this.known.has(sessionId);
  }

  add(sessionId: string): void {
    if (this.known.size >= MAX_KNOWN) this.known.clear();
    this.known.add(sessionId);
  }
}
