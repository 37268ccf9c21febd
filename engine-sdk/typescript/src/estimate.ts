// The contract's token estimate (proto/src/estimate.rs): chars/4 rounded
// up, CJK characters one token each, images a flat 2000, a provider's
// reported output count winning.
import type * as pb from "./gen/pb.js";
import { partKind } from "./validate.js";

export const IMAGE_TOKENS = 2000;

function isCjk(cp: number): boolean {
  return (
    (cp >= 0x3040 && cp <= 0x30ff) ||
    (cp >= 0x3400 && cp <= 0x4dbf) ||
    (cp >= 0x4e00 && cp <= 0x9fff) ||
    (cp >= 0xac00 && cp <= 0xd7af) ||
    (cp >= 0xf900 && cp <= 0xfaff) ||
    (cp >= 0x20000 && cp <= 0x2fa1f)
  );
}

export function textTokens(text: string | undefined): number {
  let other = 0;
  let cjk = 0;
  for (const ch of text ?? "") {
    if (isCjk(ch.codePointAt(0)!)) cjk++;
    else other++;
  }
  return Math.ceil(other / 4) + cjk;
}

type AnyMessage = pb.AgentMessage | pb.AgentMessage__Output;

export function messageTokens(m: AnyMessage): number {
  const reported = m.usage?.outputTokens;
  if (reported !== undefined && reported !== null) return Number(reported);
  let n = 0;
  for (const p of (m.content ?? []) as pb.ContentPart__Output[]) {
    switch (partKind(p)) {
      case "text":
        n += textTokens(p.text);
        break;
      case "thinking":
        n += textTokens(p.thinking?.text);
        break;
      case "image":
        n += IMAGE_TOKENS;
        break;
      case "toolCall":
        n += textTokens(p.toolCall?.name) + textTokens(p.toolCall?.argumentsJson);
        break;
      case "toolResult":
        n += textTokens(p.toolResult?.text);
        break;
      default:
        break;
    }
  }
  return n;
}

export function messagesTokens(list: readonly AnyMessage[]): number {
  let n = 0;
  for (const m of list) n += messageTokens(m);
  return n;
}

/** What of `messages` to assemble under `budget` tokens: the newest
 * messages that fit, and their estimate. A message with tool calls and the
 * tool results that follow it (answering those calls) are kept or dropped
 * together, with everything between, so the model never sees a result
 * without its call; a tool result whose call precedes it nowhere in
 * `messages` is dropped first (and a message it leaves empty), as the
 * contract refuses it. The walk stops at the first unit that does not fit (the
 * context stays one contiguous run of the newest history), and
 * the newest unit is kept even over the budget (the contract refuses an
 * empty answer to a request with history; the estimate shows the
 * overflow). No budget (undefined or null) keeps everything. The same rule as
 * every SDK's, pinned by `proto/testdata/budget.json`. */
export function fitBudget<M extends AnyMessage>(
  messages: readonly M[],
  budget?: number | null,
): { messages: M[]; estimatedTokens: number } {
  messages = withoutOrphanResults(messages);
  if (budget === undefined || budget === null) return { messages: [...messages], estimatedTokens: messagesTokens(messages) };
  let start = messages.length;
  let tokens = 0;
  while (start > 0) {
    const unit = unitStart(messages, start - 1);
    const cost = messagesTokens(messages.slice(unit, start));
    if (tokens + cost > budget && start < messages.length) break;
    start = unit;
    tokens += cost;
  }
  return { messages: messages.slice(start), estimatedTokens: tokens };
}

/** `messages` without the tool results whose call precedes them nowhere
 * (the same order the contract's validation walks), and without a message
 * that leaves empty. */
function withoutOrphanResults<M extends AnyMessage>(messages: readonly M[]): readonly M[] {
  const calls = new Set<string>();
  const orphan = (p: pb.ContentPart__Output): boolean => {
    const kind = partKind(p);
    if (kind === "toolCall") calls.add(p.toolCall?.id ?? "");
    return kind === "toolResult" && !calls.has(p.toolResult?.toolCallId ?? "");
  };
  const parts = (m: AnyMessage) => (m.content ?? []) as pb.ContentPart__Output[];
  if (!messages.some((m) => parts(m).some(orphan))) return messages;
  calls.clear();
  const kept: M[] = [];
  for (const m of messages) {
    const content = parts(m).filter((p) => !orphan(p));
    if (content.length > 0) kept.push({ ...m, content } as M);
  }
  return kept;
}

/** Where the unit that ends at `last` starts: a tool result pulls it back
 * to the (nearest earlier) message holding its call, and so do the results
 * between. */
function unitStart(messages: readonly AnyMessage[], last: number): number {
  let start = last;
  for (let i = last; i >= start; i--) {
    for (const p of (messages[i]!.content ?? []) as pb.ContentPart__Output[]) {
      if (partKind(p) !== "toolResult") continue;
      const id = p.toolResult?.toolCallId ?? "";
      for (let j = i - 1; j >= 0; j--) {
        if (holdsCall(messages[j]!, id)) {
          start = Math.min(start, j);
          break;
        }
      }
    }
  }
  return start;
}

function holdsCall(m: AnyMessage, id: string): boolean {
  return ((m.content ?? []) as pb.ContentPart__Output[]).some((p) => partKind(p) === "toolCall" && (p.toolCall?.id ?? "") === id);
}
