// Every RPC of contextengine.v1.ContextEngine by its wire name (the same
// vocabulary as proto/src/method.rs).

export const METHODS = [
  "GetInfo",
  "Bootstrap",
  "Ingest",
  "IngestBatch",
  "Assemble",
  "Compact",
  "AfterTurn",
  "CommitTurn",
  "Maintain",
  "PrepareSubagentSpawn",
  "RollbackSubagentSpawn",
  "OnSubagentEnded",
  "Dispose",
  "ForgetSession",
  "CallTool",
] as const;

export type Method = (typeof METHODS)[number];

export const REQUIRED_METHODS: readonly Method[] = ["GetInfo", "Ingest", "Assemble", "Compact"];

export function isMethod(name: string): name is Method {
  return (METHODS as readonly string[]).includes(name);
}

/** The engine interface's name for a method (`IngestBatch` → `ingestBatch`). */
export function methodKey(m: Method): string {
  return m[0]!.toLowerCase() + m.slice(1);
}
