// The command line every engine shares (the Rust SDK's ServeArgs):
// `--listen`, `--state-dir`, `--drain-seconds`, `--max-concurrent-calls`,
// `--host-allow` (repeatable), `--tls-cert`/`--tls-key`/`--tls-client-ca`,
// `--tls-client-name` (repeatable), `--health-listen`, `--host-ca`, `--otlp-endpoint`/`--otlp-service-name`, and the `health`
// subcommand. stdout carries exactly one line, `listening on ADDR`; logs
// go to stderr.
import { readFileSync } from "node:fs";
import { parseArgs, type ParseArgsConfig } from "node:util";
import * as grpc from "@grpc/grpc-js";
import type { ContextEngine } from "./engine.js";
import { CallContext } from "./context.js";
import { clientNameProblem, withTools } from "./service.js";
import { grpcTarget, isLocal, parseEndpoint } from "./endpoint.js";
import { type HostTls, HostPolicy, parseHostEndpoint } from "./host.js";
import { Exporter } from "./otlp.js";
import { ENGINE_SERVICE } from "./proto.js";
import { type Bound, DEFAULT_MAX_CONCURRENT_CALLS, serve } from "./server.js";
import { LiveServerTls, readPem } from "./tls.js";

export interface ServeArgs {
  listen: string;
  stateDir?: string;
  drainSeconds: number;
  maxConcurrentCalls: number;
  hostAllow: string[];
  tlsCert?: string;
  tlsKey?: string;
  tlsClientCa?: string;
  tlsClientNames: string[];
  healthListen?: string;
  hostCa?: string;
  otlpEndpoint?: string;
  otlpServiceName: string;
}

type Options = NonNullable<ParseArgsConfig["options"]>;

export const SERVE_OPTIONS = {
  listen: { type: "string", default: "127.0.0.1:0" },
  "state-dir": { type: "string" },
  "drain-seconds": { type: "string", default: "10" },
  "max-concurrent-calls": { type: "string", default: String(DEFAULT_MAX_CONCURRENT_CALLS) },
  "host-allow": { type: "string", multiple: true },
  "tls-cert": { type: "string" },
  "tls-key": { type: "string" },
  "tls-client-ca": { type: "string" },
  "tls-client-name": { type: "string", multiple: true },
  "health-listen": { type: "string" },
  "host-ca": { type: "string" },
  "otlp-endpoint": { type: "string" },
  "otlp-service-name": { type: "string" },
} satisfies Options;

export class UsageError extends Error {}

function count(name: string, text: string, min: number): number {
  if (!/^\d+$/.test(text) || Number(text) < min) throw new UsageError(`--${name}: ${JSON.stringify(text)} is not a number of at least ${min}`);
  return Number(text);
}

/** Parses the shared options plus an engine's own (`extra`); the values
 * of `extra` come back in `rest`. */
export function parseServeArgs(
  argv: string[],
  extra: Options = {},
): { serve: ServeArgs; rest: Record<string, string | boolean | string[] | boolean[] | undefined> } {
  let values: Record<string, string | boolean | string[] | boolean[] | undefined>;
  try {
    ({ values } = parseArgs({ args: argv, options: { ...SERVE_OPTIONS, ...extra }, strict: true, allowPositionals: false }));
  } catch (e) {
    throw new UsageError(e instanceof Error ? e.message : String(e));
  }
  const s = (k: string) => values[k] as string | undefined;
  const requires = (a: string, b: string) => {
    if (s(a) !== undefined && s(b) === undefined) throw new UsageError(`--${a} requires --${b}`);
  };
  requires("tls-cert", "tls-key");
  requires("tls-key", "tls-cert");
  requires("tls-client-ca", "tls-cert");
  const tlsClientNames = (values["tls-client-name"] as string[] | undefined) ?? [];
  if (tlsClientNames.length > 0 && s("tls-client-ca") === undefined) throw new UsageError("--tls-client-name needs --tls-client-ca");
  for (const n of tlsClientNames) {
    const problem = clientNameProblem(n);
    if (problem) throw new UsageError(problem);
  }
  const healthListen = s("health-listen");
  if (healthListen !== undefined) {
    let at;
    try {
      at = parseEndpoint(healthListen);
    } catch (e) {
      throw new UsageError(`--health-listen: ${e instanceof Error ? e.message : String(e)}`);
    }
    if (!isLocal(at)) throw new UsageError(`--health-listen ${healthListen}: health is served there without TLS or authentication, so only on a loopback address or a unix socket`);
  }
  const hostAllow = (values["host-allow"] as string[] | undefined) ?? [];
  for (const h of hostAllow) {
    try {
      parseHostEndpoint(h);
    } catch (e) {
      throw new UsageError(`--host-allow: ${e instanceof Error ? e.message : String(e)}`);
    }
  }
  const serveArgs: ServeArgs = {
    listen: s("listen")!,
    drainSeconds: count("drain-seconds", s("drain-seconds")!, 0),
    maxConcurrentCalls: count("max-concurrent-calls", s("max-concurrent-calls")!, 1),
    hostAllow,
    tlsClientNames,
    otlpServiceName: s("otlp-service-name") ?? process.env["OTEL_SERVICE_NAME"] ?? "ctxgate-engine",
  };
  const optional = { stateDir: "state-dir", tlsCert: "tls-cert", tlsKey: "tls-key", tlsClientCa: "tls-client-ca", healthListen: "health-listen", hostCa: "host-ca", otlpEndpoint: "otlp-endpoint" } as const;
  for (const [field, flag] of Object.entries(optional)) {
    const v = s(flag);
    if (v !== undefined) (serveArgs as unknown as Record<string, string>)[field] = v;
  }
  const rest: typeof values = {};
  for (const k of Object.keys(extra)) rest[k] = values[k];
  return { serve: serveArgs, rest };
}

