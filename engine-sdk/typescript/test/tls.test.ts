// TLS and mTLS, and the certificate re-read while serving: new
// connections get the new certificate; a mistake keeps the running one.
import assert from "node:assert/strict";
import { copyFileSync, readFileSync, writeFileSync } from "node:fs";
import { connect } from "node:tls";
import { describe, test } from "node:test";
import * as grpc from "@grpc/grpc-js";
import { LiveServerTls, TlsError, certificateNames, checkHealth, serve } from "./sdk.js";
import { Probe, certificates, engineClient, unary } from "./helpers.js";

function fingerprint(port: number, ca: Buffer, cert?: Buffer, key?: Buffer): Promise<string> {
  return new Promise((resolve, reject) => {
    const s = connect({ host: "127.0.0.1", port, servername: "localhost", ca, ALPNProtocols: ["h2"], ...(cert && key ? { cert, key } : {}) }, () => {
      const fp = s.getPeerCertificate().fingerprint256;
      s.end();
      resolve(fp);
    });
    s.on("error", reject);
  });
}

const tlsClient = (address: string, ca: Buffer, key?: Buffer, cert?: Buffer) =>
  engineClient(address, grpc.credentials.createSsl(ca, key ?? null, cert ?? null), {
    "grpc.ssl_target_name_override": "localhost",
    "grpc.default_authority": "localhost",
  });

