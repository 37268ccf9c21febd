// The plugin's config: what it accepts, and one sentence naming the key
// for what it refuses.
import assert from "node:assert/strict";
import { describe, test } from "node:test";
import { DEFAULT_TIMEOUTS, parseConfig } from "../src/config.js";

const noFile = (p: string): Buffer => {
  throw new Error(`ENOENT: ${p}`);
};

describe("the plugin's config", () => {
  test("an endpoint alone: plaintext, fallback, the default timeouts", () => {
    assert.deepEqual(parseConfig({ endpoint: "127.0.0.1:7300" }, {}, noFile), {
      target: "127.0.0.1:7300",
      tls: false,
      onGatewayDown: "fallback",
      timeouts: DEFAULT_TIMEOUTS,
    });
  });
  test("https with a CA, a token from the environment, strict, a timeout", () => {
    const c = parseConfig(
      { endpoint: "https://gw.example:443", caFile: "/ca.pem", tokenEnv: "T", onGatewayDown: "strict", timeouts: { assembleMs: 900 } },
      { T: "secret" },
      () => Buffer.from("PEM"),
    );
    assert.equal(c.target, "gw.example:443");
    assert.equal(c.tls, true);
    assert.equal(c.ca?.toString(), "PEM");
    assert.equal(c.token, "secret");
    assert.equal(c.onGatewayDown, "strict");
    assert.equal(c.timeouts.assembleMs, 900);
    assert.equal(c.timeouts.commitMs, DEFAULT_TIMEOUTS.commitMs);
  });
  const refused: [string, unknown, RegExp][] = [
    ["no config", undefined, /must be an object/],
    ["no endpoint", {}, /endpoint is required/],
    ["no port", { endpoint: "gw.example" }, /endpoint must be host:port/],
    ["a path", { endpoint: "http://gw:1/x" }, /endpoint must be host:port/],
    ["an unknown key", { endpoint: "gw:1", endpont: "x" }, /endpont is not a setting/],
    ["a CA on plaintext", { endpoint: "gw:1", caFile: "/ca.pem" }, /caFile needs an https:\/\/ endpoint/],
    ["an unreadable CA", { endpoint: "https://gw:1", caFile: "/nope.pem" }, /caFile cannot be read: ENOENT/],
    ["both tokens", { endpoint: "gw:1", token: "a", tokenEnv: "T" }, /tokenEnv and token are exclusive/],
    ["an unset token variable", { endpoint: "gw:1", tokenEnv: "UNSET" }, /tokenEnv names UNSET, which is not set/],
    ["a bad mode", { endpoint: "gw:1", onGatewayDown: "maybe" }, /onGatewayDown must be "fallback" or "strict"/],
    ["a zero timeout", { endpoint: "gw:1", timeouts: { commitMs: 0 } }, /timeouts.commitMs must be milliseconds/],
    ["an unknown timeout", { endpoint: "gw:1", timeouts: { foreverMs: 1 } }, /timeouts.foreverMs is not a timeout/],
  ];
  for (const [what, raw, message] of refused) {
    test(`refused: ${what}`, () => {
      assert.throws(() => parseConfig(raw, {}, noFile), (e: Error) => e.name === "ConfigError" && message.test(e.message));
    });
  }
});
