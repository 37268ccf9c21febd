// The gateway's client API as this plugin uses it: the Harness (one
// DriveTurn stream a turn) and the Gateway service (compaction, the
// transcript), loaded from the .proto files at run time, with the token
// on every call and TLS when the endpoint is https.
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import * as grpc from "@grpc/grpc-js";
import * as loader from "@grpc/proto-loader";
import type { ProtoGrpcType as GatewayProto } from "./gen/gateway.js";
import type { ProtoGrpcType as HarnessProto } from "./gen/harness.js";
import type { GatewayClient } from "./gen/ctxgate/v1/Gateway.js";
import type { HarnessClient } from "./gen/ctxgate/v1/Harness.js";
import type { PluginConfig } from "./config.js";

const PROTO = join(dirname(fileURLToPath(import.meta.url)), "..", "..", "proto");

/** The gateway's messages are large at most what its limits allow. */
const MAX_MESSAGE = 64 * 1024 * 1024;

export interface Gateway {
  harness: HarnessClient;
  gateway: GatewayClient;
  /** The token's metadata, fresh for each call. */
  metadata(): grpc.Metadata;
  close(): void;
}

export function connect(config: PluginConfig): Gateway {
  const options = { longs: Number, enums: String, defaults: true, oneofs: true, includeDirs: [PROTO] };
  const defs = loader.loadSync(["ctxgate/v1/harness.proto", "ctxgate/v1/gateway.proto"], options);
  const pkg = grpc.loadPackageDefinition(defs) as unknown as HarnessProto & GatewayProto;
  const credentials = config.tls ? grpc.credentials.createSsl(config.ca ?? null) : grpc.credentials.createInsecure();
  const channel = {
    "grpc.max_receive_message_length": MAX_MESSAGE,
    "grpc.max_send_message_length": MAX_MESSAGE,
    "grpc.keepalive_time_ms": 30_000,
  };
  const harness = new pkg.ctxgate.v1.Harness(config.target, credentials, channel);
  // One connection for both: the Gateway client shares the Harness client's channel.
  const gateway = new pkg.ctxgate.v1.Gateway(config.target, credentials, { ...channel, channelOverride: harness.getChannel() });
  return {
    harness,
    gateway,
    metadata() {
      const m = new grpc.Metadata();
      if (config.token) m.set("authorization", `Bearer ${config.token}`);
      return m;
    },
    close() {
      harness.close();
    },
  };
}

type UnaryMethod = "GetSession" | "GetTranscript" | "SpawnSubagent" | "EndSubagent";

/** A unary Gateway call answered within `timeoutMs`, or rejected with the gateway's status. */
export function unary<T>(gw: Gateway, method: UnaryMethod, request: object, timeoutMs: number): Promise<T> {
  type Call = (req: object, md: grpc.Metadata, opts: grpc.CallOptions, done: (e: grpc.ServiceError | null, v?: T) => void) => void;
  const call = gw.gateway[method] as unknown as Call;
  return new Promise((resolve, reject) =>
    call.call(gw.gateway, request, gw.metadata(), { deadline: Date.now() + timeoutMs }, (e, v) => (e ? reject(e) : resolve(v as T))),
  );
}

/** `call`'s answer, or undefined when the gateway has no such session (NOT_FOUND). */
export async function orNone<T>(call: Promise<T>): Promise<T | undefined> {
  try {
    return await call;
  } catch (e) {
    if ((e as grpc.ServiceError).code === grpc.status.NOT_FOUND) return undefined;
    throw e;
  }
}
