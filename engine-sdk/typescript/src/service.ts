// The ContextEngine service over an engine: each call is refused while
// draining, validated, admitted under the concurrent-call cap, given its
// CallContext (deadline and cancellation as an AbortSignal, the host
// client, the trace) and run isolated: whatever the method throws is that
// call's status, never a crashed server (engine-sdk/rust/src/service.rs).
import { isIP } from "node:net";
import * as grpc from "@grpc/grpc-js";
import { CallContext } from "./context.js";
import type { CompactOutcome, ContextEngine, Progress } from "./engine.js";
import { EngineError } from "./errors.js";
import type * as pb from "./gen/pb.js";
import { type HostChannels, peerOf } from "./host.js";
import { METHODS, type Method, methodKey } from "./method.js";
import type { Exporter } from "./otlp.js";
import { ENGINE_SERVICE } from "./proto.js";
import { TRACE_HEADER, TraceParent } from "./trace.js";
import { Violation, request as checks, result as resultChecks } from "./validate.js";

/** How long a refused caller is asked to wait (`grpc-retry-pushback-ms`). */
export const PUSHBACK_MS = 50;

/** What the service shares across calls. */
export class ServiceState {
  inflight = 0;
  draining = false;
  private idleWaiters: (() => void)[] = [];

  constructor(
    readonly engine: ContextEngine,
    readonly hosts: HostChannels,
    readonly maxCalls: number,
    readonly spans: Exporter | undefined,
    /** `--tls-client-name`: the names a client's certificate must carry one of. */
    readonly clientNames: readonly string[] = [],
  ) {}

  acquire(): void {
    this.inflight++;
  }

  release(): void {
    this.inflight--;
    if (this.inflight === 0) {
      const waiters = this.idleWaiters;
      this.idleWaiters = [];
      for (const w of waiters) w();
    }
  }

  /** Resolves once no engine call is in flight. */
  idle(): Promise<void> {
    if (this.inflight === 0) return Promise.resolve();
    return new Promise((resolve) => this.idleWaiters.push(resolve));
  }
}

interface StatusLike {
  code: grpc.status;
  details: string;
  metadata?: grpc.Metadata;
}

function status(code: grpc.status, details: string, metadata?: grpc.Metadata): StatusLike {
  return metadata ? { code, details, metadata } : { code, details };
}

/** The answer to a call over the limit: overload, with a retry pushback. */
function overLimit(max: number): StatusLike {
  const md = new grpc.Metadata();
  md.set("grpc-retry-pushback-ms", String(PUSHBACK_MS));
  return status(grpc.status.RESOURCE_EXHAUSTED, `the engine is serving its limit of ${max} concurrent calls`, md);
}

/** Whatever a method threw, as the call's status: an EngineError as it
 * says, anything else INTERNAL with the detail logged. */
export function statusOf(method: Method, err: unknown): StatusLike {
  if (err instanceof EngineError) return status(err.code, err.message, err.metadata);
  if (err instanceof Violation) return status(err.code, err.message);
  console.error(`engine method ${method} failed: ${err instanceof Error ? (err.stack ?? err.message) : String(err)}`);
  return status(grpc.status.INTERNAL, `${method} failed inside the engine`);
}

type AnyCall = grpc.ServerUnaryCall<unknown, unknown> | grpc.ServerWritableStream<unknown, unknown>;

/** Why `name` cannot be a `--tls-client-name`, if it cannot: a DNS name
 * (letters, digits, `-` and `.`), matched exactly, so no wildcard and no IP
 * address (every SDK applies this rule). */
export function clientNameProblem(name: string): string | undefined {
  const dns = name.length > 0 && name.length <= 253 && name.split(".").every((l) => /^[A-Za-z0-9-]+$/.test(l));
  if (dns && isIP(name) === 0) return undefined;
  return `--tls-client-name ${JSON.stringify(name)}: expected a DNS name (matched exactly against a DNS subjectAltName of the client's certificate; no wildcard, no IP address)`;
}

/** Whether a certificate's subjectAltName (Node's "DNS:a, IP Address:b"
 * form) carries one of `names` as a DNS name, exactly (case aside; a
 * wildcard it presents matches nothing). */
export function certificateNames(subjectAltName: string | undefined, names: readonly string[]): boolean {
  const presented = (subjectAltName ?? "")
    .split(",")
    .map((s) => s.trim())
    .filter((s) => s.startsWith("DNS:"))
    .map((s) => s.slice("DNS:".length).toLowerCase());
  return presented.some((p) => names.some((n) => p === n.toLowerCase()));
}

/** The first gate every call passes: the client's name, draining,
 * validation, the cap. */
