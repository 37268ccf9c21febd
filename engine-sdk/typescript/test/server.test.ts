// The SDK server's guarantees, seen from a real gRPC client: health and
// reflection, validation before engine code, the call cap with pushback,
// deadlines and client cancel reaching the method, a thrown error isolated
// to its call, Compact's one terminal event, the typed history gap, the
// engine's own GetInfo checked.
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import * as grpc from "@grpc/grpc-js";
import { type Bound, ENGINE_SERVICE, EngineError, HISTORY_GAP_TYPE_URL, checkHealth, gapOf, messageType, serve } from "./sdk.js";
import { Probe, compactStream, engineClient, sleep, unary } from "./helpers.js";

const user = (id: string, text = "hi") => ({ id, role: "ROLE_USER", content: [{ text }] });

describe("server", () => {
  let probe: Probe;
  let bound: Bound;
  let client: grpc.Client;
  before(async () => {
    probe = new Probe();
    bound = await serve(probe, "127.0.0.1:0", { maxConcurrentCalls: 2 });
    client = engineClient(bound.address);
  });
  after(async () => {
    client.close();
    await bound.shutdown();
  });

  test("health: grpc.health.v1 reports SERVING for \"\" and the engine service", async () => {
    for (const service of ["", ENGINE_SERVICE]) {
      const s = await checkHealth(bound.address, grpc.credentials.createInsecure(), {}, 2000, service);
      assert.equal(s, "SERVING");
    }
  });

  test("reflection lists the engine and health services", async () => {
    const c = new grpc.Client(bound.address, grpc.credentials.createInsecure());
    // ServerReflectionRequest { list_services = 7 } as bytes; the answer
    // holds the service names as strings.
    const req = Buffer.concat([Buffer.from([0x3a, 0x00])]);
    const names = await new Promise<string>((resolve, reject) => {
      const call = c.makeBidiStreamRequest("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", (b: Buffer) => b, (b: Buffer) => b, new grpc.Metadata(), {});
      let text = "";
      call.on("data", (b: Buffer) => {
        text += b.toString("latin1");
        call.end();
      });
      call.on("end", () => resolve(text));
      call.on("error", reject);
      call.write(req);
    });
    c.close();
    assert.match(names, /contextengine\.v1\.ContextEngine/);
    assert.match(names, /grpc\.health\.v1\.Health/);
  });

  test("validation: a bad request is refused with its field path before engine code runs", async () => {
    const before = probe.seen.length;
    const r = await unary(client, "Assemble", { sessionId: "s", messages: [user("a"), user("a")] });
    assert.equal(r.err?.code, grpc.status.INVALID_ARGUMENT);
    assert.equal(r.err?.details, 'messages[1].id: duplicates message id "a"');
    // An enum number outside Role (not in the shared vectors: JSON parsers differ).
    const t = messageType("IngestRequest");
    const bytes = Buffer.from(t.encode(t.fromObject({ sessionId: "s", message: { id: "m", role: 42, content: [{ text: "x" }] } })).finish());
    const raw = await new Promise<grpc.ServiceError | null>((resolve) =>
      client.makeUnaryRequest(`/${ENGINE_SERVICE}/Ingest`, (b: Buffer) => b, (b: Buffer) => b, bytes, (e) => resolve(e)),
    );
    assert.equal(raw?.code, grpc.status.INVALID_ARGUMENT);
    assert.equal(raw?.details, "message.role: unknown role 42");
    const big = await unary(client, "Ingest", { sessionId: "s", message: user("m", "x".repeat(1024 * 1024 + 1)) });
    assert.equal(big.err?.code, grpc.status.RESOURCE_EXHAUSTED);
    assert.match(big.err!.details, /^message\.content: is 1048577 bytes/);
    assert.equal(probe.seen.length, before, "the engine saw none of them");
  });

  test("an unimplemented optional method answers UNIMPLEMENTED", async () => {
    const r = await unary(client, "Bootstrap", { sessionId: "s" });
    assert.equal(r.err?.code, grpc.status.UNIMPLEMENTED);
  });

  test("the call cap: one call over it is RESOURCE_EXHAUSTED with grpc-retry-pushback-ms 50; GetInfo is always admitted", async () => {
    const first = probe.onStarted();
    const a = unary(client, "Assemble", { sessionId: "slow", messages: [user("a")] });
    await first;
    const second = probe.onStarted();
    const b = unary(client, "Assemble", { sessionId: "slow", messages: [user("a")] });
    await second;
    const c = await unary(client, "Assemble", { sessionId: "slow", messages: [user("a")] });
    assert.equal(c.err?.code, grpc.status.RESOURCE_EXHAUSTED);
    assert.equal(c.err?.details, "the engine is serving its limit of 2 concurrent calls");
    assert.deepEqual(c.err?.metadata.get("grpc-retry-pushback-ms"), ["50"]);
    const info = await unary<{ id: string }>(client, "GetInfo", {});
    assert.equal(info.value?.id, "probe");
    assert.ok((await a).value && (await b).value, "the admitted calls finish");
  });

  test("a client cancel reaches the method's AbortSignal within 50 ms", async () => {
    let call: grpc.ClientUnaryCall | undefined;
    const started = probe.onStarted();
    const pending = unary(client, "Assemble", { sessionId: "wait", messages: [user("a")] }, { onCall: (c) => (call = c) });
    await started;
    const entry = probe.seen[probe.seen.length - 1]!;
    const cancelledAt = Date.now();
    call!.cancel();
    const r = await pending;
    assert.equal(r.err?.code, grpc.status.CANCELLED);
    for (let i = 0; i < 50 && entry.abortedAt === undefined; i++) await sleep(5);
    assert.ok(entry.abortedAt !== undefined, "the method saw the cancel");
    assert.ok(entry.abortedAt - cancelledAt <= 50, `the cancel took ${entry.abortedAt - cancelledAt} ms`);
    assert.ok(entry.aborted instanceof EngineError && entry.aborted.code === grpc.status.CANCELLED);
  });

  test("a call over its deadline ends DEADLINE_EXCEEDED and the method sees the cancellation", async () => {
    const started = probe.onStarted();
    const r = unary(client, "Assemble", { sessionId: "wait", messages: [user("a")] }, { deadlineMs: 200 });
    await started;
    const entry = probe.seen[probe.seen.length - 1]!;
    assert.ok(entry.remainingMs !== undefined && entry.remainingMs <= 200 && entry.remainingMs > 0, `remaining ${entry.remainingMs}`);
    assert.equal((await r).err?.code, grpc.status.DEADLINE_EXCEEDED);
    for (let i = 0; i < 50 && entry.abortedAt === undefined; i++) await sleep(5);
    assert.ok(entry.aborted instanceof EngineError && entry.aborted.code === grpc.status.DEADLINE_EXCEEDED, `aborted with ${entry.aborted}`);
  });

  test("a thrown error is INTERNAL for that call only, without its detail; the server goes on", async () => {
    const r = await unary(client, "Assemble", { sessionId: "throw", messages: [user("a")] });
    assert.equal(r.err?.code, grpc.status.INTERNAL);
    assert.equal(r.err?.details, "Assemble failed inside the engine");
    const ok = await unary(client, "Assemble", { sessionId: "fine", messages: [user("a")] });
    assert.ok(ok.value);
  });

  test("Compact streams progress, then exactly one terminal event", async () => {
    const { events, err } = await compactStream(client, { sessionId: "s", sessionKey: "s" });
    assert.equal(err, undefined);
    assert.deepEqual(events.map((e) => e.event), ["progress", "progress", "progress", "result"]);
  });
});

