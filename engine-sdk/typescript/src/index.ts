// @ctxgate/engine-sdk: write a ctxgate context engine in TypeScript.
//
// Implement ContextEngine (getInfo, ingest, assemble, compact; the optional
// methods answer UNIMPLEMENTED when left out) and hand it to serveMain (a
// process with the shared flags) or serve (in-process). The server checks
// every request against the contract before your code runs, runs each call
// isolated with a CallContext (deadline and cancellation as an
// AbortSignal, a HostClient, the trace), and serves grpc.health.v1 and
// reflection next to the engine.
export * as pb from "./gen/pb.js";
export { CallContext } from "./context.js";
export { type ContextEngine, type CompactOutcome, type Progress, tool, toolText, toolError, toolArguments, msg } from "./engine.js";
export { EngineError, HISTORY_GAP_TYPE_URL, gapDetails, gapOf } from "./errors.js";
export { HostClient, HostPolicy, HostChannels, Refused, READ_TRANSCRIPT, LLM_COMPLETE, parseHostEndpoint, peerOf, type Peer, type HostTls } from "./host.js";
export { serve, Bound, type ServerOptions, DEFAULT_MAX_CONCURRENT_CALLS } from "./server.js";
export { serveMain, serveWith, parseServeArgs, healthMain, checkHealth, type ServeArgs, UsageError } from "./cli.js";
export { LiveServerTls, TlsError } from "./tls.js";
export { Exporter, type Span } from "./otlp.js";
export { TraceParent, TRACE_HEADER } from "./trace.js";
export { Violation, request as validateRequest, result as validateResult } from "./validate.js";
export { textTokens, messageTokens, messagesTokens, fitBudget } from "./estimate.js";
export { parseEndpoint, endpointString, grpcTarget, type Endpoint } from "./endpoint.js";
export { METHODS, type Method } from "./method.js";
export { ENGINE_SERVICE, HOST_SERVICE, packageDefinition, engineService, hostService, messageType, LOADER_OPTIONS, PROTO_DIR } from "./proto.js";
export * as limits from "./limits.js";
