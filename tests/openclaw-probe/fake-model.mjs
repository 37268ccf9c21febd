// A local OpenAI-compatible model for the real OpenClaw: POST
// /v1/chat/completions, streamed (SSE, with a usage chunk when asked) or
// not, always answering REPLY; GET /v1/models lists "fake-model". Listens on
// 127.0.0.1 (a free port) and prints `listening on 127.0.0.1:PORT`; every
// request is logged to stderr as one line.
//   node fake-model.mjs
import { createServer } from "node:http";

const REPLY = "Noted: the probe heard you.";
const MODEL = "fake-model";

function usage(body) {
  const prompt = Math.ceil(JSON.stringify(body.messages ?? []).length / 4);
  const completion = Math.ceil(REPLY.length / 4);
  return { prompt_tokens: prompt, completion_tokens: completion, total_tokens: prompt + completion };
}

const server = createServer((req, res) => {
  let raw = "";
  req.setEncoding("utf8");
  req.on("data", (c) => (raw += c));
  req.on("end", () => {
    let body = {};
    try {
      body = raw ? JSON.parse(raw) : {};
    } catch {
      body = {};
    }
    const path = (req.url ?? "").split("?")[0];
    process.stderr.write(`fake-model: ${req.method} ${path}${body.stream ? " (stream)" : ""}\n`);
    if (req.method === "GET" && /\/models$/.test(path)) {
      res.writeHead(200, { "content-type": "application/json" });
      res.end(JSON.stringify({ object: "list", data: [{ id: MODEL, object: "model", owned_by: "local" }] }));
      return;
    }
    if (req.method !== "POST" || !/\/chat\/completions$/.test(path)) {
      res.writeHead(404, { "content-type": "application/json" });
      res.end(JSON.stringify({ error: { message: `no route ${req.method} ${path}`, type: "not_found" } }));
      return;
    }
    const id = `chatcmpl-${Date.now()}`;
    const created = Math.floor(Date.now() / 1000);
    const model = body.model ?? MODEL;
    if (!body.stream) {
      res.writeHead(200, { "content-type": "application/json" });
      res.end(
        JSON.stringify({
          id,
          object: "chat.completion",
          created,
          model,
          choices: [{ index: 0, message: { role: "assistant", content: REPLY }, finish_reason: "stop" }],
          usage: usage(body),
        }),
      );
      return;
    }
    res.writeHead(200, { "content-type": "text/event-stream", "cache-control": "no-cache", connection: "keep-alive" });
    const chunk = (choices, extra = {}) =>
      res.write(`data: ${JSON.stringify({ id, object: "chat.completion.chunk", created, model, choices, ...extra })}\n\n`);
    chunk([{ index: 0, delta: { role: "assistant", content: "" }, finish_reason: null }]);
    for (const piece of REPLY.match(/.{1,12}/g)) chunk([{ index: 0, delta: { content: piece }, finish_reason: null }]);
    chunk([{ index: 0, delta: {}, finish_reason: "stop" }]);
    if (body.stream_options?.include_usage) chunk([], { usage: usage(body) });
    res.end("data: [DONE]\n\n");
  });
});

server.listen(0, "127.0.0.1", () => {
  const { port } = server.address();
  process.stdout.write(`listening on 127.0.0.1:${port}\n`);
});
for (const sig of ["SIGTERM", "SIGINT"]) process.on(sig, () => server.close(() => process.exit(0)));