/** Binds and serves `engine` as the arguments say (TLS, allow-list, spans). */
export async function serveWith(engine: ContextEngine, args: ServeArgs): Promise<Bound> {
  const tls =
    args.tlsCert && args.tlsKey
      ? new LiveServerTls({
          cert: { option: "--tls-cert", path: args.tlsCert },
          key: { option: "--tls-key", path: args.tlsKey },
          ...(args.tlsClientCa ? { clientCa: { option: "--tls-client-ca", path: args.tlsClientCa } } : {}),
        })
      : undefined;
  const hostTls: HostTls = {};
  if (args.hostCa) hostTls.ca = readPem({ option: "--host-ca", path: args.hostCa }, "certificate");
  if (args.tlsCert && args.tlsKey) {
    hostTls.cert = readPem({ option: "--tls-cert", path: args.tlsCert }, "certificate");
    hostTls.key = readPem({ option: "--tls-key", path: args.tlsKey }, "key");
  }
  let spans: Exporter | undefined;
  if (args.otlpEndpoint) {
    try {
      spans = new Exporter(args.otlpEndpoint, args.otlpServiceName);
    } catch (e) {
      throw new UsageError(`--otlp-endpoint: ${e instanceof Error ? e.message : String(e)}`);
    }
  }
  return serve(engine, args.listen, {
    maxConcurrentCalls: args.maxConcurrentCalls,
    drainMs: args.drainSeconds * 1000,
    hostPolicy: new HostPolicy(args.hostAllow.map(parseHostEndpoint)),
    hostTls,
    ...(tls ? { tls, clientNames: args.tlsClientNames } : {}),
    ...(spans ? { spans } : {}),
    ...(args.healthListen !== undefined ? { healthListen: args.healthListen } : {}),
  });
}

/** Runs an engine as a process: `health` when it is the first argument;
 * otherwise binds, prints `listening on ADDR`, serves until SIGTERM or
 * Ctrl-C, drains and exits 0; SIGHUP re-reads the TLS files. `make` gets
 * the parsed arguments (and the engine's own options in `rest`). */
export async function serveMain(
  make: (args: ServeArgs, rest: Record<string, unknown>) => ContextEngine | Promise<ContextEngine>,
  options: {
    program?: string;
    extra?: Options;
    argv?: string[];
    /** Runs after the drain, before the process exits (release resources). */
    onShutdown?: () => Promise<void>;
  } = {},
): Promise<void> {
  const argv = options.argv ?? process.argv.slice(2);
  const program = options.program ?? "engine";
  if (argv[0] === "health") {
    process.exitCode = await healthMain(argv.slice(1), program);
    return;
  }
  let bound: Bound;
  try {
    const { serve: args, rest } = parseServeArgs(argv, options.extra);
    const engine = await make(args, rest);
    // The engine's own GetInfo must keep the contract: a bad tool
    // declaration is said now, with its field, not at the gateway's attach.
    withTools(engine, await engine.getInfo(CallContext.detached()));
    bound = await serveWith(engine, args);
    // SIGHUP re-reads the certificate (listened to before `listening on`
    // is printed, so an early one never kills a TLS engine).
    if (bound.tls) process.on("SIGHUP", () => bound.reloadTls());
  } catch (e) {
    console.error(`${program}: ${e instanceof Error ? e.message : String(e)}`);
    process.exit(2);
  }
  const stop = () => {
    console.error("shutdown requested, draining");
    void bound
      .shutdown()
      .then(() => options.onShutdown?.())
      .catch((e: unknown) => console.error(`${program}: shutdown: ${e instanceof Error ? e.message : String(e)}`))
      .then(() => process.exit(0));
  };
  // Listened to before `listening on` is printed: whoever reads that line
  // may stop the engine at once, and it drains.
  process.once("SIGTERM", stop);
  process.once("SIGINT", stop);
  process.stdout.write(`listening on ${bound.address}\n`);
}

