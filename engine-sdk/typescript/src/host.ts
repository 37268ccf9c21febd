// The engine's side of the Host service: callbacks into the gateway,
// authorised by the grant that came with the current call
// (engine-sdk/rust/src/host.rs).
import { lookup } from "node:dns/promises";
import { isIP } from "node:net";
import * as grpc from "@grpc/grpc-js";
import type * as pb from "./gen/pb.js";
import type { CallContext } from "./context.js";
import { EngineError } from "./errors.js";
import { type Endpoint, grpcTarget, parseEndpoint, sameEndpoint, endpointString } from "./endpoint.js";
import { MAX_GRPC_MESSAGE_BYTES, MAX_TRANSCRIPT_BYTES, MAX_TRANSCRIPT_ENTRIES } from "./limits.js";
import { hostService } from "./proto.js";
import { TRACE_HEADER } from "./trace.js";

export const READ_TRANSCRIPT = "read_transcript";
export const LLM_COMPLETE = "llm_complete";

/** A host callback's deadline when the engine call has none. */
export const DEFAULT_CALLBACK_MS = 60_000;

/** A host endpoint as requests and --host-allow name it: `http://`,
 * `https://` (TLS) or bare `HOST:PORT`, or `unix:///PATH`. */
export interface HostEndpoint {
  https: boolean;
  endpoint: Endpoint;
  /** The host as written (the TLS server name). */
  host: string;
}

export function parseHostEndpoint(s: string): HostEndpoint {
  const https = s.startsWith("https://");
  const rest = https ? s.slice("https://".length) : s;
  const endpoint = parseEndpoint(rest);
  const bare = (rest.startsWith("http://") ? rest.slice(7) : rest).replace(/\/+$/, "");
  const colon = bare.lastIndexOf(":");
  const host = (colon > 0 ? bare.slice(0, colon) : bare).replace(/^\[|\]$/g, "");
  return { https, endpoint, host };
}

function hostEndpointString(h: HostEndpoint): string {
  return h.endpoint.kind !== "unix" && h.https ? `https://${endpointString(h.endpoint)}` : endpointString(h.endpoint);
}

/** Where the call came from: an IP address, or a local process on a unix socket. */
export type Peer = { kind: "ip"; ip: string } | { kind: "local" };

/** The peer of a grpc-js server call (`getPeer()`: "ADDR:PORT", or no
 * address for a unix socket). */
export function peerOf(getPeer: string): Peer {
  const colon = getPeer.lastIndexOf(":");
  const addr = (colon > 0 ? getPeer.slice(0, colon) : getPeer).replace(/^\[|\]$/g, "");
  return isIP(addr) ? { kind: "ip", ip: addr } : { kind: "local" };
}

function peerString(p: Peer): string {
  return p.kind === "ip" ? p.ip : "a local process on a unix socket";
}

/** The same address however it is written (`::ffff:127.0.0.1` is 127.0.0.1). */
function canonical(ip: string): string {
  const m = /^::ffff:(\d+\.\d+\.\d+\.\d+)$/i.exec(ip);
  return m ? m[1]! : ip.toLowerCase();
}

function isLoopback(ip: string): boolean {
  const c = canonical(ip);
  return c.startsWith("127.") || c === "::1";
}

/** A host endpoint the policy allows: where to dial (an address that was
 * checked, never a name resolved again later), and how. */
export interface Checked {
  dial: Endpoint;
  https: boolean;
  serverName: string;
}

/** Why a host endpoint was not called (the Rust SDK's wording). */
export class Refused extends Error {
  constructor(message: string) {
    super(message);
    this.name = "Refused";
  }
}

/**
 * Which host endpoints an engine calls back. A request names its host
 * endpoint, and whoever reaches the engine's port can send a request: an
 * engine that dialled whatever it was told could be made to connect
 * anywhere and hand over the grant. So an endpoint is called only when it
 * is on the allow-list (--host-allow) or, with no list, when it is the
 * address of the peer that made the call (a name is resolved once, here,
 * and the matched address is what gets dialled); a caller on a unix socket
 * is a local process, so loopback endpoints are its. A unix socket named by
 * a request is never dialled unless listed.
 */
export class HostPolicy {
  constructor(readonly allow: HostEndpoint[] = []) {}

