// Generates the gateway client API's TypeScript types from the repository's
// proto/ (at build time, into ignored folders): copies the .proto files the
// plugin loads at run time into ./proto and runs proto-loader-gen-types
// into ./src/gen.
import { cpSync, existsSync, mkdirSync, rmSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { execFileSync } from "node:child_process";

const here = dirname(dirname(fileURLToPath(import.meta.url)));
const source = join(here, "..", "..", "proto");
const protoDir = join(here, "proto");
if (existsSync(join(source, "ctxgate"))) {
  rmSync(protoDir, { recursive: true, force: true });
  mkdirSync(protoDir, { recursive: true });
  for (const pkg of ["ctxgate", "contextengine"]) cpSync(join(source, pkg), join(protoDir, pkg), { recursive: true });
}
const gen = join(here, "src", "gen");
rmSync(gen, { recursive: true, force: true });
execFileSync(
  join(here, "node_modules", ".bin", "proto-loader-gen-types"),
  [
    "ctxgate/v1/harness.proto",
    "ctxgate/v1/gateway.proto",
    "--longs=Number",
    "--enums=String",
    "--defaults",
    "--oneofs",
    "--grpcLib=@grpc/grpc-js",
    "--importFileExtension=.js",
    "--outDir",
    gen,
    `--includeDirs=${protoDir}`,
  ],
  { stdio: "inherit" },
);