/** `<engine> health --endpoint ADDR [--tls-ca PEM] [--tls-cert PEM --tls-key PEM] [--timeout-seconds N]`:
 * exit 0 when the engine reports SERVING, 1 otherwise. */
export async function healthMain(argv: string[], program: string): Promise<number> {
  let values: Record<string, string | undefined>;
  try {
    ({ values } = parseArgs({
      args: argv,
      options: {
        endpoint: { type: "string" },
        "timeout-seconds": { type: "string", default: "3" },
        "tls-ca": { type: "string" },
        "tls-cert": { type: "string" },
        "tls-key": { type: "string" },
      },
      strict: true,
    }) as { values: Record<string, string | undefined> });
    if (!values["endpoint"]) throw new Error("--endpoint is required");
  } catch (e) {
    console.error(`${program} health: ${e instanceof Error ? e.message : String(e)}`);
    return 2;
  }
  const endpoint = values["endpoint"]!;
  const secs = Number(values["timeout-seconds"]);
  const timeoutMs = Number.isFinite(secs) ? Math.min(60, Math.max(0.1, secs)) * 1000 : 3000;
  try {
    const h = parseHostEndpoint(endpoint);
    let creds = grpc.credentials.createInsecure();
    const channelOptions: grpc.ChannelOptions = {};
    if (h.https) {
      const ca = values["tls-ca"] ? readPem({ option: "--tls-ca", path: values["tls-ca"] }, "certificate") : null;
      const cert = values["tls-cert"] ? readFileSync(values["tls-cert"]) : null;
      const key = values["tls-key"] ? readFileSync(values["tls-key"]) : null;
      creds = grpc.credentials.createSsl(ca, key, cert);
      channelOptions["grpc.ssl_target_name_override"] = h.host;
      channelOptions["grpc.default_authority"] = h.host;
    }
    const status = await checkHealth(grpcTarget(h.endpoint), creds, channelOptions, timeoutMs);
    if (status === "SERVING") {
      process.stdout.write("SERVING\n");
      return 0;
    }
    console.error(`${program}: the engine at ${endpoint} reports ${status}`);
    return 1;
  } catch (e) {
    console.error(`${program}: the engine at ${endpoint} cannot be checked: ${e instanceof Error ? e.message : String(e)}`);
    return 1;
  }
}

/** One grpc.health.v1 Check of the engine service. */
export async function checkHealth(
  target: string,
  creds: grpc.ChannelCredentials,
  options: grpc.ChannelOptions,
  timeoutMs: number,
  service = ENGINE_SERVICE,
): Promise<string> {
  const client = new grpc.Client(target, creds, options);
  try {
    return await new Promise<string>((resolve, reject) => {
      client.makeUnaryRequest(
        "/grpc.health.v1.Health/Check",
        (v: { service: string }) => encodeHealthRequest(v.service),
        (b: Buffer) => decodeHealthStatus(b),
        { service },
        new grpc.Metadata(),
        { deadline: Date.now() + timeoutMs },
        (err: grpc.ServiceError | null, value?: string) => (err ? reject(new Error(err.details || err.message)) : resolve(value!)),
      );
    });
  } finally {
    client.close();
  }
}

/** HealthCheckRequest { string service = 1; } */
function encodeHealthRequest(service: string): Buffer {
  const s = Buffer.from(service, "utf8");
  if (s.length === 0) return Buffer.alloc(0);
  return Buffer.concat([Buffer.from([0x0a]), varint(s.length), s]);
}

function varint(n: number): Buffer {
  const out: number[] = [];
  while (n > 0x7f) {
    out.push((n & 0x7f) | 0x80);
    n >>>= 7;
  }
  out.push(n);
  return Buffer.from(out);
}

const STATUSES = ["UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN"];

/** HealthCheckResponse { ServingStatus status = 1; } */
function decodeHealthStatus(b: Buffer): string {
  let status = 0;
  for (let i = 0; i < b.length; ) {
    const tag = b[i++]!;
    if (tag === 0x08) {
      let v = 0;
      let shift = 0;
      let byte: number;
      do {
        byte = b[i++]!;
        v |= (byte & 0x7f) << shift;
        shift += 7;
      } while (byte & 0x80);
      status = v;
    } else break;
  }
  return STATUSES[status] ?? String(status);
}
