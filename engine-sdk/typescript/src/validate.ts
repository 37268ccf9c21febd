// Validation of contract messages, the same checks as proto/src/validate.rs:
// the server checks every request before engine code runs, and the
// engine's GetInfo answer with the result rules. A Violation names the
// field path and maps to INVALID_ARGUMENT (malformed) or
// RESOURCE_EXHAUSTED (over a limit); its message reads "<field>: <problem>".
import { status } from "@grpc/grpc-js";
import * as L from "./limits.js";
import { METHODS, REQUIRED_METHODS, isMethod, type Method } from "./method.js";
import type * as pb from "./gen/pb.js";

export type ViolationKind = "invalid" | "too_large";

export class Violation extends Error {
  constructor(
    readonly field: string,
    readonly kind: ViolationKind,
    readonly problem: string,
  ) {
    super(`${field}: ${problem}`);
    this.name = "Violation";
  }

  get code(): status {
    return this.kind === "invalid" ? status.INVALID_ARGUMENT : status.RESOURCE_EXHAUSTED;
  }

  /** The same violation at another path. */
  at(field: string): Violation {
    return new Violation(field, this.kind, this.problem);
  }

  under(parent: string): Violation {
    return this.at(`${parent}.${this.field}`);
  }
}

const invalid = (field: string, problem: string) => new Violation(field, "invalid", problem);
const tooLarge = (field: string, problem: string) => new Violation(field, "too_large", problem);

/** UTF-8 bytes of a string (Rust's `str::len`). */
export function bytes(s: string | undefined | null): number {
  return s ? Buffer.byteLength(s, "utf8") : 0;
}

/** An anchor's generation: opaque, possibly empty, at most an id's size. */
function generation(value: string | undefined | null, field: string): void {
  const n = bytes(value);
  if (n > L.MAX_ID_BYTES) throw tooLarge(field, `is ${n} bytes, the limit is ${L.MAX_ID_BYTES}`);
}

/** A required id: non-blank and at most MAX_ID_BYTES. */
export function id(value: string | undefined | null, field: string): void {
  if (!value || value.trim() === "") throw invalid(field, "is required");
  const n = bytes(value);
  if (n > L.MAX_ID_BYTES) throw tooLarge(field, `is ${n} bytes, the limit is ${L.MAX_ID_BYTES}`);
}

type Part = pb.ContentPart__Output;
type Message = pb.AgentMessage__Output;

/** Which member of a ContentPart's oneof is set, if any. */
export function partKind(p: Part): "text" | "thinking" | "image" | "toolCall" | "toolResult" | undefined {
  if (p.part) return p.part;
  if (typeof p.text === "string") return "text";
  if (p.thinking) return "thinking";
  if (p.image) return "image";
  if (p.toolCall) return "toolCall";
  if (p.toolResult) return "toolResult";
  return undefined;
}

/** The summed size of a message's content parts, in bytes. */
export function contentBytes(m: Message): number {
  let n = 0;
  for (const p of m.content ?? []) {
    switch (partKind(p)) {
      case "text":
        n += bytes(p.text);
        break;
      case "thinking":
        n += bytes(p.thinking?.text) + bytes(p.thinking?.signature);
        break;
      case "image":
        n += bytes(p.image?.uri) + bytes(p.image?.mimeType);
        break;
      case "toolCall":
        n += bytes(p.toolCall?.id) + bytes(p.toolCall?.name) + bytes(p.toolCall?.argumentsJson);
        break;
      case "toolResult":
        n += bytes(p.toolResult?.toolCallId) + bytes(p.toolResult?.toolName) + bytes(p.toolResult?.text);
        break;
      default:
        break;
    }
  }
  return n;
}

const KNOWN_ROLES = new Set<unknown>(["ROLE_SYSTEM", "ROLE_USER", "ROLE_ASSISTANT", "ROLE_TOOL", 1, 2, 3, 4]);

