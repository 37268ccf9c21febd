// Serving an engine: TCP or a unix socket (mode 0600), grpc.health.v1
// (NOT_SERVING while draining), reflection, TLS with reload, the
// concurrent-call cap and graceful drain (engine-sdk/rust/src/server.rs).
import { chmodSync, existsSync, rmSync } from "node:fs";
import * as grpc from "@grpc/grpc-js";
import * as protoLoader from "@grpc/proto-loader";
import { ReflectionService } from "@grpc/reflection";
import { HealthImplementation, protoPath as healthProtoPath } from "grpc-health-check";
import type { ContextEngine } from "./engine.js";
import { type Endpoint, endpointString, isLocal, parseEndpoint } from "./endpoint.js";
import { HostChannels, HostPolicy, type HostTls } from "./host.js";
import { MAX_GRPC_MESSAGE_BYTES } from "./limits.js";
import type { Exporter } from "./otlp.js";
import { ENGINE_SERVICE, engineService, packageDefinition } from "./proto.js";
import { ServiceState, clientNameProblem, handlers } from "./service.js";
import type { LiveServerTls } from "./tls.js";

export const DEFAULT_MAX_CONCURRENT_CALLS = 1024;
export const DEFAULT_DRAIN_MS = 10_000;

export interface ServerOptions {
  /** Engine calls served at once (default 1024); one more answers
   * RESOURCE_EXHAUSTED with grpc-retry-pushback-ms. GetInfo is never refused. */
  maxConcurrentCalls?: number;
  /** How long in-flight calls may finish once shutdown starts (default 10 s). */
  drainMs?: number;
  /** Which host endpoints calls may name (default: the calling peer's address). */
  hostPolicy?: HostPolicy;
  /** What https:// host endpoints need (CA, client certificate). */
  hostTls?: HostTls;
  /** Serve TLS (reloadable: LiveServerTls.reload). TCP only. */
  tls?: LiveServerTls;
  /** Export a span per traced engine method. */
  spans?: Exporter;
  /** With a client CA: serve engine calls only to a client whose
   * certificate names one of these (a DNS subjectAltName). */
  clientNames?: string[];
  /** Also serve grpc.health.v1, and nothing else, in plaintext here: a
   * loopback address or a unix socket. */
  healthListen?: string;
}

const healthDefinition = protoLoader.loadSync(healthProtoPath, { keepCase: true, longs: String, enums: String, defaults: true, oneofs: true });

/** A server bound to its address, serving. */
export class Bound {
  private stopped: Promise<void> | undefined;

  constructor(
    readonly server: grpc.Server,
    readonly endpoint: Endpoint,
    readonly health: HealthImplementation,
    private readonly state: ServiceState,
    private readonly drainMs: number,
    private readonly hosts: HostChannels,
    private readonly spans: Exporter | undefined,
    readonly tls: LiveServerTls | undefined,
    /** `healthListen`: health alone, in plaintext, and where. */
    readonly healthOnly?: { server: grpc.Server; endpoint: Endpoint },
  ) {}

  /** Re-reads the TLS files: new connections use them; a mistake keeps
   * the running certificate (logged). */
  reloadTls(): boolean {
    if (!this.tls) return false;
    try {
      this.tls.reload();
      console.error("SIGHUP: TLS certificate re-read; new connections use it");
      return true;
    } catch (e) {
      console.error(`SIGHUP: TLS certificate not re-read; keeping the running one: ${e instanceof Error ? e.message : String(e)}`);
      return false;
    }
  }

  /** `HOST:PORT` (port 0 resolved) or `unix:///PATH`. */
  get address(): string {
    return endpointString(this.endpoint);
  }

  /** Engine calls in flight now. */
  get inflight(): number {
    return this.state.inflight;
  }

  /** Reports the engine NOT_SERVING (a lost backend, say) or SERVING again. */
  setServing(serving: boolean): void {
    const s = serving ? "SERVING" : "NOT_SERVING";
    this.health.setStatus("", s);
    this.health.setStatus(ENGINE_SERVICE, s);
  }

