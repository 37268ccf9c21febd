// The session transcripts the host keeps for the plugin, as OpenClaw's
// file-backed session store writes them (one JSONL file a session: a
// `{type:"session"}` header, then `{type:"message", id, parentId,
// timestamp, message}` entries). A plugin of OpenClaw's JSONL era
// (lossless-claw 0.15) reconciles against this file: bootstrap imports it,
// afterTurn reads its new tail. The entry id is the contract's message id,
// so a message is written once however often ctxgate delivers it, and the
// plugin's own transcript-entry idempotency keys off the same ids.
import { createHash, randomUUID } from "node:crypto";
import {
  closeSync,
  existsSync,
  fstatSync,
  fsyncSync,
  ftruncateSync,
  mkdirSync,
  openSync,
  readFileSync,
  rmSync,
  writeSync,
} from "node:fs";
import { join } from "node:path";
import type { pb } from "@ctxgate/engine-sdk";
import { BoundedMap } from "./bounded.js";
import { type OcMessage, openClawCount, toOpenClaw } from "./convert.js";

type Proto = pb.AgentMessage__Output | pb.AgentMessage;

interface Session {
  path: string;
  ids: Set<string>;
  lastId: string | null;
  /** Every contract message written, in order (to match assembled output). */
  messages: Proto[];
  /** When each message was written (ms): the OpenClaw timestamp of one with no creation time. */
  times: Map<string, number>;
}

/** A transcript entry in OpenClaw's form: one per OpenClaw message (a
 * tool message answering several calls makes several, `ID#k` after the
 * first). */
export interface OcEntry {
  entryId: string;
  parentId: string | null;
  message: OcMessage;
  /** The contract message it comes from. */
  proto: Proto;
  timestamp: number;
}

/** Sessions kept in memory, the least recently used evicted past it: a
 * host serves sessions without end, and each holds its whole transcript.
 * The files are the truth; an evicted session is read again when used. */
export const MAX_CACHED_SESSIONS = 256;

/** Appends `text` to `path` whole and synced, or throws with the file cut
 * back to where it was (a later append must not follow half a line). */
function appendDurably(path: string, text: string): void {
  const fd = openSync(path, "a");
  const before = fstatSync(fd).size;
  try {
    const bytes = Buffer.from(text);
    for (let done = 0; done < bytes.length; ) done += writeSync(fd, bytes, done);
    fsyncSync(fd);
  } catch (e) {
    try {
      ftruncateSync(fd, before);
    } catch {
      // The next load skips what it cannot parse.
    }
    throw e;
  } finally {
    closeSync(fd);
  }
}

export class Transcripts {
  private readonly sessions: BoundedMap<string, Session>;
  readonly dir: string;

  constructor(stateDir: string, maxCached = MAX_CACHED_SESSIONS) {
    this.sessions = new BoundedMap(maxCached);
    this.dir = join(stateDir, "sessions");
    mkdirSync(this.dir, { recursive: true });
  }

  /** How many sessions are in memory. */
  get cached(): number {
    return this.sessions.size;
  }

  /** The session's transcript file (a legacy `sessionFile` locator). */
  pathOf(sessionId: string): string {
    const safe = sessionId.replace(/[^a-zA-Z0-9._-]/g, "_").slice(0, 80);
    const digest = createHash("sha256").update(sessionId).digest("hex").slice(0, 12);
    return join(this.dir, `${safe}-${digest}.jsonl`);
  }

  private load(sessionId: string): Session {
    let s = this.sessions.use(sessionId);
    if (s) return s;
    const path = this.pathOf(sessionId);
    s = { path, ids: new Set(), lastId: null, messages: [], times: new Map() };
    if (existsSync(path)) {
      for (const line of readFileSync(path, "utf8").split("\n")) {
        if (!line.trim()) continue;
        try {
          const e = JSON.parse(line) as { type?: string; id?: string; timestamp?: string; proto?: Proto };
          if (e.type === "message" && e.id) {
            s.lastId = e.id;
            // A line written twice (a write that failed after it reached
            // the file, then the gateway's resend) is one message.
            if (s.ids.has(e.id)) continue;
            s.ids.add(e.id);
            if (e.proto) {
              s.messages.push(e.proto);
              const ms = Date.parse(e.timestamp ?? "");
              if (Number.isFinite(ms)) s.times.set(e.id, ms);
            }
          }
        } catch {
          // A line cut by a crash was never acknowledged: the gateway resends it.
        }
      }
    }
    this.sessions.set(sessionId, s);
    return s;
  }