  async check(endpoint: string, peer: Peer, withinMs: number): Promise<Checked> {
    let h: HostEndpoint;
    try {
      h = parseHostEndpoint(endpoint);
    } catch {
      throw new Refused(`host endpoint ${endpoint} is not a valid endpoint`);
    }
    const checked = (dial: Endpoint): Checked => ({ dial, https: h.https, serverName: h.host });
    if (this.allow.length > 0) {
      if (!this.allow.some((a) => a.https === h.https && sameEndpoint(a.endpoint, h.endpoint))) {
        throw new Refused(`host endpoint ${endpoint} is not on this engine's --host-allow list`);
      }
      return checked(h.endpoint);
    }
    let candidates: { ip: string; port: number }[] = [];
    switch (h.endpoint.kind) {
      case "unix":
        throw new Refused(
          `host endpoint ${endpoint} is a unix socket named by a request; only --host-allow can name one`,
        );
      case "tcp":
        candidates = [{ ip: h.endpoint.ip, port: h.endpoint.port }];
        break;
      case "host": {
        const port = h.endpoint.port;
        const name = h.endpoint.host;
        const found = await withTimeout(lookup(name, { all: true }), Math.min(withinMs, 2000)).catch(() => []);
        candidates = (found ?? []).map((a) => ({ ip: a.address, port }));
        break;
      }
    }
    const matched = candidates.find((a) =>
      peer.kind === "ip" ? canonical(a.ip) === canonical(peer.ip) : isLoopback(a.ip),
    );
    if (!matched) {
      throw new Refused(
        `host endpoint ${endpoint} is not the calling peer (${peerString(peer)}); start the engine with --host-allow ${endpoint} to trust it`,
      );
    }
    return checked({ kind: "tcp", ip: matched.ip, port: matched.port });
  }
}

function withTimeout<T>(p: Promise<T>, ms: number): Promise<T> {
  return new Promise<T>((resolve, reject) => {
    const t = setTimeout(() => reject(new Error("timed out")), ms);
    p.then(
      (v) => {
        clearTimeout(t);
        resolve(v);
      },
      (e: unknown) => {
        clearTimeout(t);
        reject(e instanceof Error ? e : new Error(String(e)));
      },
    );
  });
}

/** What https:// host endpoints need: the CA to trust (default: the
 * system roots) and a client certificate to present (mTLS). */
export interface HostTls {
  ca?: Buffer;
  cert?: Buffer;
  key?: Buffer;
}

/** Host endpoints remembered at most (more: start over). */
const MAX_HOST_CHANNELS = 64;

const HostClientCtor = grpc.makeGenericClientConstructor(hostService, "Host");

/** Clients to host endpoints, shared by all calls of one server, only for
 * endpoints the policy allows. */
export class HostChannels {
  private readonly clients = new Map<string, grpc.Client>();

  constructor(
    readonly policy: HostPolicy,
    readonly tls?: HostTls,
  ) {}

  /** A client for `access` from `peer`, or undefined when the call carries
   * no usable grant or names an endpoint the policy refuses (logged). */
  async client(access: pb.HostAccess__Output | null | undefined, peer: Peer, withinMs: number): Promise<HostClient | undefined> {
    if (!access) return undefined;
    const grant = access.grant;
    if (!grant || !grant.token) return undefined;
    let checked: Checked;
    try {
      checked = await this.policy.check(access.endpoint, peer, withinMs);
    } catch (e) {
      console.warn(`host callbacks refused for this call: ${e instanceof Error ? e.message : String(e)}`);
      return undefined;
    }
    const key = `${checked.https}|${endpointString(checked.dial)}|${checked.serverName}`;
    let client = this.clients.get(key);
    if (!client) {
      if (this.clients.size >= MAX_HOST_CHANNELS) {
        for (const c of this.clients.values()) c.close();
        this.clients.clear();
      }
      const options: grpc.ClientOptions = {
        "grpc.max_receive_message_length": MAX_GRPC_MESSAGE_BYTES,
        "grpc.max_send_message_length": MAX_GRPC_MESSAGE_BYTES,
      };
      let creds = grpc.credentials.createInsecure();
      if (checked.https) {
        creds = grpc.credentials.createSsl(this.tls?.ca ?? null, this.tls?.key ?? null, this.tls?.cert ?? null);
        options["grpc.ssl_target_name_override"] = checked.serverName;
        options["grpc.default_authority"] = checked.serverName;
      }
      client = new HostClientCtor(grpcTarget(checked.dial), creds, options);
      this.clients.set(key, client);
    }
    return new HostClient(client, grant);
  }