  /** Drains: health NOT_SERVING, new engine calls refused (UNAVAILABLE),
   * in-flight calls given the drain time to finish; then the server stops. */
  shutdown(): Promise<void> {
    this.stopped ??= (async () => {
      this.state.draining = true;
      this.setServing(false);
      const timeout = new Promise<"timeout">((resolve) => setTimeout(() => resolve("timeout"), this.drainMs).unref());
      if ((await Promise.race([this.state.idle(), timeout])) === "timeout") {
        console.error(`drain timed out after ${this.drainMs} ms; dropping ${this.state.inflight} remaining call(s)`);
      }
      // Answers just handed over get to leave: stop accepting, let open
      // streams end, then cut what remains (health watchers).
      await new Promise<void>((resolve) => {
        const cut = setTimeout(resolve, 500);
        this.server.tryShutdown(() => {
          clearTimeout(cut);
          resolve();
        });
      });
      this.server.forceShutdown();
      this.healthOnly?.server.forceShutdown();
      this.hosts.close();
      await this.spans?.flush();
      this.spans?.close();
      for (const e of [this.endpoint, this.healthOnly?.endpoint]) {
        if (e?.kind === "unix" && existsSync(e.path)) rmSync(e.path, { force: true });
      }
    })();
    return this.stopped;
  }
}

/** Binds `listen` (HOST:PORT, port 0 allowed, or unix:///PATH) and serves `engine`. */
export async function serve(engine: ContextEngine, listen: string | Endpoint, options: ServerOptions = {}): Promise<Bound> {
  const endpoint = typeof listen === "string" ? parseEndpoint(listen) : listen;
  if (options.tls && endpoint.kind === "unix") {
    throw new Error("TLS is served over TCP only: --listen HOST:PORT with --tls-cert");
  }
  const badName = (options.clientNames ?? []).map(clientNameProblem).find((p) => p !== undefined);
  if (badName) throw new Error(badName);
  if ((options.clientNames ?? []).length > 0 && !options.tls?.files.clientCa) throw new Error("--tls-client-name needs --tls-client-ca");
  const healthAt = options.healthListen === undefined ? undefined : parseEndpoint(options.healthListen);
  if (healthAt && !isLocal(healthAt)) {
    throw new Error(`--health-listen ${options.healthListen}: health is served there without TLS or authentication, so only on a loopback address or a unix socket`);
  }
  const maxCalls = Math.max(1, options.maxConcurrentCalls ?? DEFAULT_MAX_CONCURRENT_CALLS);
  const hosts = new HostChannels(options.hostPolicy ?? new HostPolicy(), options.hostTls);
  const state = new ServiceState(engine, hosts, maxCalls, options.spans, options.clientNames ?? []);
  const server = new grpc.Server({
    "grpc.max_receive_message_length": MAX_GRPC_MESSAGE_BYTES,
    "grpc.max_send_message_length": MAX_GRPC_MESSAGE_BYTES,
  });
  server.addService(engineService, handlers(state));
  const health = new HealthImplementation({ "": "SERVING", [ENGINE_SERVICE]: "SERVING" });
  health.addToServer(server);
  new ReflectionService({ ...packageDefinition, ...healthDefinition }).addToServer(server);

  const local = await bindTo(server, endpoint, options.tls ?? grpc.ServerCredentials.createInsecure());
  let healthOnly: { server: grpc.Server; endpoint: Endpoint } | undefined;
  if (healthAt) {
    const healthServer = new grpc.Server();
    health.addToServer(healthServer);
    try {
      healthOnly = { server: healthServer, endpoint: await bindTo(healthServer, healthAt, grpc.ServerCredentials.createInsecure()) };
    } catch (e) {
      server.forceShutdown();
      throw e;
    }
  }
  return new Bound(server, local, health, state, options.drainMs ?? DEFAULT_DRAIN_MS, hosts, options.spans, options.tls, healthOnly);
}

/** Binds `endpoint` on `server` (a stale unix socket file is replaced; a
 * new one is made mode 0600); the address bound, port 0 resolved. */
async function bindTo(server: grpc.Server, endpoint: Endpoint, credentials: grpc.ServerCredentials): Promise<Endpoint> {
  let target: string;
  switch (endpoint.kind) {
    case "unix":
      if (existsSync(endpoint.path)) rmSync(endpoint.path, { force: true });
      target = `unix://${endpoint.path}`;
      break;
    case "tcp":
      target = endpoint.ip.includes(":") ? `[${endpoint.ip}]:${endpoint.port}` : `${endpoint.ip}:${endpoint.port}`;
      break;
    case "host":
      target = `${endpoint.host}:${endpoint.port}`;
      break;
  }
  const port = await new Promise<number>((resolve, reject) =>
    server.bindAsync(target, credentials, (err, p) => (err ? reject(err) : resolve(p))),
  );
  switch (endpoint.kind) {
    case "unix":
      chmodSync(endpoint.path, 0o600);
      return endpoint;
    case "tcp":
      return { kind: "tcp", ip: endpoint.ip, port };
    case "host":
      return { kind: "host", host: endpoint.host, port };
  }
}
