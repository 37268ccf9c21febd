// Messages a plugin assembled, matched back to the contract messages they
// came from (the exact original, its id and metadata kept); one the plugin
// made itself (a summary) gets a new id. The conversions themselves are the
// SDK's (@ctxgate/engine-sdk/openclaw).
import { createHash } from "node:crypto";
import type { pb } from "@ctxgate/engine-sdk";
import { type OcMessage, fromOpenClaw, textOfContent, toOpenClaw } from "@ctxgate/engine-sdk/openclaw";

export { type OcMessage, fromOpenClaw, openClawCount, toOpenClaw } from "@ctxgate/engine-sdk/openclaw";

type Proto = pb.AgentMessage__Output | pb.AgentMessage;

interface Block {
  type?: string;
  id?: string;
  [k: string]: unknown;
}

/** What identifies a message's content across the plugin's storage: its
 * role, its text, its tool call ids (thinking and formatting aside). */
export function fingerprint(m: OcMessage): string {
  const role = m.role === "tool" ? "toolResult" : m.role;
  const texts = textOfContent(m.content)
    .map((t) => t.trim())
    .filter(Boolean);
  const calls: string[] = [];
  if (Array.isArray(m.content)) {
    for (const b of m.content as Block[]) if (b && b.type === "toolCall" && b.id) calls.push(String(b.id));
  }
  const result = role === "toolResult" ? String(m["toolCallId"] ?? "") : "";
  return createHash("sha256")
    .update(JSON.stringify([role, texts.join("\n"), calls, result]))
    .digest("hex");
}

/**
 * Turns what the plugin assembled back into contract messages: each one
 * that matches (in order) a message the contract delivered is that exact
 * message; the rest (summaries, placeholders) are synthesised with ids
 * unique in the result.
 */
/** A contract message's fingerprints (one per OpenClaw message it makes),
 * computed once per message object. */
const fingerprints = new WeakMap<object, string[]>();
export function fingerprintsOf(m: Proto): string[] {
  let fps = fingerprints.get(m);
  if (!fps) {
    fps = toOpenClaw(m).map(fingerprint);
    fingerprints.set(m, fps);
  }
  return fps;
}

export function matchBack(assembled: OcMessage[], known: Proto[]): pb.AgentMessage[] {
  const queue = new Map<string, { message: Proto; index: number }[]>();
  known.forEach((message, index) => {
    for (const fp of fingerprintsOf(message)) {
      const list = queue.get(fp) ?? [];
      list.push({ message, index });
      queue.set(fp, list);
    }
  });
  const used = new Set<string>();
  const out: pb.AgentMessage[] = [];
  let last = -1;
  assembled.forEach((oc, position) => {
    const candidates = queue.get(fingerprint(oc)) ?? [];
    const hit =
      candidates.find((c) => c.index > last && !used.has(c.message.id!)) ??
      candidates.find((c) => !used.has(c.message.id!));
    if (hit) {
      used.add(hit.message.id!);
      last = hit.index;
      out.push(hit.message as pb.AgentMessage);
      return;
    }
    const digest = createHash("sha256").update(JSON.stringify(oc)).digest("hex").slice(0, 16);
    let id = `oc-${digest}`;
    for (let k = 1; used.has(id); k++) id = `oc-${digest}-${position}-${k}`;
    used.add(id);
    out.push(fromOpenClaw(oc, id));
  });
  return out;
}
