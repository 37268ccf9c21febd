#!/usr/bin/env node
// The example engine as a process:
//   node dist/example/main.js --listen 127.0.0.1:0 --state-dir DIR
//   node dist/example/main.js health --endpoint 127.0.0.1:PORT
import { serveMain } from "../src/index.js";
import { ExampleEngine } from "./engine.js";

await serveMain((args) => new ExampleEngine(args.stateDir), { program: "ctxgate-engine-ts-example" });
