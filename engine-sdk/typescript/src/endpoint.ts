// Endpoints: where an engine listens and how a client reaches it —
// `http://HOST:PORT`, a bare `HOST:PORT`, or `unix:///PATH`
// (engine-sdk/runtime/src/endpoint.rs).
import { isIP } from "node:net";

export type Endpoint =
  | { kind: "tcp"; ip: string; port: number }
  | { kind: "host"; host: string; port: number }
  | { kind: "unix"; path: string };

export class BadEndpoint extends Error {
  constructor(readonly input: string) {
    super(`invalid endpoint ${JSON.stringify(input)}: expected http://HOST:PORT, HOST:PORT or unix:///PATH`);
  }
}

export function parseEndpoint(s: string): Endpoint {
  if (s.startsWith("unix://")) {
    const path = s.slice("unix://".length);
    if (!path) throw new BadEndpoint(s);
    return { kind: "unix", path };
  }
  let hostport = (s.startsWith("http://") ? s.slice("http://".length) : s).replace(/\/+$/, "");
  if (hostport.startsWith("localhost:")) hostport = `127.0.0.1:${hostport.slice("localhost:".length)}`;
  const colon = hostport.lastIndexOf(":");
  if (colon <= 0) throw new BadEndpoint(s);
  let host = hostport.slice(0, colon);
  const portText = hostport.slice(colon + 1);
  if (!/^\d{1,5}$/.test(portText) || Number(portText) > 65535) throw new BadEndpoint(s);
  const port = Number(portText);
  if (host.startsWith("[") && host.endsWith("]")) {
    host = host.slice(1, -1);
    if (isIP(host) !== 6) throw new BadEndpoint(s);
    return { kind: "tcp", ip: host, port };
  }
  if (isIP(host) === 4) return { kind: "tcp", ip: host, port };
  if (/^[a-zA-Z0-9.-]+$/.test(host)) return { kind: "host", host, port };
  throw new BadEndpoint(s);
}

/** Whether only this machine can reach it: a loopback address or a unix
 * socket (a host name is not: it may resolve anywhere). */
export function isLocal(e: Endpoint): boolean {
  if (e.kind === "unix") return true;
  if (e.kind === "host") return false;
  return e.ip === "::1" || /^127\./.test(e.ip);
}

/** The form engines print after `listening on`: `HOST:PORT` or `unix:///PATH`. */
export function endpointString(e: Endpoint): string {
  switch (e.kind) {
    case "tcp":
      return isIP(e.ip) === 6 ? `[${e.ip}]:${e.port}` : `${e.ip}:${e.port}`;
    case "host":
      return `${e.host}:${e.port}`;
    case "unix":
      return `unix://${e.path}`;
  }
}

/** A grpc-js target for `e` (dialled by address, never re-resolved). */
export function grpcTarget(e: Endpoint): string {
  switch (e.kind) {
    case "tcp":
      return isIP(e.ip) === 6 ? `ipv6:[${e.ip}]:${e.port}` : `ipv4:${e.ip}:${e.port}`;
    case "host":
      return `dns:${e.host}:${e.port}`;
    case "unix":
      return `unix://${e.path}`;
  }
}

export function sameEndpoint(a: Endpoint, b: Endpoint): boolean {
  return endpointString(a) === endpointString(b);
}
