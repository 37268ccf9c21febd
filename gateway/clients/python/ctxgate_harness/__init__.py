"""Drive ctxgate turns from your own agent runtime (ctxgate.v1.Harness/DriveTurn).

Your runtime keeps its model and tools; ctxgate admits the turn, picks the
context engine, assembles the context before every model call, records every
message and finalizes the turn with the engine::

    from ctxgate_harness import Gateway, Host, Model, assistant, tool_result

    gw = Gateway("127.0.0.1:7300")
    with gw.begin("my-session", Host("my-agent"), Model("gpt-4.1", 128_000, 4_096),
                  "What is 6*7?", tools=["calculator"]) as turn:
        ctx = turn.context                       # the first context
        # ... call your model with ctx.system_prompt_addition + ctx.messages ...
        turn.append([assistant(tool_calls=[("call-1", "calculator", '{"expression": "6*7"}')])])
        turn.append([tool_result("call-1", "calculator", "42")])
        ctx = turn.assemble()                    # before the next model call
        turn.append([assistant("42")])
        turn.end()                               # accepted: the engine is told

Leaving the ``with`` block without ``end()`` (or on an exception) aborts the
turn: nothing it appended stays on the session's branch, and the engine
never learns of it. docs/harness.md has the protocol.
"""

import json
import os
import queue
import sys
import time

_GEN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gen")
if _GEN not in sys.path:
    sys.path.insert(0, _GEN)

import grpc  # noqa: E402

from contextengine.v1 import types_pb2 as types  # noqa: E402
from ctxgate.v1 import gateway_pb2 as gpb  # noqa: E402
from ctxgate.v1 import harness_pb2 as hpb  # noqa: E402
from ctxgate.v1 import harness_pb2_grpc  # noqa: E402

#: The capabilities a harness like the example has (OpenClaw's embedded set).
#: Without "assemble-before-prompt" a turn is capture-only: recorded and
#: finalized, never assembled. Add "thread-bootstrap-projection" only if your
#: runtime keeps persistent model threads and honours `context.projection`.
DEFAULT_CAPABILITIES = (
    "bootstrap",
    "assemble-before-prompt",
    "after-turn",
    "maintain",
    "compact",
    "runtime-llm-complete",
)

_BUSY = {"enqueue": gpb.BUSY_POLICY_ENQUEUE, "reject": gpb.BUSY_POLICY_REJECT, "interrupt": gpb.BUSY_POLICY_INTERRUPT}
_OUTCOME = {
    "accepted": hpb.TURN_OUTCOME_ACCEPTED,
    "aborted": hpb.TURN_OUTCOME_ABORTED,
    "failed": hpb.TURN_OUTCOME_FAILED,
}


class TurnFailed(Exception):
    """The gateway says the turn cannot go on (e.g. context_overflow): end it failed."""

    def __init__(self, reason, message):
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


class Host:
    """Who drives the turn: ``agent-harness:<name>`` with its capabilities."""

    def __init__(self, name, capabilities=DEFAULT_CAPABILITIES, label=""):
        self.proto = hpb.HostProfile(id=f"agent-harness:{name}", label=label, capabilities=list(capabilities))


class Model:
    """The model the harness calls: id, context window, reply reserve."""

    def __init__(self, model_id, context_window, max_output_tokens=0, provider=""):
        self.proto = hpb.ModelInfo(
            id=model_id, provider=provider, context_window=context_window, max_output_tokens=max_output_tokens
        )


# --- messages ---------------------------------------------------------------


def user(text):
    return types.AgentMessage(role=types.ROLE_USER, content=[types.ContentPart(text=text)])


def assistant(text="", tool_calls=(), usage=None):
    """An assistant message; ``tool_calls`` are (id, name, arguments_json)."""
    parts = [types.ContentPart(text=text)] if text else []
    parts += [
        types.ContentPart(tool_call=types.ToolCall(id=i, name=n, arguments_json=a)) for (i, n, a) in tool_calls
    ]
    m = types.AgentMessage(role=types.ROLE_ASSISTANT, content=parts)
    if usage:
        m.usage.CopyFrom(types.Usage(**usage))
    return m


def tool_result(call_id, name, text, is_error=False):
    return types.AgentMessage(
        role=types.ROLE_TOOL,
        content=[
            types.ContentPart(
                tool_result=types.ToolResult(tool_call_id=call_id, tool_name=name, text=text, is_error=is_error)
            )
        ],
    )


def text_of(m):
    return "\n".join(p.text for p in m.content if p.WhichOneof("part") == "text")


def tool_calls_of(m):
    return [p.tool_call for p in m.content if p.WhichOneof("part") == "tool_call"]


_ROLES = {types.ROLE_SYSTEM: "system", types.ROLE_USER: "user", types.ROLE_ASSISTANT: "assistant"}


def openai_tools(tools):
    """Tool definitions (the engine's ``Context.engine_tools``) as OpenAI's
    ``tools`` list."""
    out = []
    for t in tools:
        try:
            parameters = json.loads(t.parameters_json_schema) if t.parameters_json_schema else {}
        except ValueError:
            parameters = {}
        if not isinstance(parameters, dict) or not parameters:
            parameters = {"type": "object", "properties": {}}
        out.append({"type": "function", "function": {"name": t.name, "description": t.description,
                                                     "parameters": parameters}})
    return out


def to_openai(messages, system=None):
    """Context messages as OpenAI chat-completions messages."""
    out = [{"role": "system", "content": system}] if system else []
    for m in messages:
        if m.role == types.ROLE_TOOL:
            for p in m.content:
                if p.WhichOneof("part") == "tool_result":
                    r = p.tool_result
                    out.append({"role": "tool", "tool_call_id": r.tool_call_id, "content": r.text})
            continue
        entry = {"role": _ROLES.get(m.role, "user"), "content": text_of(m) or None}
        calls = tool_calls_of(m)
        if calls:
            entry["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json}}
                for c in calls
            ]
        out.append(entry)
    return out


