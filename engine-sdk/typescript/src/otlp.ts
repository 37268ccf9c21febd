// Spans exported over OTLP/gRPC when --otlp-endpoint is given, best
// effort and bounded (engine-sdk/runtime/src/otlp.rs): at most QUEUE spans
// wait; more are dropped and counted. A batch goes out every second or at
// BATCH spans; a collector that fails loses that batch, never a call.
import * as grpc from "@grpc/grpc-js";
import { grpcTarget, parseEndpoint } from "./endpoint.js";
import { otlpDefinition } from "./proto.js";
import type { TraceParent } from "./trace.js";

export const QUEUE = 4096;
export const BATCH = 512;
const EVERY_MS = 1000;
const EXPORT_TIMEOUT_MS = 5000;

export interface Span {
  name: string;
  kind: "server" | "client";
  /** The trace, and this span's own id. */
  self: TraceParent;
  /** The caller's span id. */
  parent?: Buffer;
  startMs: number;
  endMs: number;
  attributes: [string, string][];
  error?: string;
}

const service = otlpDefinition["opentelemetry.proto.collector.trace.v1.TraceService"] as grpc.ServiceDefinition;
const TraceClient = grpc.makeGenericClientConstructor(service, "TraceService");

function kv(key: string, value: string) {
  return { key, value: { string_value: value } };
}

function nanos(ms: number): string {
  return (BigInt(Math.round(ms * 1000)) * 1000n).toString();
}

export class Exporter {
  private queue: Span[] = [];
  private timer: NodeJS.Timeout;
  private failing = false;
  private sending = false;
  dropped = 0;
  private readonly client: grpc.Client;

  constructor(
    readonly endpoint: string,
    readonly serviceName: string,
  ) {
    const parsed = parseEndpoint(endpoint);
    if (parsed.kind === "unix") throw new Error(`${JSON.stringify(endpoint)}: OTLP goes to http://HOST:PORT`);
    this.client = new TraceClient(grpcTarget(parsed), grpc.credentials.createInsecure());
    this.timer = setInterval(() => void this.flush(), EVERY_MS);
    this.timer.unref();
  }

  /** Queues a finished span (sampled traces only); drops it, counted, when full. */
  record(span: Span): void {
    if (!span.self.sampled) return;
    if (this.queue.length >= QUEUE) {
      this.dropped++;
      return;
    }
    this.queue.push(span);
    if (this.queue.length >= BATCH) void this.flush();
  }

  async flush(): Promise<void> {
    if (this.sending || this.queue.length === 0) return;
    this.sending = true;
    const batch = this.queue.splice(0, BATCH);
    const request = {
      resource_spans: [
        {
          resource: { attributes: [kv("service.name", this.serviceName)] },
          scope_spans: [
            {
              scope: { name: "ctxgate", version: "0.1.0" },
              spans: batch.map((s) => ({
                trace_id: s.self.traceId,
                span_id: s.self.parentId,
                parent_span_id: s.parent ?? Buffer.alloc(0),
                flags: s.self.flags,
                name: s.name,
                kind: s.kind === "server" ? "SPAN_KIND_SERVER" : "SPAN_KIND_CLIENT",
                start_time_unix_nano: nanos(s.startMs),
                end_time_unix_nano: nanos(s.endMs),
                attributes: s.attributes.map(([k, v]) => kv(k, v)),
                status: s.error
                  ? { message: s.error, code: "STATUS_CODE_ERROR" }
                  : { message: "", code: "STATUS_CODE_OK" },
              })),
            },
          ],
        },
      ],
    };
    const def = service.Export!;
    try {
      await new Promise<void>((resolve, reject) => {
        this.client.makeUnaryRequest(
          def.path,
          def.requestSerialize,
          def.responseDeserialize,
          request,
          new grpc.Metadata(),
          { deadline: Date.now() + EXPORT_TIMEOUT_MS },
          (err: grpc.ServiceError | null) => (err ? reject(err) : resolve()),
        );
      });
      if (this.failing) console.error(`OTLP export to ${this.endpoint} works again`);
      this.failing = false;
    } catch (e) {
      if (!this.failing) {
        console.error(
          `OTLP export to ${this.endpoint} failed (${batch.length} spans dropped until it works): ${e instanceof Error ? e.message : String(e)}`,
        );
      }
      this.failing = true;
    } finally {
      this.sending = false;
    }
  }

  close(): void {
    clearInterval(this.timer);
    this.client.close();
  }
}
