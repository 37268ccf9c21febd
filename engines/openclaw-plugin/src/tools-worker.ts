// The worker behind readToolsInWorker (tools.ts): asks the gateway's status
// for the selected engine's tools, posts them (or why not) and raises the
// flag the plugin's thread waits on.
import { readFileSync } from "node:fs";
import { type MessagePort, workerData } from "node:worker_threads";
import { parseConfig } from "./config.js";
import { connect } from "./gateway.js";
import type { StatusResult__Output } from "./gen/ctxgate/v1/StatusResult.js";
import { fromDefinitions } from "./tools.js";

const { rawConfig, port, done, timeoutMs } = workerData as {
  rawConfig: unknown;
  port: MessagePort;
  done: Int32Array;
  timeoutMs: number;
};

function reply(message: object): void {
  port.postMessage(message);
  Atomics.store(done, 0, 1);
  Atomics.notify(done, 0);
}

try {
  const gateway = connect(parseConfig(rawConfig, process.env, (p) => readFileSync(p)));
  gateway.gateway.GetStatus({}, gateway.metadata(), { deadline: Date.now() + timeoutMs }, (err, status?: StatusResult__Output) => {
    gateway.close();
    if (err || !status) return reply({ error: `the gateway's status: ${err?.details || err?.message}` });
    const engine = status.engines.find((e) => e.id === status.selectedEngine);
    reply({ tools: fromDefinitions(engine?.tools ?? []) });
  });
} catch (e) {
  reply({ error: (e as Error).message });
}