# --- the client ---------------------------------------------------------------


class Gateway:
    """A connection to a ctxgate gateway (``host:port`` or ``http://host:port``)."""

    def __init__(self, target, token=None):
        for scheme in ("http://", "grpc://"):
            if target.startswith(scheme):
                target = target[len(scheme) :]
        self._channel = grpc.insecure_channel(target)
        self._stub = harness_pb2_grpc.HarnessStub(self._channel)
        self._metadata = [("authorization", f"Bearer {token}")] if token else []

    def begin(
        self,
        session,
        host,
        model,
        user_text,
        tools=(),
        system_prompt=None,
        busy="enqueue",
        agent="",
        timeout=None,
    ):
        """Begins a turn; returns it once the first context (if any) is in."""
        req = hpb.Begin(
            session=gpb.SessionRef(agent_id=agent, session_key=session),
            host=host.proto,
            model=model.proto,
            available_tools=list(tools),
            user_messages=[user(user_text)] if isinstance(user_text, str) else list(user_text),
            busy_policy=_BUSY[busy],
        )
        if system_prompt is not None:
            req.system_prompt = system_prompt
        return Turn(self._stub, req, self._metadata, timeout)

    def close(self):
        self._channel.close()


class Turn:
    """One turn: one DriveTurn stream. Every call sends one request and
    waits for its answer; events on the way are kept in ``events``."""

    def __init__(self, stub, begin, metadata, timeout):
        self._requests = queue.Queue()
        self._requests.put(hpb.HarnessRequest(begin=begin))
        self._call = stub.DriveTurn(self._feed(), metadata=metadata, timeout=timeout)
        self.events = []
        self.warnings = []
        self.ended = None
        self.contexts = 0
        try:
            self.admitted = self._until("admitted")
            self.engine = self._until("engine_selected")
            if self.engine.HasField("warning"):
                self.warnings.append(self.engine.warning)
            assembles = "assemble-before-prompt" in begin.host.capabilities
            self.context = self._context() if assembles else None
        except TurnFailed:
            # The gateway ended the turn right after admission (e.g. the
            # engine's outbox is blocked): read its `ended`, close our side.
            self.ended = self._until("ended")
            self._requests.put(None)
            for _ in self._call:
                pass
            raise

    def _feed(self):
        while True:
            r = self._requests.get()
            if r is None:
                return
            yield r

    def _send(self, **request):
        if self.ended is not None:
            raise RuntimeError("the turn has ended")
        self._requests.put(hpb.HarnessRequest(**request))

    def _until(self, kind):
        try:
            for ev in self._call:
                got = ev.WhichOneof("event")
                self.events.append(ev)
                if got == "warning":
                    self.warnings.append(ev.warning.message)
                if got == "failed" and kind != "failed":
                    raise TurnFailed(ev.failed.reason, ev.failed.message)
                if got == kind:
                    return getattr(ev, kind)
        except grpc.RpcError:
            # The stream is over: release grpc's thread waiting on our requests.
            self._requests.put(None)
            raise
        self._requests.put(None)
        raise RuntimeError(f"the turn's stream ended before {kind}")

    def _context(self):
        ctx = self._until("context")
        self.contexts += 1
        return ctx

    def assemble(self, pending=()):
        """The context for the next model call; ``pending``: messages the
        model will see after it that are not appended yet."""
        self._send(assemble=hpb.AssembleContext(pending=list(pending)))
        self.context = self._context()
        return self.context

    def append(self, messages):
        """Stores what the model and tools produced; returns the entry ids."""
        self._send(append=hpb.Append(messages=list(messages)))
        return list(self._until("appended").entry_ids)

    def engine_tool_names(self):
        """The names of the engine's tools offered in this turn."""
        return {t.name for t in self.context.engine_tools} if self.context is not None else set()

    def call_tool(self, tool_call_id):
        """Runs an engine tool call (its assistant message appended already):
        the gateway runs it at the engine and stores the result as the
        call's answer. Returns the tool message (append nothing for it)."""
        self._send(call_tool=hpb.CallTool(tool_call_id=tool_call_id))
        return self._until("tool_result").message

    def overflow(self, observed_tokens=None, pending=()):
        """The model said the prompt is too long: compacts and returns a new
        context (raises TurnFailed once compaction cannot help)."""
        o = hpb.Overflow(pending=list(pending))
        if observed_tokens is not None:
            o.observed_tokens = observed_tokens
        self._send(overflow=o)
        self.context = self._context()
        return self.context

    def compact(self, instructions=None):
        c = hpb.CompactNow()
        if instructions is not None:
            c.custom_instructions = instructions
        self._send(compact=c)
        return self._until("compaction_done")

    def end(self, outcome="accepted", reason=""):
        """Ends the turn ("accepted", "aborted" or "failed")."""
        self._send(end=hpb.End(outcome=_OUTCOME[outcome], reason=reason))
        self.ended = self._until("ended")
        self._requests.put(None)
        for _ in self._call:  # the gateway closes the stream
            pass
        return self.ended

    def abort(self):
        """Drops the stream: the turn ends aborted."""
        self._requests.put(None)
        self._call.cancel()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if self.ended is None:
            self.abort()
        return False


def wait_ready(target, timeout=10.0):
    """Waits until the gateway answers (for scripts that start it)."""
    for scheme in ("http://", "grpc://"):
        if target.startswith(scheme):
            target = target[len(scheme) :]
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as ch:
        grpc.channel_ready_future(ch).result(timeout=max(0.1, deadline - time.monotonic()))
