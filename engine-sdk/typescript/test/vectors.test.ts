// The shared validation vectors (proto/testdata): every request is sent to
// a real server as its bytes and accepted or refused exactly as the vector
// says — the same status code and field path as the Rust SDK — and every
// engine reply is accepted or refused by the result checks; and fitBudget
// keeps of each budget vector what the Rust SDK's fit_budget keeps.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { after, before, describe, test } from "node:test";
import * as grpc from "@grpc/grpc-js";
import {
  type Bound,
  type ContextEngine,
  PACKAGE_ROOT_FOR_TESTS,
  engineService,
  fitBudget,
  messageType,
  type pb,
  serve,
  validateResult,
} from "./sdk.js";

interface Vector {
  name: string;
  method: string;
  request?: unknown;
  result?: unknown;
  requestMessages?: number;
  expect: { ok?: boolean; code?: string; field?: string };
}

const TESTDATA = join(PACKAGE_ROOT_FOR_TESTS, "..", "..", "proto", "testdata");

function load(file: string): Vector[] {
  return JSON.parse(readFileSync(join(TESTDATA, file), "utf8")) as Vector[];
}

/** Expands {"$repeat": s, "times": n, "then"?: t} into its string. */
function expand(v: unknown): unknown {
  if (Array.isArray(v)) return v.map(expand);
  if (v && typeof v === "object") {
    const o = v as Record<string, unknown>;
    if ("$repeat" in o) return String(o["$repeat"]).repeat(Number(o["times"])) + String(o["then"] ?? "");
    return Object.fromEntries(Object.entries(o).map(([k, x]) => [k, expand(x)]));
  }
  return v;
}

/** Accepts everything: a vector that passes validation answers OK. */
const acceptAll: ContextEngine = {
  getInfo: async () => ({ id: "vectors", name: "vectors", contractVersion: "1.0", implementedMethods: ["GetInfo", "Ingest", "Assemble", "Compact"] }),
  ingest: async () => ({ ingested: true }),
  ingestBatch: async () => ({ ingestedCount: 0 }),
  assemble: async () => ({ messages: [], estimatedTokens: 0 }),
  compact: async () => ({ result: { ok: true, compacted: false, tokensBefore: 0 } }),
  bootstrap: async () => ({ bootstrapped: false }),
  afterTurn: async () => ({}),
  commitTurn: async () => ({ status: "COMMIT_STATUS_COMMITTED" }),
  maintain: async () => ({}),
  prepareSubagentSpawn: async () => ({ prepared: false }),
  rollbackSubagentSpawn: async () => ({}),
  onSubagentEnded: async () => ({}),
  forgetSession: async () => ({}),
  callTool: async () => ({ content: [{ text: "ok" }] }),
};

const CODES: Record<number, string> = { [grpc.status.INVALID_ARGUMENT]: "INVALID_ARGUMENT", [grpc.status.RESOURCE_EXHAUSTED]: "RESOURCE_EXHAUSTED" };