function gate(state: ServiceState, method: Method, call: AnyCall): StatusLike | undefined {
  const req = call.request;
  // grpc-js has no hook in the handshake (the CA was checked there): each
  // engine call checks the verified certificate's names.
  if (state.clientNames.length > 0 && !certificateNames(call.getAuthContext().sslPeerCertificate?.subjectaltname, state.clientNames)) {
    return status(grpc.status.UNAUTHENTICATED, `this engine serves only a client whose certificate names ${state.clientNames.join(" or ")}`);
  }
  if (state.draining) return status(grpc.status.UNAVAILABLE, "the engine is draining (shutting down)");
  try {
    (checks[method] as (r: unknown) => void)(req);
  } catch (e) {
    if (e instanceof Violation) return status(e.code, e.message);
    return statusOf(method, e);
  }
  if (method !== "GetInfo" && state.inflight >= state.maxCalls) {
    console.warn(`engine call ${method} refused: at the concurrent-call limit`);
    return overLimit(state.maxCalls);
  }
  return undefined;
}

interface Started {
  ctx: CallContext;
  abort: AbortController;
  finished: (error?: string) => void;
}

/** The call's context: deadline, cancellation, host client, trace. */
async function begin(state: ServiceState, method: Method, call: AnyCall, host: pb.HostAccess__Output | null | undefined): Promise<Started> {
  const abort = new AbortController();
  const raw = call.getDeadline();
  const deadlineMs = raw instanceof Date ? raw.getTime() : typeof raw === "number" && Number.isFinite(raw) ? raw : undefined;
  let timer: NodeJS.Timeout | undefined;
  if (deadlineMs !== undefined) {
    timer = setTimeout(() => abort.abort(EngineError.deadlineExceeded()), Math.max(0, deadlineMs - Date.now()));
  }
  // The caller's deadline passes before ours: its clock started when it
  // sent the call, ours when the call's headers were read (later by the
  // time the call waited in a busy event loop), and the caller's cancel
  // at its deadline reaches us before our own timer fires. A cancel within
  // a quarter of the call's time (10 to 250 ms) of the deadline is the
  // deadline.
  const slackMs = deadlineMs === undefined ? 0 : Math.min(250, Math.max(10, (deadlineMs - Date.now()) / 4));
  const onCancel = () => {
    const over = deadlineMs !== undefined && Date.now() >= deadlineMs - slackMs;
    abort.abort(over ? EngineError.deadlineExceeded() : EngineError.cancelled());
  };
  call.on("cancelled", onCancel);
  if (call.cancelled) onCancel();
  const incoming = TraceParent.parse(String(call.metadata.get(TRACE_HEADER)[0] ?? ""));
  const span = incoming?.child();
  const start = Date.now();
  const within = deadlineMs === undefined ? 2000 : Math.max(0, deadlineMs - Date.now());
  const client = await state.hosts.client(host, peerOf(call.getPeer()), within);
  const ctx = new CallContext(abort.signal, deadlineMs, client, incoming, span);
  const finished = (error?: string) => {
    if (timer) clearTimeout(timer);
    call.removeListener("cancelled", onCancel);
    if (state.spans && incoming && span) {
      state.spans.record({
        name: `${ENGINE_SERVICE}/${method}`,
        kind: "server",
        self: span,
        parent: incoming.parentId,
        startMs: start,
        endMs: Date.now(),
        attributes: [
          ["rpc.system", "grpc"],
          ["rpc.method", method],
        ],
        ...(error === undefined ? {} : { error }),
      });
    }
  };
  return { ctx, abort, finished };
}

/** The method's promise raced against the call's end: a cancelled or
 * timed-out call answers at once; the method keeps its slot until it
 * settles (it saw the signal). */
function race<T>(work: Promise<T>, signal: AbortSignal): Promise<T> {
  if (signal.aborted) return Promise.reject(signal.reason as unknown);
  return new Promise<T>((resolve, reject) => {
    const onAbort = () => reject(signal.reason as unknown);
    signal.addEventListener("abort", onAbort, { once: true });
    work.then(
      (v) => {
        signal.removeEventListener("abort", onAbort);
        resolve(v);
      },
      (e: unknown) => {
        signal.removeEventListener("abort", onAbort);
        reject(e);
      },
    );
  });
}

function invoke<T>(fn: () => Promise<T>): Promise<T> {
  try {
    return Promise.resolve(fn());
  } catch (e) {
    return Promise.reject(e);
  }
}

type UnaryImpl = (req: never, ctx: CallContext) => Promise<unknown>;

function hostOf(req: unknown): pb.HostAccess__Output | null | undefined {
  return (req as { host?: pb.HostAccess__Output | null }).host;
}

/** GetInfo with the engine's tools joined in and the answer checked. */
async function getInfo(engine: ContextEngine, ctx: CallContext): Promise<pb.EngineInfo> {
  const info = await engine.getInfo(ctx);
  return withTools(engine, info);
}

