// The contract, loaded once from the package's proto/ (copied from the
// repository's proto/ at build time): the gRPC service definitions and a
// protobufjs root for the messages the SDK encodes itself (status details).
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import * as grpc from "@grpc/grpc-js";
import * as protoLoader from "@grpc/proto-loader";
import protobuf from "protobufjs";

/** The package's root folder (dist/src/proto.js → ../..). */
export const PACKAGE_ROOT = join(dirname(fileURLToPath(import.meta.url)), "..", "..");
export const PROTO_DIR = join(PACKAGE_ROOT, "proto");
const OTLP_DIR = join(PACKAGE_ROOT, "otlp");

export const ENGINE_SERVICE = "contextengine.v1.ContextEngine";
export const HOST_SERVICE = "contextengine.v1.Host";

/** How messages look in JavaScript: camelCase fields, 64-bit integers as
 * numbers, enums by name, defaults filled in, `part` naming a oneof's
 * member. The generated types (pb) describe exactly this. */
export const LOADER_OPTIONS: protoLoader.Options = {
  keepCase: false,
  longs: Number,
  enums: String,
  defaults: true,
  oneofs: true,
  includeDirs: [PROTO_DIR],
};

export const CONTRACT_FILES = ["contextengine/v1/engine.proto", "contextengine/v1/host.proto"];

export const packageDefinition = protoLoader.loadSync(CONTRACT_FILES, LOADER_OPTIONS);
export const engineService = packageDefinition[ENGINE_SERVICE] as grpc.ServiceDefinition;
export const hostService = packageDefinition[HOST_SERVICE] as grpc.ServiceDefinition;

/** protobufjs types for encoding and decoding outside a call. */
export const root = new protobuf.Root();
root.resolvePath = (_origin, target) => (target.startsWith("/") ? target : join(PROTO_DIR, target));
root.loadSync(CONTRACT_FILES, { keepCase: false });
root.resolveAll();

export function messageType(name: string): protobuf.Type {
  return root.lookupType(`contextengine.v1.${name}`);
}

/** The OTLP trace service (otlp/trace.proto). */
export const otlpDefinition = protoLoader.loadSync("trace.proto", {
  ...LOADER_OPTIONS,
  keepCase: true,
  longs: String,
  includeDirs: [OTLP_DIR],
});
