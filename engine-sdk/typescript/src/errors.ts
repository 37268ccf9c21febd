// What an engine method can fail with, each mapped to the status code
// docs/contract.md prescribes (engine-sdk/rust/src/error.rs). Anything else
// thrown is a bug: INTERNAL "<Method> failed inside the engine", with the
// detail logged, never sent.
import { Metadata, status } from "@grpc/grpc-js";
import type * as pb from "./gen/pb.js";
import { messageType } from "./proto.js";
import type { Method } from "./method.js";
import type { Violation } from "./validate.js";

export const HISTORY_GAP_TYPE_URL = "type.googleapis.com/contextengine.v1.HistoryGap";
const GAP_MESSAGE = "history gap: the engine does not hold the cursor; resend the history";

/** A status an engine method answers with. */
export class EngineError extends Error {
  constructor(
    readonly code: status,
    message: string,
    readonly metadata?: Metadata,
  ) {
    super(message);
    this.name = "EngineError";
  }

  static invalid(v: Violation): EngineError {
    return new EngineError(v.code, v.message);
  }
  static failedPrecondition(message: string): EngineError {
    return new EngineError(status.FAILED_PRECONDITION, message);
  }
  static notFound(message: string): EngineError {
    return new EngineError(status.NOT_FOUND, message);
  }
  static unimplemented(method: Method): EngineError {
    return new EngineError(status.UNIMPLEMENTED, `${method} is not implemented`);
  }
  static cancelled(): EngineError {
    return new EngineError(status.CANCELLED, "the call was cancelled");
  }
  static deadlineExceeded(): EngineError {
    return new EngineError(status.DEADLINE_EXCEEDED, "the call's deadline passed");
  }
  /** A bug or an I/O failure: the detail is logged, the caller sees
   * "internal engine error". */
  static internal(detail: unknown): EngineError {
    console.error(`engine internal error: ${detail instanceof Error ? (detail.stack ?? detail.message) : String(detail)}`);
    return new EngineError(status.INTERNAL, "internal engine error");
  }
  /** FAILED_PRECONDITION with the typed HistoryGap detail: a DELTA engine
   * does not hold the request's cursor; `held` is what it does hold. */
  static historyGap(held?: pb.HistoryCursor): EngineError {
    return new EngineError(status.FAILED_PRECONDITION, GAP_MESSAGE, gapMetadata(held));
  }
}

/** `grpc-status-details-bin`: a google.rpc.Status-compatible RpcStatus
 * holding one Any with the HistoryGap. */
export function gapDetails(held?: pb.HistoryCursor): Buffer {
  const gap = messageType("HistoryGap");
  const value = gap.encode(gap.fromObject(held ? { held } : {})).finish();
  const rpc = messageType("RpcStatus");
  const details = rpc.fromObject({
    code: status.FAILED_PRECONDITION,
    message: GAP_MESSAGE,
    details: [{ typeUrl: HISTORY_GAP_TYPE_URL, value }],
  });
  return Buffer.from(rpc.encode(details).finish());
}

function gapMetadata(held?: pb.HistoryCursor): Metadata {
  const md = new Metadata();
  md.set("grpc-status-details-bin", gapDetails(held));
  return md;
}

/** The HistoryGap a status carries (FAILED_PRECONDITION with the typed
 * detail; the message text is never looked at), or undefined. */
export function gapOf(err: { code?: number; metadata?: Metadata }): pb.HistoryGap__Output | undefined {
  if (err.code !== status.FAILED_PRECONDITION || !err.metadata) return undefined;
  const raw = err.metadata.get("grpc-status-details-bin")[0];
  if (!raw || typeof raw === "string") return undefined;
  try {
    const rpc = messageType("RpcStatus");
    const decoded = rpc.toObject(rpc.decode(raw), { defaults: true }) as {
      details: { typeUrl: string; value: Uint8Array }[];
    };
    const any = decoded.details.find((d) => d.typeUrl === HISTORY_GAP_TYPE_URL);
    if (!any) return undefined;
    const gap = messageType("HistoryGap");
    return gap.toObject(gap.decode(any.value), { longs: Number, defaults: true }) as pb.HistoryGap__Output;
  } catch {
    return undefined;
  }
}
