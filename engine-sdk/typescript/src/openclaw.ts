// Messages between the contract (contextengine.v1.AgentMessage) and
// OpenClaw's agent messages (pi-ai: user, assistant with text, thinking and
// toolCall blocks, toolResult), both ways: what the OpenClaw plugin host
// (engines/openclaw-host) and the ctxgate plugin for OpenClaw
// (engines/openclaw-plugin) convert with. `@ctxgate/engine-sdk/openclaw`.
import type * as pb from "./gen/pb.js";

type Proto = pb.AgentMessage__Output | pb.AgentMessage;

/** OpenClaw's AgentMessage, as plugins see it (loosely typed: plugins
 * read what they know and carry the rest). */
export type OcMessage = Record<string, unknown> & { role: string; content?: unknown };

interface Block {
  type?: string;
  text?: string;
  thinking?: string;
  id?: string;
  name?: string;
  arguments?: unknown;
  [k: string]: unknown;
}

function parseArguments(json: string | undefined): unknown {
  if (!json || json.trim() === "") return {};
  try {
    return JSON.parse(json) as unknown;
  } catch {
    return { _raw: json };
  }
}

const ROLE_NAMES: Record<string, string> = {
  ROLE_USER: "user",
  ROLE_ASSISTANT: "assistant",
  ROLE_TOOL: "toolResult",
  ROLE_SYSTEM: "system",
};

/** How many OpenClaw messages `toOpenClaw` makes of `m`, without making them. */
export function openClawCount(m: Proto): number {
  if (ROLE_NAMES[String(m.role)] !== "toolResult") return 1;
  return ((m.content ?? []) as pb.ContentPart__Output[]).filter((p) => p.toolResult).length;
}

/** A contract message as OpenClaw messages: one, or one per tool result
 * when a tool message answers several calls. A message with no creation
 * time gets `fallbackMs` (the host's first sight of it: stable across
 * retries), else now. */
export function toOpenClaw(m: Proto, fallbackMs?: number): OcMessage[] {
  const role = ROLE_NAMES[String(m.role)] ?? "user";
  const timestamp = Number(m.createdAtUnixMs ?? 0) || fallbackMs || Date.now();
  const parts = (m.content ?? []) as pb.ContentPart__Output[];
  const meta = (m.metadata ?? {}) as Record<string, string>;
  if (role === "toolResult") {
    const results = parts.filter((p) => p.toolResult);
    return results.map((p) => ({
      role: "toolResult",
      toolCallId: p.toolResult!.toolCallId,
      toolName: p.toolResult!.toolName,
      content: [{ type: "text", text: p.toolResult!.text }],
      isError: p.toolResult!.isError === true,
      timestamp,
    }));
  }
  const blocks: Block[] = [];
  for (const p of parts) {
    if (typeof p.text === "string" && (p.part === "text" || p.part === undefined))
      blocks.push({ type: "text", text: p.text });
    else if (p.thinking)
      blocks.push({
        type: "thinking",
        thinking: p.thinking.text,
        ...(p.thinking.signature ? { thinkingSignature: p.thinking.signature } : {}),
      });
    else if (p.image) blocks.push({ type: "text", text: `[image ${p.image.uri}]` });
    else if (p.toolCall)
      blocks.push({
        type: "toolCall",
        id: p.toolCall.id,
        name: p.toolCall.name,
        arguments: parseArguments(p.toolCall.argumentsJson),
      });
  }
  if (role === "assistant") {
    const u = m.usage;
    return [
      {
        role: "assistant",
        content: blocks,
        api: "openai-completions",
        provider: meta["provider"] ?? "ctxgate",
        model: meta["model"] ?? "",
        usage: {
          input: Number(u?.inputTokens ?? 0),
          output: Number(u?.outputTokens ?? 0),
          cacheRead: Number(u?.cacheReadTokens ?? 0),
          cacheWrite: Number(u?.cacheWriteTokens ?? 0),
          totalTokens: Number(u?.totalTokens ?? 0),
          cost: { input: 0, output: 0, cacheRead: 0, cacheWrite: 0, total: Number(u?.costUsd ?? 0) },
        },
        stopReason: blocks.some((b) => b.type === "toolCall") ? "toolUse" : "stop",
        timestamp,
      },
    ];
  }
  if (role === "system") return [{ role: "system", content: blocks.map((b) => b.text ?? "").join("\n"), timestamp }];
  return [{ role: "user", content: blocks.filter((b) => b.type === "text"), timestamp }];
}

export function textOfContent(content: unknown): string[] {
  if (typeof content === "string") return [content];
  if (!Array.isArray(content)) return [];
  const out: string[] = [];
  for (const b of content as Block[]) {
    if (b && typeof b === "object" && b.type === "text" && typeof b.text === "string") out.push(b.text);
  }
  return out;
}

/** An OpenClaw message as a contract message (id given). */
export function fromOpenClaw(m: OcMessage, id: string): pb.AgentMessage {
  const ts = typeof m["timestamp"] === "number" ? (m["timestamp"] as number) : 0;
  const base = { id, createdAtUnixMs: ts };
  switch (m.role) {
    case "assistant": {
      const content: pb.ContentPart[] = [];
      const blocks =
        typeof m.content === "string"
          ? [{ type: "text", text: m.content }]
          : ((m.content as Block[] | undefined) ?? []);
      for (const b of blocks) {
        if (!b || typeof b !== "object") continue;
        if (b.type === "text" && typeof b.text === "string" && b.text !== "") content.push({ text: b.text });
        else if (b.type === "thinking" && typeof b.thinking === "string")
          content.push({ thinking: { text: b.thinking, signature: String(b["thinkingSignature"] ?? "") } });
        else if (b.type === "toolCall" && b.id && b.name)
          content.push({
            toolCall: { id: String(b.id), name: String(b.name), argumentsJson: JSON.stringify(b.arguments ?? {}) },
          });
      }
      if (content.length === 0) content.push({ text: "" });
      return { ...base, role: "ROLE_ASSISTANT", content };
    }
    case "toolResult":
    case "tool":
      return {
        ...base,
        role: "ROLE_TOOL",
        content: [
          {
            toolResult: {
              toolCallId: String(m["toolCallId"] ?? m["tool_call_id"] ?? ""),
              toolName: String(m["toolName"] ?? ""),
              text: textOfContent(m.content).join("\n"),
              isError: m["isError"] === true,
            },
          },
        ],
      };
    case "system":
      return { ...base, role: "ROLE_SYSTEM", content: [{ text: textOfContent(m.content).join("\n") }] };
    default: {
      const texts = textOfContent(m.content);
      if (texts.length === 0 && typeof m["command"] === "string")
        texts.push(`$ ${String(m["command"])}\n${String(m["output"] ?? "")}`);
      return { ...base, role: "ROLE_USER", content: texts.map((text) => ({ text })) };
    }
  }
}

