// TLS from PEM files, every mistake a sentence naming the option that gave
// the file (engine-sdk/runtime/src/tls.rs). The server's credentials can be
// re-read while it serves (SIGHUP): new connections use the new
// certificate; a mistake keeps the running one.
import { readFileSync } from "node:fs";
import { createSecureContext, type SecureContextOptions } from "node:tls";
import { ServerCredentials } from "@grpc/grpc-js";

export class TlsError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "TlsError";
  }
}

/** A PEM file and the option that named it. */
export interface Pem {
  option: string;
  path: string;
}

export function readPem(p: Pem, what: "certificate" | "key" | "any" = "any"): Buffer {
  let data: Buffer;
  try {
    data = readFileSync(p.path);
  } catch (e) {
    throw new TlsError(`${p.option} ${p.path}: ${e instanceof Error ? e.message : String(e)}`);
  }
  const text = data.toString("utf8");
  if (what === "certificate" && !text.includes("-----BEGIN CERTIFICATE-----")) {
    throw new TlsError(`${p.option} ${p.path} holds no PEM certificate`);
  }
  if (what === "key" && !/-----BEGIN [A-Z ]*PRIVATE KEY-----/.test(text)) {
    throw new TlsError(`${p.option} ${p.path} holds no PEM private key`);
  }
  return data;
}

/** Where a server's certificate, key and (mTLS) client CA come from. */
export interface ServerFiles {
  cert: Pem;
  key: Pem;
  clientCa?: Pem;
}

function contextOptions(files: ServerFiles): SecureContextOptions {
  const cert = readPem(files.cert, "certificate");
  const key = readPem(files.key, "key");
  const ca = files.clientCa ? readPem(files.clientCa, "certificate") : undefined;
  const options: SecureContextOptions = { cert, key, ...(ca ? { ca } : {}) };
  try {
    // Builds it once, so that a key that does not match its certificate is said now.
    createSecureContext(options);
  } catch (e) {
    throw new TlsError(
      `${files.cert.option} and ${files.key.option}: ${e instanceof Error ? e.message : String(e)}`,
    );
  }
  return options;
}

/** Server credentials whose certificate a reload replaces. */
export class LiveServerTls extends ServerCredentials {
  private current: SecureContextOptions;

  constructor(readonly files: ServerFiles) {
    const options = contextOptions(files);
    const mtls = files.clientCa !== undefined;
    // HTTP/2 only (gRPC); with a client CA every client must present a
    // certificate it signed.
    super({ requestCert: mtls, rejectUnauthorized: mtls, ALPNProtocols: ["h2"] }, options);
    this.current = options;
  }

  /** Re-reads the files: new connections use them; on a mistake the
   * running certificate stays and the error is thrown. */
  reload(): void {
    const next = contextOptions(this.files);
    this.current = next;
    this.updateSecureContextOptions(next);
  }

  override _equals(other: ServerCredentials): boolean {
    return this === other;
  }

  get options(): SecureContextOptions {
    return this.current;
  }
}