  /** Whether the session's transcript holds message `id`. */
  holds(sessionId: string, id: string): boolean {
    return this.load(sessionId).ids.has(id);
  }

  /** Every contract message of the session written so far, in order. */
  messages(sessionId: string): Proto[] {
    return this.load(sessionId).messages;
  }

  /** The message as OpenClaw messages, timed as the transcript has it. */
  openclaw(sessionId: string, m: Proto): OcMessage[] {
    return toOpenClaw(m, this.load(sessionId).times.get(m.id!));
  }

  /**
   * Where message `id` sits in OpenClaw's units: how many more OpenClaw
   * messages than contract messages precede it (a tool message answering
   * N calls is N of them), and the entry id of the OpenClaw message just
   * before it. Undefined when the transcript does not hold `id`.
   */
  openClawPlace(sessionId: string, id: string): { extra: number; parentEntryId: string | null } | undefined {
    let extra = 0;
    let parentEntryId: string | null = null;
    for (const m of this.load(sessionId).messages) {
      if (m.id === id) return { extra, parentEntryId };
      const n = openClawCount(m);
      extra += n - 1;
      if (n > 0) parentEntryId = n === 1 ? m.id! : `${m.id!}#${n - 1}`;
    }
    return undefined;
  }

  /** The session's entries in OpenClaw's form, oldest first. */
  entries(sessionId: string): OcEntry[] {
    const s = this.load(sessionId);
    const out: OcEntry[] = [];
    let parentId: string | null = null;
    for (const proto of s.messages) {
      const timestamp = Number(proto.createdAtUnixMs ?? 0) || s.times.get(proto.id!) || 0;
      toOpenClaw(proto, timestamp || undefined).forEach((message, k) => {
        const entryId = k === 0 ? proto.id! : `${proto.id!}#${k}`;
        out.push({ entryId, parentId, message, proto, timestamp });
        parentId = entryId;
      });
    }
    return out;
  }

  /** The session's transcript file, made (with its header) if missing:
   * the locator a plugin is given must name a file. */
  ensure(sessionId: string): string {
    const path = this.pathOf(sessionId);
    if (!existsSync(path)) {
      const fd = openSync(path, "a");
      try {
        writeSync(fd, this.header());
        fsyncSync(fd);
      } finally {
        closeSync(fd);
      }
    }
    return path;
  }

  private header(): string {
    return (
      JSON.stringify({
        type: "session",
        version: 3,
        id: randomUUID(),
        timestamp: new Date().toISOString(),
        cwd: this.dir,
      }) + "\n"
    );
  }

  /** Appends the messages the transcript does not hold yet (durably,
   * before the plugin is told); returns the ones written. */
  append(sessionId: string, list: readonly Proto[]): Proto[] {
    const s = this.load(sessionId);
    const fresh = list.filter((m, i) => !s.ids.has(m.id!) && list.findIndex((x) => x.id === m.id) === i);
    if (fresh.length === 0) return [];
    const lines: string[] = [];
    if (!existsSync(s.path)) lines.push(this.header().trimEnd());
    let lastId = s.lastId;
    const times = fresh.map((m) => Number(m.createdAtUnixMs ?? 0) || Date.now());
    fresh.forEach((m, i) => {
      const oc: OcMessage[] = toOpenClaw(m, times[i]);
      oc.forEach((message, k) => {
        const id = k === 0 ? m.id! : `${m.id!}#${k}`;
        lines.push(
          JSON.stringify({
            type: "message",
            id,
            parentId: lastId,
            timestamp: new Date(times[i]).toISOString(),
            message,
            // The contract message itself, so the host can give it back exactly.
            ...(k === 0 ? { proto: m } : {}),
          }),
        );
        lastId = id;
      });
    });
    appendDurably(s.path, lines.join("\n") + "\n");
    // Remembered only once written: a failed write leaves them unheld,
    // so the gateway's resend writes them then.
    s.lastId = lastId;
    fresh.forEach((m, i) => {
      s.ids.add(m.id!);
      s.messages.push(m);
      s.times.set(m.id!, times[i]);
    });
    return fresh;
  }

  /** Drops the session's transcript (ForgetSession). */
  forget(sessionId: string): void {
    rmSync(this.pathOf(sessionId), { force: true });
    this.sessions.delete(sessionId);
  }
}