/** The checks of one message, paths relative to it. */
function checkMessage(m: Message): void {
  id(m.id, "id");
  const role = m.role as unknown;
  if (role === "ROLE_UNSPECIFIED" || role === 0 || role === undefined) throw invalid("role", "is required");
  if (!KNOWN_ROLES.has(role)) throw invalid("role", `unknown role ${String(role)}`);
  (m.content ?? []).forEach((p, i) => {
    const at = (rest: string) => `content[${i}]${rest}`;
    switch (partKind(p)) {
      case undefined:
        throw invalid(at(""), "has no part set");
      case "toolCall":
        try {
          id(p.toolCall?.id, "");
        } catch (e) {
          throw (e as Violation).at(at(".tool_call.id"));
        }
        if (!p.toolCall?.name || p.toolCall.name.trim() === "") throw invalid(at(".tool_call.name"), "is required");
        break;
      case "toolResult":
        try {
          id(p.toolResult?.toolCallId, "");
        } catch (e) {
          throw (e as Violation).at(at(".tool_result.tool_call_id"));
        }
        break;
      default:
        break;
    }
  });
  const meta = Object.entries(m.metadata ?? {});
  if (meta.length > L.MAX_METADATA_ENTRIES) {
    throw tooLarge("metadata", `has ${meta.length} entries, the limit is ${L.MAX_METADATA_ENTRIES}`);
  }
  for (const [k, v] of meta) {
    if (bytes(k) > L.MAX_METADATA_KEY_BYTES) {
      throw tooLarge("metadata", `has a ${bytes(k)}-byte key, the limit is ${L.MAX_METADATA_KEY_BYTES}`);
    }
    if (bytes(v) > L.MAX_METADATA_VALUE_BYTES) {
      throw tooLarge("metadata", `[${k.slice(0, 64)}] is ${bytes(v)} bytes, the limit is ${L.MAX_METADATA_VALUE_BYTES}`);
    }
  }
  const size = contentBytes(m);
  if (size > L.MAX_MESSAGE_CONTENT_BYTES) {
    throw tooLarge("content", `is ${size} bytes, the limit is ${L.MAX_MESSAGE_CONTENT_BYTES}`);
  }
}

/** One well-formed message. */
export function message(m: Message, field: string): void {
  try {
    checkMessage(m);
  } catch (e) {
    throw e instanceof Violation ? e.under(field) : e;
  }
}

/** A list of well-formed messages with unique ids, at most MAX_MESSAGES. */
export function messages(list: readonly Message[], field: string): void {
  if (list.length > L.MAX_MESSAGES) {
    throw tooLarge(field, `has ${list.length} messages, the limit is ${L.MAX_MESSAGES}`);
  }
  const seen = new Set<string>();
  list.forEach((m, i) => {
    try {
      checkMessage(m);
    } catch (e) {
      throw e instanceof Violation ? e.under(`${field}[${i}]`) : e;
    }
    if (seen.has(m.id)) throw invalid(`${field}[${i}].id`, `duplicates message id ${JSON.stringify(m.id)}`);
    seen.add(m.id);
  });
}

/** Every tool result is preceded, in `list`, by the tool call it answers. */
export function toolPairs(list: readonly Message[], field: string): void {
  const calls = new Set<string>();
  list.forEach((m, i) => {
    (m.content ?? []).forEach((p, j) => {
      const kind = partKind(p);
      if (kind === "toolCall" && p.toolCall) calls.add(p.toolCall.id);
      if (kind === "toolResult" && p.toolResult && !calls.has(p.toolResult.toolCallId)) {
        throw invalid(
          `${field}[${i}].content[${j}].tool_result`,
          `answers tool call ${JSON.stringify(p.toolResult.toolCallId)}, which does not precede it`,
        );
      }
    });
  });
}

/** A tool name: 1 to 64 of [a-zA-Z0-9_-]. */
export function toolName(name: string, field: string): void {
  if (!/^[a-zA-Z0-9_-]{1,64}$/.test(name)) {
    throw invalid(field, `${JSON.stringify(name)} is not 1 to 64 of [a-zA-Z0-9_-]`);
  }
}

const AUDIENCES = new Set<unknown>(["TOOL_AUDIENCE_MAIN", "TOOL_AUDIENCE_SUBAGENT", "TOOL_AUDIENCE_ALL", 0, 1, 2, undefined]);

