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
