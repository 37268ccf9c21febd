// One harness turn (ctxgate.v1.Harness/DriveTurn) as a request/answer
// conversation: send a request, then read events until its answer, each
// wait bounded. Warnings on the way are collected; `failed` and a stream
// that ends or errs reject. Dropping the stream (cancel) aborts the turn at
// the gateway: nothing of it stays on the session's branch.
import * as grpc from "@grpc/grpc-js";
import type { HarnessEvent__Output } from "./gen/ctxgate/v1/HarnessEvent.js";
import type { HarnessRequest } from "./gen/ctxgate/v1/HarnessRequest.js";
import type { Gateway } from "./gateway.js";

type Kind = NonNullable<HarnessEvent__Output["event"]>;
type EventOf<K extends Kind> = NonNullable<HarnessEvent__Output[K]>;

/** Why a turn could not go on; `status` is the gRPC code when the gateway answered one. */
export class DriveError extends Error {
  constructor(
    message: string,
    readonly status?: grpc.status,
  ) {
    super(message);
    this.name = "DriveError";
  }
}

export class Drive {
  private readonly call: grpc.ClientDuplexStream<HarnessRequest, HarnessEvent__Output>;
  private readonly events: HarnessEvent__Output[] = [];
  private wake: (() => void) | undefined;
  private closed: DriveError | undefined;
  /** Warnings the gateway sent during the turn (a fallback, a queued commit). */
  readonly warnings: string[] = [];

  constructor(gateway: Gateway) {
    this.call = gateway.harness.DriveTurn(gateway.metadata());
    this.call.on("data", (e: HarnessEvent__Output) => {
      this.events.push(e);
      this.wake?.();
    });
    this.call.on("error", (e: grpc.ServiceError) => {
      this.closed ??= new DriveError(`the gateway ended the turn: ${e.details || e.message}`, e.code);
      this.wake?.();
    });
    this.call.on("end", () => {
      this.closed ??= new DriveError("the gateway closed the turn's stream");
      this.wake?.();
    });
  }

  send(request: HarnessRequest): void {
    if (this.closed) throw this.closed;
    this.call.write(request);
  }

  /** Reads events until one of `kind`, within `timeoutMs`. */
  async until<K extends Kind>(kind: K, timeoutMs: number): Promise<EventOf<K>> {
    const deadline = Date.now() + timeoutMs;
    for (;;) {
      const e = this.events.shift();
      if (e) {
        if (e.event === kind) return e[kind] as EventOf<K>;
        if (e.event === "warning" && e.warning) this.warnings.push(e.warning.message);
        if (e.event === "failed") throw new DriveError(`the turn failed at the gateway: ${e.failed?.message || e.failed?.reason}`);
        continue;
      }
      if (this.closed) throw this.closed;
      const left = deadline - Date.now();
      if (left <= 0) throw new DriveError(`no ${kind} from the gateway within ${timeoutMs} ms`, grpc.status.DEADLINE_EXCEEDED);
      await new Promise<void>((resolve) => {
        const timer = setTimeout(resolve, left);
        this.wake = () => {
          clearTimeout(timer);
          resolve();
        };
      });
      this.wake = undefined;
    }
  }

  /** Half-closes after `ended`: the gateway then closes the stream with OK. */
  finish(): void {
    this.call.end();
  }

  /** Drops the stream: an open turn ends aborted at the gateway. */
  cancel(): void {
    this.closed ??= new DriveError("the turn was cancelled");
    this.call.cancel();
  }
}