/** An engine's tool declarations. */
export function tools(list: readonly pb.ToolDefinition[], field: string): void {
  if (list.length > L.MAX_TOOLS) throw tooLarge(field, `declares ${list.length} tools, the limit is ${L.MAX_TOOLS}`);
  const names = new Set<string>();
  list.forEach((t, i) => {
    const at = `${field}[${i}]`;
    const name = t.name ?? "";
    toolName(name, `${at}.name`);
    if (names.has(name)) throw invalid(`${at}.name`, `${JSON.stringify(name)} is declared twice`);
    names.add(name);
    const desc = bytes(t.description);
    if (desc > L.MAX_TOOL_DESCRIPTION_BYTES) {
      throw tooLarge(`${at}.description`, `is ${desc} bytes, the limit is ${L.MAX_TOOL_DESCRIPTION_BYTES}`);
    }
    const schema = t.parametersJsonSchema ?? "";
    if (bytes(schema) > L.MAX_TOOL_SCHEMA_BYTES) {
      throw tooLarge(`${at}.parameters_json_schema`, `is ${bytes(schema)} bytes, the limit is ${L.MAX_TOOL_SCHEMA_BYTES}`);
    }
    if (schema.trim() !== "" && !isJsonObject(schema)) {
      throw invalid(`${at}.parameters_json_schema`, "is not a JSON object");
    }
    if (!AUDIENCES.has(t.audience)) throw invalid(`${at}.audience`, `${String(t.audience)} is not a ToolAudience`);
  });
}

export function isJsonObject(text: string): boolean {
  try {
    const v: unknown = JSON.parse(text);
    return typeof v === "object" && v !== null && !Array.isArray(v);
  } catch {
    return false;
  }
}

/** Request checks an engine server applies before its code runs. */
export const request = {
  Bootstrap(r: pb.BootstrapRequest__Output): void {
    id(r.sessionId, "session_id");
  },
  Ingest(r: pb.IngestRequest__Output): void {
    id(r.sessionId, "session_id");
    if (!r.message) throw invalid("message", "is required");
    message(r.message, "message");
  },
  IngestBatch(r: pb.IngestBatchRequest__Output): void {
    id(r.sessionId, "session_id");
    messages(r.messages ?? [], "messages");
  },
  Assemble(r: pb.AssembleRequest__Output): void {
    id(r.sessionId, "session_id");
    messages(r.messages ?? [], "messages");
  },
  Compact(r: pb.CompactRequest__Output): void {
    id(r.sessionId, "session_id");
    id(r.sessionKey, "session_key");
  },
  AfterTurn(r: pb.AfterTurnRequest__Output): void {
    id(r.sessionId, "session_id");
    const list = r.messages ?? [];
    messages(list, "messages");
    if (Number(r.prePromptMessageCount ?? 0) > list.length) {
      throw invalid(
        "pre_prompt_message_count",
        `is ${r.prePromptMessageCount} but there are only ${list.length} messages`,
      );
    }
  },
  CommitTurn(r: pb.CommitTurnRequest__Output): void {
    id(r.sessionId, "session_id");
    id(r.advancementKey, "advancement_key");
    if (!r.admission) throw invalid("admission", "is required");
    if (r.admission.logicalTurnId !== r.advancementKey) {
      throw invalid("admission.logical_turn_id", "must equal advancement_key");
    }
    if (!r.terminal) throw invalid("terminal", "is required");
    generation(r.admission.anchor?.generation, "admission.anchor.generation");
    generation(r.terminal.generation, "terminal.generation");
    messages(r.messages ?? [], "messages");
  },
  Maintain(r: pb.MaintainRequest__Output): void {
    id(r.sessionId, "session_id");
  },
  PrepareSubagentSpawn(r: pb.PrepareSubagentSpawnRequest__Output): void {
    id(r.parentSessionKey, "parent_session_key");
    id(r.childSessionKey, "child_session_key");
    if (r.parentSessionKey === r.childSessionKey) {
      throw invalid("child_session_key", "must differ from parent_session_key");
    }
  },
  RollbackSubagentSpawn(r: pb.RollbackSubagentSpawnRequest__Output): void {
    id(r.rollbackToken, "rollback_token");
  },
  OnSubagentEnded(r: pb.OnSubagentEndedRequest__Output): void {
    id(r.childSessionKey, "child_session_key");
  },
  ForgetSession(r: pb.ForgetSessionRequest__Output): void {
    id(r.sessionId, "session_id");
  },
  CallTool(r: pb.CallToolRequest__Output): void {
    id(r.sessionId, "session_id");
    id(r.toolCallId, "tool_call_id");
    toolName(r.name ?? "", "name");
    const n = bytes(r.argumentsJson);
    if (n > L.MAX_TOOL_ARGUMENTS_BYTES) {
      throw tooLarge("arguments_json", `is ${n} bytes, the limit is ${L.MAX_TOOL_ARGUMENTS_BYTES}`);
    }
  },
  GetInfo(_r: pb.GetInfoRequest__Output): void {},
  Dispose(_r: pb.DisposeRequest__Output): void {},
} satisfies Record<Method, (r: never) => void>;

