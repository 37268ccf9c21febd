// openclaw/plugin-sdk/session-transcript-runtime's readers, served from
// the gateway's transcript: `Host.ReadTranscript` (the visible history)
// under the grant of the engine call in progress, as OpenClaw serves them
// from its SQLite session store. The gateway honours the current-turn
// fence itself (reads for pre-turn calls end before the admitted user
// entry). A call without a read grant reads the host's own copy of the
// session (what the gateway delivered to this host). Result shapes and
// defaults are OpenClaw 2026.9.6's.
import type { CallContext, pb } from "@ctxgate/engine-sdk";
import type {
  SessionTranscriptReadScope,
  SessionTranscriptVisibleMessageDelta,
  VisibleSessionTranscriptMessageEntry,
} from "./openclaw-types.js";
import { current } from "./runtime.js";
import type { Transcripts } from "./transcript.js";

/** OpenClaw's page defaults and caps (session-accessor.sqlite-visible-cursor). */
export const DEFAULT_VISIBLE_MESSAGE_MAX_MESSAGES = 1_000;
export const DEFAULT_VISIBLE_MESSAGE_MAX_BYTES = 1_000_000;
export const MAX_VISIBLE_MESSAGE_MAX_MESSAGES = 10_000;
export const MAX_VISIBLE_MESSAGE_MAX_BYTES = 67_108_864;

const CURSOR_VERSION = 2;

/** The opaque delta cursor (base64url JSON, as OpenClaw's). */
interface Cursor {
  version: number;
  agentId: string;
  sessionId: string;
  generation: string;
  lastEventSeq: number;
  lastMessagePosition: number;
  /** The last entry returned (OpenClaw finds it by its event seq). */
  lastEntryId: string | null;
  /** The gateway's entry the next read resumes after (ReadTranscript's
   * cursor): the last one returned whole. */
  gatewayAfter: string | null;
  /** OpenClaw messages of the entry after `gatewayAfter` already returned
   * (a tool message answering several calls, cut by a page). */
  skip: number;
}

export interface DeltaParams extends SessionTranscriptReadScope {
  cursor?: string;
  maxBytes?: number;
  maxMessages?: number;
}

function limit(value: number | undefined, fallback: number, maximum: number, name: string): number {
  const resolved = value ?? fallback;
  if (!Number.isInteger(resolved) || resolved < 1 || resolved > maximum) {
    throw new RangeError(`${name} must be an integer between 1 and ${String(maximum)}`);
  }
  return resolved;
}

function encode(c: Cursor): string {
  return Buffer.from(JSON.stringify(c), "utf8").toString("base64url");
}

function decode(value: string): Cursor | undefined {
  if (value.length > 4096) return undefined;
  try {
    const bytes = Buffer.from(value, "base64url");
    if (bytes.toString("base64url") !== value) return undefined;
    const c = JSON.parse(bytes.toString("utf8")) as Partial<Cursor>;
    const ok =
      c.version === CURSOR_VERSION &&
      typeof c.agentId === "string" &&
      typeof c.sessionId === "string" &&
      typeof c.generation === "string" &&
      Number.isInteger(c.lastEventSeq) &&
      Number.isInteger(c.lastMessagePosition) &&
      (c.lastEntryId === null || typeof c.lastEntryId === "string") &&
      (c.gatewayAfter === null || typeof c.gatewayAfter === "string") &&
      Number.isInteger(c.skip) &&
      c.skip! >= 0;
    return ok ? (c as Cursor) : undefined;
  } catch {
    return undefined;
  }
}

/** The gateway refused a read's cursor: its entry is not on the visible
 * branch any more (the SDK reports the host's status in its message). */
function unknownCursor(e: unknown): boolean {
  return e instanceof Error && e.message.includes("(INVALID_ARGUMENT)");
}

/** Entries read from the gateway for one page, at most (the page's cap and one to see more). */
interface Candidates {
  entries: VisibleSessionTranscriptMessageEntry[];
  /** For each entry: the gateway entry it comes from, and whether it is that entry's last part. */
  origin: { id: string; last: boolean }[];
}

/** The engine call in progress when its grant lets it read `sessionId`'s
 * transcript from the gateway; undefined without a read grant (the host's
 * own copy serves); refused for another session. */
