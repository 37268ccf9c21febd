// OpenClaw's history split into the turns the plugin imports into a
// gateway that holds nothing of the session, and the bounded memory of
// sessions already settled.
import assert from "node:assert/strict";
import { describe, test } from "node:test";
import type { OcMessage } from "@ctxgate/engine-sdk/openclaw";
import { KnownSessions, turnsOf } from "../src/history.js";

const user = (text: string): OcMessage => ({ role: "user", content: text });
const assistant = (text: string): OcMessage => ({ role: "assistant", content: [{ type: "text", text }] });
const call = (id: string): OcMessage => ({ role: "assistant", content: [{ type: "toolCall", id, name: "read", arguments: {} }] });
const result = (id: string): OcMessage => ({ role: "toolResult", toolCallId: id, content: [{ type: "text", text: "ok" }] });

describe("turnsOf", () => {
  test("each turn runs from its user message to the next one, tool calls and results included", () => {
    const history = [user("a"), call("c1"), result("c1"), assistant("done a"), user("b"), assistant("done b")];
    assert.deepEqual(turnsOf(history), [
      { users: [history[0]], rest: history.slice(1, 4) },
      { users: [history[4]], rest: [history[5]] },
    ]);
  });

  test("user messages in a row open one turn together; a last turn with no answer is kept", () => {
    const history = [user("a"), user("a, again"), assistant("done"), user("unanswered")];
    assert.deepEqual(turnsOf(history), [
      { users: history.slice(0, 2), rest: [history[2]] },
      { users: [history[3]], rest: [] },
    ]);
  });

  test("a history that does not start with a user message is refused, with the role it starts with", () => {
    assert.deepEqual(turnsOf([assistant("hello"), user("a")]), { refused: "the history starts with a message of role assistant, not with a user message" });
  });

  test("no history, no turns", () => {
    assert.deepEqual(turnsOf([]), []);
  });
});

test("KnownSessions forgets everything past its bound rather than grow", () => {
  const known = new KnownSessions();
  for (let i = 0; i < 4_096; i++) known.add(`s${i}`);
  assert.ok(known.has("s0") && known.has("s4095"));
  known.add("one more");
  assert.ok(known.has("one more"));
  assert.ok(!known.has("s0"), "the bound was passed: it started over");
});