/** The engine's info with `tools()` added (and CallTool listed) when the
 * info declares none itself; checked against the contract. */
export function withTools(engine: ContextEngine, info: pb.EngineInfo): pb.EngineInfo {
  const out = { ...info, implementedMethods: [...(info.implementedMethods ?? [])] };
  if ((out.tools ?? []).length === 0 && engine.tools) {
    out.tools = engine.tools();
    if (out.tools.length > 0 && !out.implementedMethods.includes("CallTool")) out.implementedMethods.push("CallTool");
  }
  try {
    resultChecks.info(out);
  } catch (e) {
    if (!(e instanceof Violation)) throw e;
    // The engine's own answer breaks the contract: its fault, said with the field.
    throw new EngineError(grpc.status.INTERNAL, `GetInfo: the engine's answer breaks the contract: ${e.message}`);
  }
  return out;
}

function unaryHandler(state: ServiceState, method: Method): grpc.handleUnaryCall<unknown, unknown> {
  const engine = state.engine;
  const impl: UnaryImpl | undefined =
    method === "GetInfo"
      ? (_req, ctx) => getInfo(engine, ctx)
      : method === "Dispose"
        ? engine.dispose
          ? (_req, ctx) => engine.dispose!(ctx)
          : undefined
        : ((engine as unknown as Record<string, UnaryImpl | undefined>)[methodKey(method)]?.bind(engine) as UnaryImpl | undefined);
  return (call, callback) => {
    const refused = gate(state, method, call);
    if (refused) {
      callback(refused);
      return;
    }
    if (!impl) {
      callback(status(grpc.status.UNIMPLEMENTED, `${method} is not implemented`));
      return;
    }
    state.acquire();
    void (async () => {
      let started: Started | undefined;
      let settled: Promise<void> = Promise.resolve();
      try {
        started = await begin(state, method, call, hostOf(call.request));
        const { ctx } = started;
        const work = invoke(() => impl(call.request as never, ctx));
        // The slot is held while the work runs (abandoned work included)
        // and until its answer is handed to the transport.
        settled = work.then(
          () => {},
          () => {},
        );
        const value = await race(work, ctx.signal);
        started.finished();
        callback(null, value);
      } catch (e) {
        const s = statusOf(method, e);
        started?.finished(s.details);
        callback(s);
      } finally {
        void settled.then(() => state.release());
      }
    })();
  };
}

function compactHandler(state: ServiceState): grpc.handleServerStreamingCall<unknown, unknown> {
  const engine = state.engine;
  return (call) => {
    const fail = (s: StatusLike) => call.emit("error", s);
    const refused = gate(state, "Compact", call);
    if (refused) {
      fail(refused);
      return;
    }
    state.acquire();
    void (async () => {
      let started: Started | undefined;
      let settled: Promise<void> = Promise.resolve();
      try {
        started = await begin(state, "Compact", call, hostOf(call.request));
        const { ctx } = started;
        const progress: Progress = {
          report: async (stage, done, total, message = "") => {
            ctx.check();
            const event: pb.CompactEvent = { progress: { stage, done, total, message } };
            if (!call.write(event)) {
              await new Promise<void>((resolve, reject) => {
                const onDrain = () => {
                  ctx.signal.removeEventListener("abort", onAbort);
                  resolve();
                };
                const onAbort = () => {
                  call.removeListener("drain", onDrain);
                  reject(ctx.signal.reason as unknown);
                };
                call.once("drain", onDrain);
                ctx.signal.addEventListener("abort", onAbort, { once: true });
              });
            }
          },
        };
        const work = invoke(() => engine.compact(call.request as pb.CompactRequest__Output, ctx, progress));
        settled = work.then(
          () => {},
          () => {},
        );
        const outcome: CompactOutcome = await race(work, ctx.signal);
        started.finished();
        // Exactly one terminal event, then the stream ends OK.
        const terminal: pb.CompactEvent =
          "result" in outcome ? { result: outcome.result } : { delegateToHost: outcome.delegateToHost };
        call.write(terminal);
        call.end();
      } catch (e) {
        const s = statusOf("Compact", e);
        started?.finished(s.details);
        if (!call.cancelled) fail(s);
      } finally {
        void settled.then(() => state.release());
      }
    })();
  };
}

/** Every handler of the ContextEngine service. */
export function handlers(state: ServiceState): grpc.UntypedServiceImplementation {
  const out: grpc.UntypedServiceImplementation = {};
  // Every method but Compact, the one server-streaming call.
  const unary = METHODS.filter((m) => m !== "Compact");
  for (const m of unary) out[m] = unaryHandler(state, m);
  out["Compact"] = compactHandler(state);
  return out;
}