function grantedRead(sessionId: string): CallContext | undefined {
  const ctx = current.getStore();
  if (!ctx?.host?.allows("read_transcript")) return undefined;
  if (ctx.host.sessionId !== sessionId) {
    throw new Error(
      `session transcript scope ${JSON.stringify(sessionId)} is not the session of this engine call ` +
        `(${JSON.stringify(ctx.host.sessionId)}): a grant covers its own session only`,
    );
  }
  return ctx;
}

function checkScope(scope: SessionTranscriptReadScope | undefined): string {
  const sessionId = typeof scope?.sessionId === "string" ? scope.sessionId.trim() : "";
  if (!sessionId) throw new Error("session transcript reads need a scope with a sessionId");
  return sessionId;
}

export class TranscriptReader {
  constructor(private readonly transcripts: Transcripts) {}

  /** readVisibleSessionTranscriptMessageEntries(scope). */
  async visibleEntries(scope: SessionTranscriptReadScope): Promise<VisibleSessionTranscriptMessageEntry[]> {
    const sessionId = checkScope(scope);
    const ctx = grantedRead(sessionId);
    if (ctx) return this.fromGateway(sessionId, await ctx.host!.readTranscript(ctx, true));
    return this.transcripts.entries(sessionId).map((e, i) => ({
      entryId: e.entryId,
      parentId: e.parentId,
      seq: i + 1,
      message: e.message,
      role: e.message.role,
      ...(e.timestamp ? { createdAt: new Date(e.timestamp).toISOString() } : {}),
    }));
  }

  private fromGateway(
    sessionId: string,
    entries: pb.TranscriptEntry__Output[],
    lastPart = new Map<string, string>(),
    origin?: Candidates["origin"],
  ): VisibleSessionTranscriptMessageEntry[] {
    const out: VisibleSessionTranscriptMessageEntry[] = [];
    // A message split into several OpenClaw messages: later entries hang off its last part.
    for (const e of entries) {
      if (!e.message) continue; // compaction entries are not message entries (OpenClaw drops them too)
      const created = Number(e.message.createdAtUnixMs ?? 0);
      const parts = this.transcripts.openclaw(sessionId, e.message);
      let parentId: string | null = e.parentId ? (lastPart.get(e.parentId) ?? e.parentId) : null;
      parts.forEach((message, k) => {
        const entryId = k === 0 ? e.id : `${e.id}#${k}`;
        out.push({
          entryId,
          parentId,
          seq: Number(e.seq),
          message,
          role: message.role,
          ...(created ? { createdAt: new Date(created).toISOString() } : {}),
        });
        origin?.push({ id: e.id, last: k === parts.length - 1 });
        parentId = entryId;
      });
      if (parts.length > 0) lastPart.set(e.id, parentId!);
    }
    return out;
  }

  /**
   * Up to `want` OpenClaw entries after the cursor, read from the gateway
   * page by page from its `gatewayAfter` (skipping the parts of a cut
   * message already returned). The entries' parents continue from the
   * cursor's last entry.
   */
  private async gatewayAfter(sessionId: string, at: Cursor, want: number): Promise<Candidates> {
    const ctx = grantedRead(sessionId)!;
    const out: Candidates = { entries: [], origin: [] };
    const lastPart = new Map<string, string>();
    if (at.gatewayAfter !== null && at.lastEntryId !== null) lastPart.set(at.gatewayAfter, at.lastEntryId);
    let cursor = at.gatewayAfter ?? "";
    let skip = at.skip;
    do {
      const page = await ctx.host!.readTranscriptPage(ctx, { visibleOnly: true, cursor, limit: want });
      const origin: Candidates["origin"] = [];
      const entries = this.fromGateway(sessionId, page.entries, lastPart, origin);
      const from = Math.min(skip, entries.length);
      skip = 0;
      out.entries.push(...entries.slice(from));
      out.origin.push(...origin.slice(from));
      cursor = page.nextCursor;
    } while (cursor !== "" && out.entries.length < want);
    out.entries.length = Math.min(out.entries.length, want);
    out.origin.length = out.entries.length;
    return out;
  }

