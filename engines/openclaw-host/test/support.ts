// What the host's tests share: the host as a child process, gRPC calls to
// it, and a fake gateway Host service (ReadTranscript from a list,
// LlmComplete from a script, every request recorded).
import assert from "node:assert/strict";
import { type ChildProcess, spawn, spawnSync } from "node:child_process";
import { mkdtempSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";
import * as grpc from "@grpc/grpc-js";
import { engineService, hostService, type pb } from "@ctxgate/engine-sdk";

export const HOST = join(dirname(fileURLToPath(import.meta.url)), "..", "..");
export const MAIN = join(HOST, "dist", "src", "main.js");
export const FIXTURES = join(HOST, "test", "fixtures");
export const temp = () => mkdtempSync(join(tmpdir(), "openclaw-host-"));

export function runToEnd(args: string[]) {
  return spawnSync(process.execPath, [MAIN, ...args], { encoding: "utf8", timeout: 60_000 });
}

export interface Running {
  child: ChildProcess;
  address: string;
  exited: Promise<number | null>;
  /** Everything the host wrote to stderr so far. */
  stderr(): string;
}

export async function start(args: string[]): Promise<Running> {
  const child = spawn(process.execPath, [MAIN, ...args], { stdio: ["ignore", "pipe", "pipe"] });
  let err = "";
  child.stderr!.on("data", (b: Buffer) => {
    err += b.toString("utf8");
    if (process.env["OPENCLAW_HOST_TEST_VERBOSE"]) process.stderr.write(b);
  });
  const exited = new Promise<number | null>((r) => child.on("exit", (c) => r(c)));
  const line = await new Promise<string>((resolve, reject) => {
    createInterface({ input: child.stdout! }).once("line", resolve);
    child.on("exit", (c) => reject(new Error(`exited ${c}: ${err}`)));
  });
  assert.match(line, /^listening on /);
  return { child, address: line.slice("listening on ".length), exited, stderr: () => err };
}

/**
 * SIGTERM once the host serves calls, and its exit code. (The SDK prints
 * `listening on` before it installs its SIGTERM handler: a signal sent the
 * moment the line arrives can kill the process before it drains. A call
 * answered means the handler is in place.)
 */
export async function stopHost(e: Running): Promise<number | null> {
  const client = new grpc.Client(e.address, grpc.credentials.createInsecure());
  try {
    await call(client, "GetInfo", {});
  } finally {
    client.close();
  }
  e.child.kill("SIGTERM");
  return e.exited;
}

export function call<T>(
  client: grpc.Client,
  method: string,
  request: unknown,
  deadlineMs = 10_000,
): Promise<{ err?: grpc.ServiceError; value?: T }> {
  const def = engineService[method]!;
  return new Promise((resolve) =>
    client.makeUnaryRequest(
      def.path,
      def.requestSerialize,
      def.responseDeserialize,
      request,
      new grpc.Metadata(),
      { deadline: Date.now() + deadlineMs },
      (err, value) => resolve(err ? { err } : { value: value as T }),
    ),
  );
}

/** A Compact call's events, in order. */
export function compact(client: grpc.Client, request: unknown): Promise<pb.CompactEvent__Output[]> {
  return new Promise((resolve, reject) => {
    const out: pb.CompactEvent__Output[] = [];
    const def = engineService["Compact"]!;
    const s = client.makeServerStreamRequest(
      def.path,
      def.requestSerialize,
      def.responseDeserialize,
      request,
      new grpc.Metadata(),
      {},
    );
    s.on("data", (ev: pb.CompactEvent__Output) => out.push(ev));
    s.on("end", () => resolve(out));
    s.on("error", reject);
  });
}

export interface FakeHost {
  port: number;
  /** Each LlmComplete's messages, joined. */
  prompts: string[];
  requests: pb.LlmCompleteRequest__Output[];
  close(): void;
}

/** A fake gateway Host: LlmComplete answers from `replies` ("done" after
 * them), ReadTranscript serves `transcript`. */
export async function fakeHost(replies: string[], transcript: pb.TranscriptEntry[] = []): Promise<FakeHost> {
  const server = new grpc.Server();
  const prompts: string[] = [];
  const requests: pb.LlmCompleteRequest__Output[] = [];
  server.addService(hostService, {
    // One page after the request's cursor, as the gateway answers: an
    // unknown cursor is INVALID_ARGUMENT.
    ReadTranscript: (c: grpc.ServerWritableStream<pb.ReadTranscriptRequest__Output, pb.TranscriptChunk>) => {
      const { cursor, limit } = c.request;
      const start = cursor ? transcript.findIndex((e) => e.id === cursor) + 1 : 0;
      if (start === 0 && cursor) {
        c.emit("error", { code: grpc.status.INVALID_ARGUMENT, details: "cursor: unknown entry" });
        return;
      }
      const page = transcript.slice(start, start + (limit || 1000));
      const more = start + page.length < transcript.length;
      if (page.length > 0) c.write({ entries: page, nextCursor: more ? page.at(-1)!.id! : "" });
      c.end();
    },
    LlmComplete: (
      c: grpc.ServerUnaryCall<pb.LlmCompleteRequest__Output, unknown>,
      cb: grpc.sendUnaryData<pb.LlmCompleteResult>,
    ) => {
      requests.push(c.request);
      prompts.push(c.request.messages.map((m) => m.content).join("\n"));
      cb(null, { text: replies.shift() ?? "done", model: "fake", provider: "test" });
    },
  });
  const port = await new Promise<number>((res, rej) =>
    server.bindAsync("127.0.0.1:0", grpc.ServerCredentials.createInsecure(), (e, p) => (e ? rej(e) : res(p))),
  );
  return { port, prompts, requests, close: () => server.forceShutdown() };
}

export const grant = (sessionId = "s1") => ({
  token: "t",
  sessionId,
  operations: ["read_transcript", "llm_complete"],
  expiresAtUnixMs: Date.now() + 60_000,
});