describe("shared validation vectors", () => {
  let bound: Bound;
  let client: grpc.Client;
  before(async () => {
    bound = await serve(acceptAll, "127.0.0.1:0");
    client = new grpc.Client(bound.address, grpc.credentials.createInsecure(), { "grpc.max_send_message_length": 64 * 1024 * 1024 });
  });
  after(async () => {
    client.close();
    await bound.shutdown();
  });

  /** The vector's request as bytes, sent as they are; the status it got. */
  function send(v: Vector): Promise<grpc.ServiceError | null> {
    const type = messageType(`${v.method}Request`);
    const bytes = Buffer.from(type.encode(type.fromObject(expand(v.request) as Record<string, unknown>)).finish());
    const def = engineService[v.method]!;
    const identity = (b: Buffer) => b;
    return new Promise((resolve) => {
      if (def.responseStream) {
        const call = client.makeServerStreamRequest(def.path, identity, identity, bytes, new grpc.Metadata(), { deadline: Date.now() + 10_000 });
        call.on("data", () => {});
        call.on("error", (e: grpc.ServiceError) => resolve(e));
        call.on("end", () => resolve(null));
      } else {
        client.makeUnaryRequest(def.path, identity, identity, bytes, new grpc.Metadata(), { deadline: Date.now() + 10_000 }, (e) => resolve(e));
      }
    });
  }

  test("every request vector is accepted or refused as it says, with the Rust SDK's code and field path", async () => {
    const cases = load("requests.json");
    assert.ok(cases.length >= 40, "the vectors are all there");
    const problems: string[] = [];
    for (const v of cases) {
      const err = await send(v);
      if (v.expect.ok) {
        if (err) problems.push(`${v.name}: refused (${err.code} ${err.details}), the vector accepts it`);
        continue;
      }
      if (!err) {
        problems.push(`${v.name}: accepted, the vector refuses it`);
        continue;
      }
      const code = CODES[err.code] ?? String(err.code);
      if (code !== v.expect.code || !err.details.startsWith(`${v.expect.field}: `)) {
        problems.push(`${v.name}: refused as ${code} "${err.details}", the vector says ${v.expect.code} at ${v.expect.field}`);
      }
    }
    assert.deepEqual(problems, []);
  });

  test("every result vector is accepted or refused as it says", () => {
    const cases = load("results.json");
    assert.ok(cases.length >= 30, "the vectors are all there");
    const decodeAs = (name: string, v: unknown) => {
      const t = messageType(name);
      return t.toObject(t.fromObject(expand(v) as Record<string, unknown>), { longs: Number, enums: String, defaults: true, oneofs: true });
    };
    const problems: string[] = [];
    for (const v of cases) {
      let got: { code: string; field: string } | undefined;
      try {
        switch (v.method) {
          case "GetInfo":
            validateResult.info(decodeAs("EngineInfo", v.result));
            break;
          case "Assemble":
            validateResult.assemble(decodeAs("AssembleResult", v.result) as never, v.requestMessages ?? 0);
            break;
          case "CommitTurn":
            validateResult.commitTurn(decodeAs("CommitTurnResult", v.result) as never);
            break;
          case "Maintain":
            validateResult.maintain(decodeAs("MaintainResult", v.result) as never);
            break;
          case "CallTool":
            validateResult.callTool(decodeAs("CallToolResult", v.result) as never);
            break;
          default:
            throw new Error(`no result check for ${v.method}`);
        }
      } catch (e) {
        const x = e as { code?: number; field?: string; message: string };
        if (x.field === undefined) throw e;
        got = { code: CODES[x.code!] ?? String(x.code), field: x.field };
      }
      if (v.expect.ok && got) problems.push(`${v.name}: refused (${got.code} at ${got.field}), the vector accepts it`);
      if (!v.expect.ok && !got) problems.push(`${v.name}: accepted, the vector refuses it`);
      if (!v.expect.ok && got && (got.code !== v.expect.code || got.field !== v.expect.field)) {
        problems.push(`${v.name}: refused as ${got.code} at ${got.field}, the vector says ${v.expect.code} at ${v.expect.field}`);
      }
    }
    assert.deepEqual(problems, []);
  });
});

interface BudgetVector {
  name: string;
  budget: number | null;
  messages: unknown[];
  kept: string[];
  estimatedTokens: number;
}

test("every budget vector keeps what it says", () => {
  const cases = JSON.parse(readFileSync(join(TESTDATA, "budget.json"), "utf8")) as BudgetVector[];
  assert.ok(cases.length >= 10, "the vectors are all there");
  const type = messageType("AgentMessage");
  const problems: string[] = [];
  for (const c of cases) {
    // Decoded as a call's messages are: 64-bit counts as numbers, enums by name.
    const messages = c.messages.map(
      (m) => type.toObject(type.fromObject(expand(m) as Record<string, unknown>), { longs: Number, enums: String, defaults: true, oneofs: true }) as pb.AgentMessage__Output,
    );
    const got = fitBudget(messages, c.budget);
    const kept = got.messages.map((m) => m.id);
    if (JSON.stringify([kept, got.estimatedTokens]) !== JSON.stringify([c.kept, c.estimatedTokens])) {
      problems.push(`${c.name}: kept ${JSON.stringify(kept)} (${got.estimatedTokens} tokens), the vector says ${JSON.stringify(c.kept)} (${c.estimatedTokens})`);
    }
  }
  assert.deepEqual(problems, []);
});
