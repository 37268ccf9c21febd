// W3C trace context: the method's span is a child of the caller's, and
// with an OTLP endpoint it is exported to the collector.
import assert from "node:assert/strict";
import { describe, test } from "node:test";
import * as grpc from "@grpc/grpc-js";
import * as protoLoader from "@grpc/proto-loader";
import { Exporter, PACKAGE_ROOT_FOR_TESTS, TraceParent, serve } from "./sdk.js";
import { Probe, engineClient, sleep, unary } from "./helpers.js";

interface WireSpan {
  trace_id: Buffer;
  span_id: Buffer;
  parent_span_id: Buffer;
  name: string;
  kind: string;
  status: { code: string };
}

describe("trace context", () => {
  test("traceparent is continued: the method's span is the caller's child and is exported over OTLP", async () => {
    const def = protoLoader.loadSync("trace.proto", { keepCase: true, longs: String, enums: String, defaults: true, includeDirs: [`${PACKAGE_ROOT_FOR_TESTS}/otlp`] });
    const spans: WireSpan[] = [];
    const collector = new grpc.Server();
    collector.addService(def["opentelemetry.proto.collector.trace.v1.TraceService"] as grpc.ServiceDefinition, {
      Export: (call: grpc.ServerUnaryCall<{ resource_spans: { scope_spans: { spans: WireSpan[] }[] }[] }, unknown>, cb: grpc.sendUnaryData<unknown>) => {
        for (const r of call.request.resource_spans) for (const s of r.scope_spans) spans.push(...s.spans);
        cb(null, {});
      },
    });
    const port = await new Promise<number>((res, rej) => collector.bindAsync("127.0.0.1:0", grpc.ServerCredentials.createInsecure(), (e, p) => (e ? rej(e) : res(p))));
    const exporter = new Exporter(`http://127.0.0.1:${port}`, "ts-test-engine");
    const probe = new Probe();
    const bound = await serve(probe, "127.0.0.1:0", { spans: exporter });
    const client = engineClient(bound.address);
    try {
      const caller = TraceParent.root();
      const md = new grpc.Metadata();
      md.set("traceparent", caller.toString());
      assert.ok((await unary(client, "Assemble", { sessionId: "s", messages: [] }, { metadata: md })).value);
      const seen = probe.seen.at(-1)!;
      assert.equal(seen.traceparent, caller.toString());
      const own = TraceParent.parse(seen.spanOf)!;
      assert.equal(own.traceIdHex(), caller.traceIdHex());
      for (let i = 0; i < 40 && spans.length === 0; i++) await sleep(100);
      const span = spans.find((s) => s.name === "contextengine.v1.ContextEngine/Assemble");
      assert.ok(span, "the span reached the collector");
      assert.equal(Buffer.from(span.trace_id).toString("hex"), caller.traceIdHex());
      assert.equal(Buffer.from(span.parent_span_id).toString("hex"), caller.parentId.toString("hex"));
      assert.equal(Buffer.from(span.span_id).toString("hex"), own.parentId.toString("hex"));
      assert.equal(span.kind, "SPAN_KIND_SERVER");
      // An untraced call (an attach's GetInfo) is no span.
      await unary(client, "GetInfo", {});
      await sleep(1200);
      assert.equal(spans.filter((s) => s.name.endsWith("/GetInfo")).length, 0);
    } finally {
      client.close();
      await bound.shutdown();
      collector.forceShutdown();
    }
  });

  test("an invalid traceparent is ignored (a new trace starts upstream), never an error", async () => {
    assert.equal(TraceParent.parse("00-00000000000000000000000000000000-0000000000000001-01"), undefined);
    assert.equal(TraceParent.parse("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"), undefined);
    const t = TraceParent.parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")!;
    assert.equal(t.toString(), "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
    assert.equal(t.child().traceIdHex(), t.traceIdHex());
  });
});