describe("TLS", () => {
  test("serves TLS; with --tls-client-ca only clients with a certificate it signed are served", async () => {
    const c = certificates();
    const ca = readFileSync(c.ca);
    const tls = new LiveServerTls({ cert: { option: "--tls-cert", path: c.cert }, key: { option: "--tls-key", path: c.key } });
    const plain = await serve(new Probe(), "127.0.0.1:0", { tls });
    const c1 = tlsClient(plain.address, ca);
    assert.equal((await unary<{ id: string }>(c1, "GetInfo", {}, { deadlineMs: 5000 })).value?.id, "probe");
    c1.close();
    await plain.shutdown();

    const mtls = new LiveServerTls({
      cert: { option: "--tls-cert", path: c.cert },
      key: { option: "--tls-key", path: c.key },
      clientCa: { option: "--tls-client-ca", path: c.ca },
    });
    const bound = await serve(new Probe(), "127.0.0.1:0", { tls: mtls });
    try {
      const anonymous = tlsClient(bound.address, ca);
      const refused = await unary(anonymous, "GetInfo", {}, { deadlineMs: 5000 });
      assert.equal(refused.err?.code, grpc.status.UNAVAILABLE, "a client without a certificate is not served");
      anonymous.close();
      const known = tlsClient(bound.address, ca, readFileSync(c.clientKey), readFileSync(c.client));
      assert.equal((await unary<{ id: string }>(known, "GetInfo", {}, { deadlineMs: 5000 })).value?.id, "probe");
      known.close();
    } finally {
      await bound.shutdown();
    }
  });

  test("--tls-client-name serves only the named client; --health-listen serves health alone, on this machine only", async () => {
    const c = certificates();
    const ca = readFileSync(c.ca);
    const mtls = new LiveServerTls({
      cert: { option: "--tls-cert", path: c.cert },
      key: { option: "--tls-key", path: c.key },
      clientCa: { option: "--tls-client-ca", path: c.ca },
    });
    const bound = await serve(new Probe(), "127.0.0.1:0", { tls: mtls, clientNames: ["gateway"], healthListen: "127.0.0.1:0" });
    try {
      const gateway = tlsClient(bound.address, ca, readFileSync(c.clientKey), readFileSync(c.client));
      assert.equal((await unary<{ id: string }>(gateway, "GetInfo", {}, { deadlineMs: 5000 })).value?.id, "probe");
      gateway.close();
      const other = tlsClient(bound.address, ca, readFileSync(c.otherKey), readFileSync(c.other));
      const refused = await unary(other, "GetInfo", {}, { deadlineMs: 5000 });
      assert.equal(refused.err?.code, grpc.status.UNAUTHENTICATED, "a certificate naming another service is refused");
      assert.match(refused.err?.details ?? "", /names gateway/);
      other.close();

      const health = bound.healthOnly!.endpoint;
      assert.equal(health.kind, "tcp");
      const at = `127.0.0.1:${health.kind === "tcp" ? health.port : 0}`;
      assert.equal(await checkHealth(at, grpc.credentials.createInsecure(), {}, 3000), "SERVING");
      const plain = engineClient(at, grpc.credentials.createInsecure());
      const none = await unary(plain, "GetInfo", {}, { deadlineMs: 5000 });
      assert.equal(none.err?.code, grpc.status.UNIMPLEMENTED, "no engine method where health is served alone");
      plain.close();
    } finally {
      await bound.shutdown();
    }
    await assert.rejects(serve(new Probe(), "127.0.0.1:0", { healthListen: "0.0.0.0:0" }), /only on a loopback address/);
    for (const bad of ["*.example", "127.0.0.1", "", "gate way"]) {
      await assert.rejects(serve(new Probe(), "127.0.0.1:0", { tls: mtls, clientNames: [bad] }), /expected a DNS name/, bad);
    }
  });

  test("a client name matches a DNS subjectAltName exactly: no wildcard, no address, no other kind of name", () => {
    assert.equal(certificateNames("DNS:gateway, IP Address:127.0.0.1", ["gateway"]), true);
    assert.equal(certificateNames("DNS:GATEWAY", ["gateway"]), true, "case aside");
    assert.equal(certificateNames("DNS:*.internal", ["gateway.internal"]), false, "a wildcard names no one");
    assert.equal(certificateNames("URI:gateway, email:gateway", ["gateway"]), false);
    assert.equal(certificateNames("IP Address:127.0.0.1", ["127.0.0.1"]), false);
    assert.equal(certificateNames(undefined, ["gateway"]), false);
  });

  test("a reload serves the new certificate to new connections; a bad file keeps the running one", async () => {
    const c = certificates();
    const ca = readFileSync(c.ca);
    const tls = new LiveServerTls({ cert: { option: "--tls-cert", path: c.cert }, key: { option: "--tls-key", path: c.key } });
    const bound = await serve(new Probe(), "127.0.0.1:0", { tls });
    const port = Number(bound.address.split(":").pop());
    try {
      const first = await fingerprint(port, ca);
      copyFileSync(c.cert2, c.cert);
      copyFileSync(c.key2, c.key);
      assert.equal(bound.reloadTls(), true);
      const second = await fingerprint(port, ca);
      assert.notEqual(second, first, "new connections get the new certificate");
      writeFileSync(c.cert, "not a certificate");
      assert.equal(bound.reloadTls(), false);
      assert.equal(await fingerprint(port, ca), second, "a mistake keeps the running certificate");
      const client = tlsClient(bound.address, ca);
      assert.ok((await unary(client, "GetInfo", {}, { deadlineMs: 5000 })).value);
      client.close();
    } finally {
      await bound.shutdown();
    }
  });

  test("a file that cannot be used is a sentence naming its option", () => {
    const c = certificates();
    assert.throws(() => new LiveServerTls({ cert: { option: "--tls-cert", path: "/nonexistent.pem" }, key: { option: "--tls-key", path: c.key } }), (e: unknown) => e instanceof TlsError && /^--tls-cert \/nonexistent\.pem: /.test(e.message));
    assert.throws(() => new LiveServerTls({ cert: { option: "--tls-cert", path: c.cert }, key: { option: "--tls-key", path: c.ca } }), /--tls-key .* holds no PEM private key/);
    assert.throws(() => new LiveServerTls({ cert: { option: "--tls-cert", path: c.cert }, key: { option: "--tls-key", path: c.key2 } }), /--tls-cert and --tls-key: /);
  });
});