const enumIs = (v: unknown, name: string, num: number) => v === name || v === num;

/** Unicode category Cc, what Rust's `char::is_control` matches. */
const CONTROL = /[\u0000-\u001f\u007f-\u009f]/;

/** Result checks a caller applies to what an engine answered. */
export const result = {
  info(i: pb.EngineInfo): void {
    if (!i.id || i.id.trim() === "") throw invalid("info.id", "is blank");
    if (!i.name || i.name.trim() === "") throw invalid("info.name", "is blank");
    // They become log fields, metric labels and an audit caller.
    for (const [field, v] of [["info.id", i.id], ["info.name", i.name], ["info.version", i.version]] as const) {
      const n = bytes(v);
      if (n > L.MAX_ID_BYTES) throw tooLarge(field, `is ${n} bytes, the limit is ${L.MAX_ID_BYTES}`);
      if (v && CONTROL.test(v)) throw invalid(field, "contains a control character");
    }
    const major = (i.contractVersion ?? "").split(".")[0];
    if (major !== "1") {
      throw invalid("info.contract_version", `is ${JSON.stringify(i.contractVersion ?? "")}, this side speaks 1.x`);
    }
    const listed = i.implementedMethods ?? [];
    for (const m of REQUIRED_METHODS) {
      if (!listed.includes(m)) throw invalid("info.implemented_methods", `lacks required method ${m}`);
    }
    const seen = new Set<Method>();
    for (const m of listed) {
      if (!isMethod(m)) throw invalid("info.implemented_methods", `names unknown method ${JSON.stringify(m)}`);
      if (seen.has(m)) throw invalid("info.implemented_methods", `lists ${m} twice`);
      seen.add(m);
    }
    const idem = i.transcriptSemantics?.turnAdvancementIdempotency;
    if (idem !== undefined && !enumIs(idem, "TURN_ADVANCEMENT_IDEMPOTENCY_UNSPECIFIED", 0) && !seen.has("CommitTurn")) {
      throw invalid(
        "info.transcript_semantics.turn_advancement_idempotency",
        "is declared but CommitTurn is not implemented",
      );
    }
    const declared = i.tools ?? [];
    if (declared.length > 0 && !seen.has("CallTool")) {
      throw invalid("info.tools", "are declared but CallTool is not implemented");
    }
    tools(declared, "info.tools");
    if (enumIs(i.historyDelivery, "HISTORY_DELIVERY_DELTA", 2) && !seen.has("IngestBatch")) {
      throw invalid(
        "info.history_delivery",
        "is DELTA but IngestBatch (the resync after a history gap) is not implemented",
      );
    }
  },
  assemble(r: pb.AssembleResult__Output, requestMessages: number): void {
    const list = r.messages ?? [];
    if (list.length === 0 && requestMessages > 0) {
      throw invalid("messages", "is empty although the request had history");
    }
    messages(list, "messages");
    toolPairs(list, "messages");
    const p = r.projection;
    if (p && enumIs(p.mode, "PROJECTION_MODE_THREAD_BOOTSTRAP", 2) && (!p.epoch || p.epoch.trim() === "")) {
      throw invalid("projection.epoch", "is required for thread_bootstrap");
    }
  },
  commitTurn(r: pb.CommitTurnResult__Output): void {
    const s = r.status as unknown;
    if (!enumIs(s, "COMMIT_STATUS_COMMITTED", 1) && !enumIs(s, "COMMIT_STATUS_DUPLICATE", 2)) {
      const n = typeof s === "string" ? ({ COMMIT_STATUS_UNSPECIFIED: 0 } as Record<string, number>)[s] ?? s : s;
      throw invalid("status", `invalid commitTurn result status: ${String(n)}`);
    }
  },
  callTool(r: pb.CallToolResult__Output): void {
    (r.content ?? []).forEach((p, i) => {
      if (partKind(p) !== "text") throw invalid(`content[${i}]`, "a tool's result carries text parts only");
    });
  },
  maintain(r: pb.MaintainResult__Output): void {
    (r.replacements ?? []).forEach((rep, i) => {
      const at = `replacements[${i}]`;
      if (!rep.message) throw invalid(`${at}.message`, "is required");
      message(rep.message, `${at}.message`);
      if (rep.message.id !== rep.entryId) throw invalid(`${at}.message.id`, "must equal entry_id");
    });
  },
};

export { METHODS };