  close(): void {
    for (const c of this.clients.values()) c.close();
    this.clients.clear();
  }
}

type RawCall = grpc.ClientReadableStream<pb.TranscriptChunk__Output>;

/** What one read took so far, over all its pages, against the caps. */
interface Read {
  entries: pb.TranscriptEntry__Output[];
  /** Encoded bytes received. */
  bytes: number;
}

/** Calls the gateway back during one engine call: every request carries
 * the grant token, the engine call's remaining deadline (or
 * DEFAULT_CALLBACK_MS) and its trace. */
export class HostClient {
  constructor(
    private readonly client: grpc.Client,
    readonly grant: pb.Grant__Output,
  ) {}

  /** Whether the grant allows `operation` and has not expired. */
  allows(operation: string): boolean {
    const expires = Number(this.grant.expiresAtUnixMs ?? 0);
    return this.grant.operations.includes(operation) && (expires === 0 || expires > Date.now());
  }

  get sessionId(): string {
    return this.grant.sessionId;
  }

  private options(ctx: CallContext): { metadata: grpc.Metadata; options: grpc.CallOptions } {
    const metadata = new grpc.Metadata();
    if (ctx.span) metadata.set(TRACE_HEADER, ctx.span.toString());
    const left = ctx.remainingMs() ?? DEFAULT_CALLBACK_MS;
    return { metadata, options: { deadline: Date.now() + left } };
  }

  private failure(ctx: CallContext, operation: string, err: grpc.ServiceError): EngineError {
    if (ctx.remainingMs() === 0) return EngineError.deadlineExceeded();
    if (ctx.signal.aborted) return EngineError.cancelled();
    if (err.code === grpc.status.UNIMPLEMENTED) {
      return new EngineError(grpc.status.UNIMPLEMENTED, `${operation} is not implemented`);
    }
    const code = err.code === grpc.status.DEADLINE_EXCEEDED ? err.code : err.code === grpc.status.CANCELLED ? err.code : grpc.status.UNAVAILABLE;
    return new EngineError(code, `host callback ${operation} failed (${grpc.status[err.code] ?? err.code})`);
  }

  /** The grant's session transcript (or only its visible history),
   * collected page by page: the host answers one page a call, and the last
   * chunk's cursor asks for the next. At most MAX_TRANSCRIPT_ENTRIES entries
   * and MAX_TRANSCRIPT_BYTES over all pages, else RESOURCE_EXHAUSTED naming
   * the cap; each page is bounded by the engine call's remaining deadline
   * (DEFAULT_CALLBACK_MS when it has none). */
  async readTranscript(ctx: CallContext, visibleOnly = false): Promise<pb.TranscriptEntry__Output[]> {
    const read: Read = { entries: [], bytes: 0 };
    let cursor = "";
    do {
      cursor = await this.readPage(ctx, visibleOnly, cursor, 0, read);
    } while (cursor !== "");
    return read.entries;
  }

  /** One page: at most `limit` entries (0: as many as the host sends at
   * once) after `cursor` ("": from the start), and the cursor of the next
   * page ("": nothing follows). For sessions longer than the read caps;
   * one page is capped as readTranscript is. */
  async readTranscriptPage(
    ctx: CallContext,
    opts: { visibleOnly?: boolean; cursor?: string; limit?: number } = {},
  ): Promise<{ entries: pb.TranscriptEntry__Output[]; nextCursor: string }> {
    const read: Read = { entries: [], bytes: 0 };
    const nextCursor = await this.readPage(ctx, opts.visibleOnly ?? false, opts.cursor ?? "", opts.limit ?? 0, read);
    return { entries: read.entries, nextCursor };
  }

