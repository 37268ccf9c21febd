// Shared test helpers: a probe engine whose methods misbehave on request,
// a raw client for the engine service, a fake Host, certificates.
import { execFileSync } from "node:child_process";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import * as grpc from "@grpc/grpc-js";
import {
  type CallContext,
  type CompactOutcome,
  type ContextEngine,
  engineService,
  hostService,
  type pb,
  type Progress,
} from "../src/index.js";

/** Directories made by `tempDir`, removed when the test file's process exits. */
const made: string[] = [];
process.on("exit", () => {
  for (const dir of made) rmSync(dir, { recursive: true, force: true });
});

export function tempDir(prefix = "ctxgate-ts-"): string {
  const dir = mkdtempSync(join(tmpdir(), prefix));
  made.push(dir);
  return dir;
}

export const sleep = (ms: number) => new Promise<void>((r) => setTimeout(r, ms));

/** What the probe saw, in order. */
export interface Seen {
  method: string;
  session: string;
  aborted?: unknown;
  abortedAt?: number;
  remainingMs?: number | undefined;
  traceparent?: string;
  spanOf?: string;
  host?: boolean;
}

/**
 * An engine whose Assemble misbehaves by session id: "wait" waits for its
 * signal, "throw" throws, "slow" answers after 300 ms, "read" reads the
 * transcript through the host, "llm" calls LlmComplete.
 */
export class Probe implements ContextEngine {
  seen: Seen[] = [];
  started: (() => void)[] = [];

  onStarted(): Promise<void> {
    return new Promise((r) => this.started.push(r));
  }

  async getInfo(): Promise<pb.EngineInfo> {
    return { id: "probe", name: "probe", contractVersion: "1.0", implementedMethods: ["GetInfo", "Ingest", "Assemble", "Compact"] };
  }

  async ingest(): Promise<pb.IngestResult> {
    return { ingested: true };
  }

  async assemble(req: pb.AssembleRequest__Output, ctx: CallContext): Promise<pb.AssembleResult> {
    const entry: Seen = { method: "Assemble", session: req.sessionId, remainingMs: ctx.remainingMs(), host: ctx.host !== undefined };
    if (ctx.trace) entry.traceparent = ctx.trace.toString();
    if (ctx.span) entry.spanOf = ctx.span.toString();
    this.seen.push(entry);
    for (const s of this.started.splice(0)) s();
    const answer = { messages: req.messages, estimatedTokens: 1 };
    switch (req.sessionId) {
      case "wait":
        await new Promise<void>((resolve) => {
          ctx.signal.addEventListener("abort", () => {
            entry.aborted = ctx.signal.reason;
            entry.abortedAt = Date.now();
            resolve();
          });
        });
        return answer;
      case "throw":
        throw new Error("a bug: secret detail 42");
      case "slow":
        await sleep(300);
        return answer;
      case "slower":
        await sleep(3000);
        return answer;
      case "read": {
        if (!ctx.host) throw new Error("no host client");
        const entries = await ctx.host.readTranscript(ctx);
        return { messages: [{ id: "n", role: "ROLE_USER", content: [{ text: `${entries.length} entries` }] }], estimatedTokens: 1 };
      }
      case "llm": {
        if (!ctx.host) throw new Error("no host client");
        const r = await ctx.host.llmComplete(ctx, { messages: [{ role: "user", content: "hi" }], purpose: "test" });
        return { messages: [{ id: "n", role: "ROLE_ASSISTANT", content: [{ text: r.text }] }], estimatedTokens: 1 };
      }
      default:
        return answer;
    }
  }

  async compact(_req: pb.CompactRequest__Output, ctx: CallContext, progress: Progress): Promise<CompactOutcome> {
    for (let i = 1; i <= 3; i++) {
      await progress.report("summarising", i, 3);
      ctx.check();
    }
    return { result: { ok: true, compacted: true, tokensBefore: 10, tokensAfter: 5 } };
  }
}

const EngineClient = grpc.makeGenericClientConstructor(engineService, "ContextEngine");

export function engineClient(address: string, creds = grpc.credentials.createInsecure(), options: grpc.ClientOptions = {}): grpc.Client {
  return new EngineClient(address.startsWith("unix://") ? address : address, creds, {
    "grpc.max_send_message_length": 32 * 1024 * 1024,
    ...options,
  });
}

export interface CallResult<T> {
  err?: grpc.ServiceError;
  value?: T;
}

/** One unary call by method name, never throwing. */
export function unary<T = unknown>(
  client: grpc.Client,
  method: string,
  request: unknown,
  opts: { deadlineMs?: number; metadata?: grpc.Metadata; onCall?: (c: grpc.ClientUnaryCall) => void } = {},
): Promise<CallResult<T>> {
  const def = engineService[method]!;
  return new Promise((resolve) => {
    const call = client.makeUnaryRequest(
      def.path,
      def.requestSerialize,
      def.responseDeserialize,
      request,
      opts.metadata ?? new grpc.Metadata(),
      opts.deadlineMs === undefined ? {} : { deadline: Date.now() + opts.deadlineMs },
      (err: grpc.ServiceError | null, value?: unknown) => resolve(err ? { err } : { value: value as T }),
    );
    opts.onCall?.(call);
  });
}

