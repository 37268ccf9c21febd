// A local OpenAI-compatible model for the real OpenClaw: POST
// /v1/chat/completions, streamed (SSE, with a usage chunk when asked) or
// not, answering REPLY; GET /v1/models lists "fake-model". One tool use: a
// user message "Search history for WORD" when history_search is among the
// request's tools is answered with a call of history_search {query: WORD},
// and the tool's result with "History says: " and the result's text. A
// request to compress history (a context engine's summary through the
// gateway's model) is answered with SUMMARY and the request's first words.
// Listens on 127.0.0.1 (a free port) and prints `listening on
// 127.0.0.1:PORT`; every request is logged to stderr as one line.
//   node fake-model.mjs
import { createServer } from "node:http";

const REPLY = "Noted: the probe heard you.";
const SUMMARY = "Summary by the fake model:";
const MODEL = "fake-model";

function usage(body, reply) {
  const prompt = Math.ceil(JSON.stringify(body.messages ?? []).length / 4);
  const completion = Math.ceil(reply.length / 4);
  return { prompt_tokens: prompt, completion_tokens: completion, total_tokens: prompt + completion };
}

/** A message's text, whether content is a string or parts. */
const textOf = (m) =>
  typeof m?.content === "string" ? m.content : (m?.content ?? []).map((p) => (typeof p === "string" ? p : (p.text ?? ""))).join("");

/** What to answer `body`: text, or one tool call. */
function answer(body) {
  const messages = body.messages ?? [];
  if (messages.some((m) => m.role === "system" && /compress conversation history/.test(textOf(m)))) {
    const asked = messages.filter((m) => m.role === "user").map(textOf).join(" ");
    return { text: `${SUMMARY} ${asked.replace(/\s+/g, " ").slice(0, 300)}` };
  }
  // A tool's result since the model's last call (OpenClaw may add a user message of its own context after it).
  const result = messages.slice(messages.findLastIndex((m) => m.role === "assistant") + 1).find((m) => m.role === "tool");
  if (result) return { text: `History says: ${textOf(result).replace(/\s+/g, " ").slice(0, 600)}` };
  const offered = (body.tools ?? []).some((t) => t.function?.name === "history_search");
  // The turn's user messages: OpenClaw may add its own context as a user message after the prompt.
  const turnStart = messages.findLastIndex((m) => m.role !== "user") + 1;
  const prompt = messages.slice(turnStart).map(textOf).join("\n");
  const asked = /Search history for (\S+)/.exec(prompt);
  if (offered && asked) {
    const args = JSON.stringify({ query: asked[1].replace(/[.,;:!?]+$/, "") });
    return { text: "", call: { id: `call_${Date.now()}`, type: "function", function: { name: "history_search", arguments: args } } };
  }
  return { text: REPLY };
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
    const { text, call } = answer(body);
    const last = body.messages?.at(-1);
    const heard = `${body.tools?.length ?? 0} tools, last ${last?.role}: ${JSON.stringify(textOf(last).slice(0, 80))}`;
    process.stderr.write(`fake-model: (${heard}) ${call ? `calls ${call.function.name} ${call.function.arguments}` : `says ${text.slice(0, 60)}`}\n`);
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
          choices: [
            call
              ? { index: 0, message: { role: "assistant", content: null, tool_calls: [call] }, finish_reason: "tool_calls" }
              : { index: 0, message: { role: "assistant", content: text }, finish_reason: "stop" },
          ],
          usage: usage(body, text),
        }),
      );
      return;
    }
    res.writeHead(200, { "content-type": "text/event-stream", "cache-control": "no-cache", connection: "keep-alive" });
    const chunk = (choices, extra = {}) =>
      res.write(`data: ${JSON.stringify({ id, object: "chat.completion.chunk", created, model, choices, ...extra })}\n\n`);
    chunk([{ index: 0, delta: { role: "assistant", content: "" }, finish_reason: null }]);
    if (call) {
      chunk([{ index: 0, delta: { tool_calls: [{ index: 0, ...call }] }, finish_reason: null }]);
    } else {
      for (const piece of text.match(/.{1,12}/gs)) chunk([{ index: 0, delta: { content: piece }, finish_reason: null }]);
    }
    chunk([{ index: 0, delta: {}, finish_reason: call ? "tool_calls" : "stop" }]);
    if (body.stream_options?.include_usage) chunk([], { usage: usage(body, text) });
    res.end("data: [DONE]\n\n");
  });
});

server.listen(0, "127.0.0.1", () => {
  const { port } = server.address();
  process.stdout.write(`listening on 127.0.0.1:${port}\n`);
});
for (const sig of ["SIGTERM", "SIGINT"]) process.on(sig, () => server.close(() => process.exit(0)));