  /** Why the engine call ended, once it has (its signal's reason). */
  private aborted(ctx: CallContext): EngineError | undefined {
    if (!ctx.signal.aborted) return undefined;
    return ctx.signal.reason instanceof EngineError ? ctx.signal.reason : EngineError.cancelled();
  }

  /** One ReadTranscript call into `read`; the last chunk's cursor. */
  private readPage(ctx: CallContext, visibleOnly: boolean, cursor: string, limit: number, read: Read): Promise<string> {
    if (!this.allows(READ_TRANSCRIPT)) {
      return Promise.reject(EngineError.failedPrecondition(`the grant does not allow ${READ_TRANSCRIPT}`));
    }
    const aborted = this.aborted(ctx);
    if (aborted) return Promise.reject(aborted);
    const def = hostService.ReadTranscript!;
    const deserialize = (buf: Buffer): pb.TranscriptChunk__Output => {
      read.bytes += buf.length;
      return def.responseDeserialize(buf) as pb.TranscriptChunk__Output;
    };
    const req: pb.ReadTranscriptRequest = { grant: this.grant.token, sessionId: this.grant.sessionId, cursor, visibleOnly, limit };
    const { metadata, options } = this.options(ctx);
    const before = read.entries.length;
    return new Promise((resolve, reject) => {
      let last = "";
      let done = false;
      const call: RawCall = this.client.makeServerStreamRequest(
        def.path,
        def.requestSerialize,
        deserialize,
        req,
        metadata,
        options,
      );
      const finish = (err?: EngineError) => {
        if (done) return;
        done = true;
        ctx.signal.removeEventListener("abort", onAbort);
        if (err) {
          call.cancel();
          reject(err);
        } else if (last !== "" && (read.entries.length === before || last === cursor)) {
          // A page that says more follows must have moved past `cursor`, or
          // following it would ask for the same page again.
          reject(
            new EngineError(
              grpc.status.UNAVAILABLE,
              "host callback ReadTranscript: the host sent a page with no new entries and a cursor to more; stopped rather than read the same page again",
            ),
          );
        } else resolve(last);
      };
      const onAbort = () => finish(this.aborted(ctx) ?? EngineError.cancelled());
      ctx.signal.addEventListener("abort", onAbort, { once: true });
      call.on("data", (chunk: pb.TranscriptChunk__Output) => {
        if (done) return;
        read.entries.push(...chunk.entries);
        last = chunk.nextCursor;
        if (read.bytes > MAX_TRANSCRIPT_BYTES) {
          finish(
            new EngineError(
              grpc.status.RESOURCE_EXHAUSTED,
              `host callback ReadTranscript sent more than ${MAX_TRANSCRIPT_BYTES} bytes, the cap`,
            ),
          );
        } else if (read.entries.length > MAX_TRANSCRIPT_ENTRIES) {
          finish(
            new EngineError(
              grpc.status.RESOURCE_EXHAUSTED,
              `host callback ReadTranscript sent more than ${MAX_TRANSCRIPT_ENTRIES} entries, the cap`,
            ),
          );
        }
      });
      call.on("error", (err: grpc.ServiceError) => finish(this.failure(ctx, "ReadTranscript", err)));
      call.on("end", () => finish());
    });
  }

  /** One completion from the host's model. */
  llmComplete(ctx: CallContext, req: pb.LlmCompleteRequest): Promise<pb.LlmCompleteResult__Output> {
    if (!this.allows(LLM_COMPLETE)) {
      return Promise.reject(EngineError.failedPrecondition(`the grant does not allow ${LLM_COMPLETE}`));
    }
    const def = hostService.LlmComplete!;
    const { metadata, options } = this.options(ctx);
    return new Promise((resolve, reject) => {
      const onAbort = () => {
        call.cancel();
      };
      const call = this.client.makeUnaryRequest(
        def.path,
        def.requestSerialize,
        def.responseDeserialize,
        { ...req, grant: this.grant.token },
        metadata,
        options,
        (err: grpc.ServiceError | null, value?: unknown) => {
          ctx.signal.removeEventListener("abort", onAbort);
          if (err) reject(this.failure(ctx, "LlmComplete", err));
          else resolve(value as pb.LlmCompleteResult__Output);
        },
      );
      ctx.signal.addEventListener("abort", onAbort, { once: true });
    });
  }
}

export { hostEndpointString };