describe("history gap", () => {
  test("EngineError.historyGap is FAILED_PRECONDITION with a google.rpc.Status-compatible HistoryGap detail", async () => {
    const bound = await serve(
      {
        getInfo: async () => ({ id: "g", name: "g", contractVersion: "1.0", implementedMethods: ["GetInfo", "Ingest", "Assemble", "Compact"] }),
        ingest: async () => ({ ingested: true }),
        compact: async () => ({ delegateToHost: {} }),
        assemble: async () => {
          throw EngineError.historyGap({ messageId: "m7", seq: 7, messageCount: 7, tokens: 70 });
        },
      },
      "127.0.0.1:0",
    );
    const client = engineClient(bound.address);
    const r = await unary(client, "Assemble", { sessionId: "s", messages: [], cursor: { messageId: "m9", seq: 9, messageCount: 9 } });
    assert.equal(r.err?.code, grpc.status.FAILED_PRECONDITION);
    const gap = gapOf(r.err!);
    assert.deepEqual(gap?.held, { messageId: "m7", seq: 7, messageCount: 7, tokens: 70 });
    // The detail is an RpcStatus whose one Any carries the type URL.
    const raw = r.err!.metadata.get("grpc-status-details-bin")[0] as Buffer;
    const rpc = messageType("RpcStatus").decode(raw) as unknown as { code: number; details: { typeUrl: string }[] };
    assert.equal(rpc.code, grpc.status.FAILED_PRECONDITION);
    assert.equal(rpc.details[0]?.typeUrl, HISTORY_GAP_TYPE_URL);
    assert.equal(gapOf({ code: grpc.status.FAILED_PRECONDITION, metadata: new grpc.Metadata() }), undefined, "text is not a detail");
    client.close();
    await bound.shutdown();
  });
});

describe("GetInfo", () => {
  test("tools() join the info with CallTool; a bad tool declaration is a clear error naming the field", async () => {
    const base = {
      getInfo: async () => ({ id: "t", name: "t", contractVersion: "1.0", implementedMethods: ["GetInfo", "Ingest", "Assemble", "Compact"] }),
      ingest: async () => ({ ingested: true }),
      assemble: async () => ({ messages: [], estimatedTokens: 0 }),
      compact: async () => ({ delegateToHost: {} }),
      callTool: async () => ({ content: [{ text: "ok" }] }),
    };
    const good = await serve({ ...base, tools: () => [{ name: "find_it", description: "d", parametersJsonSchema: "{}" }] }, "127.0.0.1:0");
    const c1 = engineClient(good.address);
    const info = await unary<{ tools: { name: string }[]; implementedMethods: string[] }>(c1, "GetInfo", {});
    assert.deepEqual(info.value?.tools.map((t) => t.name), ["find_it"]);
    assert.ok(info.value?.implementedMethods.includes("CallTool"));
    c1.close();
    await good.shutdown();

    const bad = await serve({ ...base, tools: () => [{ name: "not a name", parametersJsonSchema: "[]" }] }, "127.0.0.1:0");
    const c2 = engineClient(bad.address);
    try {
      const r = await unary(c2, "GetInfo", {});
      assert.equal(r.err?.code, grpc.status.INTERNAL);
      assert.equal(r.err?.details, `GetInfo: the engine's answer breaks the contract: info.tools[0].name: "not a name" is not 1 to 64 of [a-zA-Z0-9_-]`);
    } finally {
      c2.close();
      await bad.shutdown();
    }
  });
});