  /** readSessionTranscriptVisibleMessageDelta({...scope, cursor?, maxBytes?, maxMessages?}). */
  async visibleDelta(params: DeltaParams): Promise<SessionTranscriptVisibleMessageDelta> {
    const { cursor, maxBytes, maxMessages, ...scope } = params ?? ({} as DeltaParams);
    const messagesCap = limit(
      maxMessages,
      DEFAULT_VISIBLE_MESSAGE_MAX_MESSAGES,
      MAX_VISIBLE_MESSAGE_MAX_MESSAGES,
      "maxMessages",
    );
    const bytesCap = limit(maxBytes, DEFAULT_VISIBLE_MESSAGE_MAX_BYTES, MAX_VISIBLE_MESSAGE_MAX_BYTES, "maxBytes");
    const sessionId = checkScope(scope);
    const agentId = typeof scope.agentId === "string" ? scope.agentId : "";
    // The gateway names a transcript's generation by its session id.
    const initial: Cursor = {
      version: CURSOR_VERSION,
      agentId,
      sessionId,
      generation: sessionId,
      lastEventSeq: -1,
      lastMessagePosition: -1,
      lastEntryId: null,
      gatewayAfter: null,
      skip: 0,
    };
    const reset = (
      reason: "invalid_cursor" | "scope_mismatch" | "generation_mismatch" | "anchor_missing" | "anchor_moved",
    ) => ({ kind: "reset", cursor: encode(initial), reason }) as const;
    const at = cursor !== undefined ? decode(cursor) : initial;
    if (!at) return reset("invalid_cursor");
    if (at.agentId !== agentId || at.sessionId !== sessionId) return reset("scope_mismatch");
    if (at.generation !== initial.generation) return reset("generation_mismatch");
    let candidates: VisibleSessionTranscriptMessageEntry[];
    let origin: Candidates["origin"] | undefined;
    if (grantedRead(sessionId)) {
      // From the gateway, only what follows the cursor: a page costs what it returns.
      let read: Candidates;
      try {
        read = await this.gatewayAfter(sessionId, at, messagesCap + 1);
      } catch (e) {
        if (unknownCursor(e)) return reset("anchor_missing");
        throw e;
      }
      ({ entries: candidates, origin } = read);
    } else {
      const all = await this.visibleEntries(scope);
      let start = 0;
      if (at.lastEntryId !== null) {
        const index = all.findIndex((e) => e.entryId === at.lastEntryId);
        if (index < 0) return reset("anchor_missing");
        if (index !== at.lastMessagePosition) return reset("anchor_moved");
        start = index + 1;
      }
      candidates = all.slice(start, start + messagesCap + 1);
    }
    let serializedBytes = 0;
    let selected = 0;
    for (const e of candidates) {
      const bytes = Buffer.byteLength(JSON.stringify(e.message));
      if (selected >= messagesCap || serializedBytes + bytes > bytesCap) break;
      serializedBytes += bytes;
      selected += 1;
    }
    const entries = candidates.slice(0, selected);
    const last = entries.at(-1);
    const requiredBytes =
      selected === 0 && candidates[0] ? Buffer.byteLength(JSON.stringify(candidates[0].message)) : undefined;
    // Where the next page resumes at the gateway: after the last entry
    // returned whole, skipping what was returned of one cut by the page.
    let { gatewayAfter, skip } = at;
    for (const o of origin?.slice(0, selected) ?? []) {
      if (o.last) [gatewayAfter, skip] = [o.id, 0];
      else skip += 1;
    }
    return {
      kind: "page",
      cursor: encode({
        ...at,
        lastEventSeq: last?.seq ?? at.lastEventSeq,
        lastMessagePosition: last ? at.lastMessagePosition + selected : at.lastMessagePosition,
        lastEntryId: last?.entryId ?? at.lastEntryId,
        gatewayAfter,
        skip,
      }),
      entries,
      hasMore: selected < candidates.length,
      ...(requiredBytes !== undefined ? { requiredBytes } : {}),
      serializedBytes,
    };
  }
}

/** Where openclaw/plugin-sdk's stub modules find the host (the stub is a
 * separate package: plugins import it by name). */
export const HOST_BRIDGE = Symbol.for("ctxgate.openclaw-host.sdk");

export interface HostBridge {
  readVisibleSessionTranscriptMessageEntries(
    scope: SessionTranscriptReadScope,
  ): Promise<VisibleSessionTranscriptMessageEntry[]>;
  readSessionTranscriptVisibleMessageDelta(params: DeltaParams): Promise<SessionTranscriptVisibleMessageDelta>;
}

export function installBridge(reader: TranscriptReader): void {
  const bridge: HostBridge = {
    readVisibleSessionTranscriptMessageEntries: (scope) => reader.visibleEntries(scope),
    readSessionTranscriptVisibleMessageDelta: (params) => reader.visibleDelta(params),
  };
  (globalThis as Record<symbol, unknown>)[HOST_BRIDGE] = bridge;
}