export function compactStream(client: grpc.Client, request: pb.CompactRequest): Promise<{ events: pb.CompactEvent__Output[]; err?: grpc.ServiceError }> {
  const def = engineService["Compact"]!;
  return new Promise((resolve) => {
    const events: pb.CompactEvent__Output[] = [];
    const call = client.makeServerStreamRequest(def.path, def.requestSerialize, def.responseDeserialize, request, new grpc.Metadata(), {});
    call.on("data", (e: pb.CompactEvent__Output) => events.push(e));
    call.on("error", (err: grpc.ServiceError) => resolve({ events, err }));
    call.on("end", () => resolve({ events }));
  });
}

/** A fake gateway Host service. */
export interface FakeHost {
  server: grpc.Server;
  port: number;
  calls: { method: string; grant: string; deadline?: number; traceparent?: string }[];
  close(): void;
}

export async function fakeHost(
  impl: {
    readTranscript?: (call: grpc.ServerWritableStream<pb.ReadTranscriptRequest__Output, pb.TranscriptChunk>) => void;
    llmComplete?: (req: pb.LlmCompleteRequest__Output) => pb.LlmCompleteResult;
  } = {},
): Promise<FakeHost> {
  const server = new grpc.Server();
  const calls: FakeHost["calls"] = [];
  const note = (method: string, call: grpc.ServerUnaryCall<unknown, unknown> | grpc.ServerWritableStream<unknown, unknown>, grant: string) => {
    const d = call.getDeadline();
    const entry: FakeHost["calls"][number] = { method, grant };
    if (d instanceof Date) entry.deadline = d.getTime();
    else if (typeof d === "number" && Number.isFinite(d)) entry.deadline = d;
    const tp = call.metadata.get("traceparent")[0];
    if (tp) entry.traceparent = String(tp);
    calls.push(entry);
  };
  server.addService(hostService, {
    ReadTranscript: (call: grpc.ServerWritableStream<pb.ReadTranscriptRequest__Output, pb.TranscriptChunk>) => {
      note("ReadTranscript", call as never, call.request.grant);
      if (impl.readTranscript) return impl.readTranscript(call);
      call.write({ entries: [{ id: "e1", seq: 1, message: { id: "m1", role: "ROLE_USER", content: [{ text: "hi" }] } }] });
      call.end();
    },
    LlmComplete: (call: grpc.ServerUnaryCall<pb.LlmCompleteRequest__Output, pb.LlmCompleteResult>, cb: grpc.sendUnaryData<pb.LlmCompleteResult>) => {
      note("LlmComplete", call as never, call.request.grant);
      cb(null, impl.llmComplete ? impl.llmComplete(call.request) : { text: "from the host", model: "fake" });
    },
  });
  const port = await new Promise<number>((resolve, reject) =>
    server.bindAsync("127.0.0.1:0", grpc.ServerCredentials.createInsecure(), (e, p) => (e ? reject(e) : resolve(p))),
  );
  return { server, port, calls, close: () => server.forceShutdown() };
}

export function grant(token = "tok", operations = ["read_transcript", "llm_complete"]): pb.Grant {
  return { token, sessionId: "s", operations, expiresAtUnixMs: Date.now() + 60_000 };
}

/** A CA and certificates it signed (openssl), in a temp folder. */
export function certificates(): { dir: string; ca: string; cert: string; key: string; cert2: string; key2: string; client: string; clientKey: string; other: string; otherKey: string } {
  const dir = tempDir("ctxgate-ts-tls-");
  const run = (...args: string[]) => execFileSync("openssl", args, { cwd: dir, stdio: "pipe" });
  run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=test ca");
  const leaf = (name: string, cn: string, san = "DNS:localhost,IP:127.0.0.1") => {
    run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", `${name}.key`, "-out", `${name}.csr`, "-subj", `/CN=${cn}`);
    require_ext(dir, name, san);
    run("x509", "-req", "-in", `${name}.csr`, "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out", `${name}.pem`, "-days", "2", "-extfile", `${name}.ext`);
  };
  leaf("server", "localhost");
  leaf("server2", "localhost");
  // Clients named as services are: the gateway, and another service.
  leaf("client", "gateway", "DNS:gateway");
  leaf("other", "engine-lossless", "DNS:engine-lossless");
  return {
    dir,
    ca: join(dir, "ca.pem"),
    cert: join(dir, "server.pem"),
    key: join(dir, "server.key"),
    cert2: join(dir, "server2.pem"),
    key2: join(dir, "server2.key"),
    client: join(dir, "client.pem"),
    clientKey: join(dir, "client.key"),
    other: join(dir, "other.pem"),
    otherKey: join(dir, "other.key"),
  };
}

function require_ext(dir: string, name: string, san: string): void {
  writeFileSync(join(dir, `${name}.ext`), `subjectAltName=${san}\nextendedKeyUsage=serverAuth,clientAuth\n`);
}
