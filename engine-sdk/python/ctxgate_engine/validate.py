"""Validation of contract messages, the same rules as `proto/src/validate.rs`:
the server checks every request before engine code runs (`check_request`),
and an engine's GetInfo reply is checked with the result rules (`result_info`).
A `Violation` names the offending field path and maps to INVALID_ARGUMENT or
RESOURCE_EXHAUSTED; the shared vectors in `proto/testdata/` prove the rules
agree with every other SDK's."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from . import methods
from .limits import (
    MAX_ID_BYTES,
    MAX_MESSAGE_CONTENT_BYTES,
    MAX_MESSAGES,
    MAX_METADATA_ENTRIES,
    MAX_METADATA_KEY_BYTES,
    MAX_METADATA_VALUE_BYTES,
    MAX_TOOL_ARGUMENTS_BYTES,
    MAX_TOOL_DESCRIPTION_BYTES,
    MAX_TOOL_NAME_BYTES,
    MAX_TOOL_SCHEMA_BYTES,
    MAX_TOOLS,
)
from .pb import pb, types


class Violation(Exception):
    """A contract message is not acceptable: `field` (a path such as
    `messages[3].content[0].tool_result.tool_call_id`) and what is wrong."""

    def __init__(self, field: str, problem: str, too_large: bool = False) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem
        self.too_large = too_large

    @property
    def code(self) -> grpc.StatusCode:
        """RESOURCE_EXHAUSTED over a size limit, INVALID_ARGUMENT otherwise."""
        return grpc.StatusCode.RESOURCE_EXHAUSTED if self.too_large else grpc.StatusCode.INVALID_ARGUMENT

    def at(self, field: str) -> Violation:
        return Violation(field, self.problem, self.too_large)


def quoted(s: str) -> str:
    """A string as Rust's `{:?}` writes it, near enough for a message."""
    return json.dumps(s, ensure_ascii=False)


def utf8_len(s: str) -> int:
    return len(s) if s.isascii() else len(s.encode())


def check_id(value: str, field: str) -> None:
    """A required id: non-blank and at most MAX_ID_BYTES."""
    if not value.strip():
        raise Violation(field, "is required")
    n = utf8_len(value)
    if n > MAX_ID_BYTES:
        raise Violation(field, f"is {n} bytes, the limit is {MAX_ID_BYTES}", too_large=True)


def content_bytes(m: types.AgentMessage) -> int:
    """The summed size of a message's content parts, in bytes."""
    total = 0
    for p in m.content:
        kind = p.WhichOneof("part")
        if kind == "text":
            total += utf8_len(p.text)
        elif kind == "thinking":
            total += utf8_len(p.thinking.text) + utf8_len(p.thinking.signature)
        elif kind == "image":
            total += utf8_len(p.image.uri) + utf8_len(p.image.mime_type)
        elif kind == "tool_call":
            c = p.tool_call
            total += utf8_len(c.id) + utf8_len(c.name) + utf8_len(c.arguments_json)
        elif kind == "tool_result":
            r = p.tool_result
            total += utf8_len(r.tool_call_id) + utf8_len(r.tool_name) + utf8_len(r.text)
    return total


_ROLES = frozenset(types.Role.values())


def _message(m: types.AgentMessage, at: str | Callable[[], str]) -> None:
    """The checks of one message. `at` is its path, or makes it: nothing is
    formatted unless something is wrong (this runs on every message of
    every request)."""
    def path(rest: str) -> str:
        return f"{at if isinstance(at, str) else at()}{rest}"

    mid = m.id
    if not mid.strip() or (len(mid) * 4 > MAX_ID_BYTES and utf8_len(mid) > MAX_ID_BYTES):
        check_id(mid, path(".id"))
    role = m.role
    if role not in _ROLES or role == types.ROLE_UNSPECIFIED:
        if role == types.ROLE_UNSPECIFIED:
            raise Violation(path(".role"), "is required")
        raise Violation(path(".role"), f"unknown role {role}")
    size = 0
    for i, p in enumerate(m.content):
        kind = p.WhichOneof("part")
        if kind == "text":
            size += utf8_len(p.text)
        elif kind == "tool_call":
            c = p.tool_call
            try:
                check_id(c.id, "")
            except Violation as bad:
                raise bad.at(path(f".content[{i}].tool_call.id")) from None
            if not c.name.strip():
                raise Violation(path(f".content[{i}].tool_call.name"), "is required")
            size += utf8_len(c.id) + utf8_len(c.name) + utf8_len(c.arguments_json)
        elif kind == "tool_result":
            r = p.tool_result
            try:
                check_id(r.tool_call_id, "")
            except Violation as bad:
                raise bad.at(path(f".content[{i}].tool_result.tool_call_id")) from None
            size += utf8_len(r.tool_call_id) + utf8_len(r.tool_name) + utf8_len(r.text)
        elif kind == "thinking":
            size += utf8_len(p.thinking.text) + utf8_len(p.thinking.signature)
        elif kind == "image":
            size += utf8_len(p.image.uri) + utf8_len(p.image.mime_type)
        else:
            raise Violation(path(f".content[{i}]"), "has no part set")
    metadata = m.metadata
    if metadata:
        if len(metadata) > MAX_METADATA_ENTRIES:
            raise Violation(path(".metadata"), f"has {len(metadata)} entries, the limit is {MAX_METADATA_ENTRIES}",
                            too_large=True)
        for k, v in metadata.items():
            if utf8_len(k) > MAX_METADATA_KEY_BYTES:
                raise Violation(path(".metadata"),
                                f"has a {utf8_len(k)}-byte key, the limit is {MAX_METADATA_KEY_BYTES}", too_large=True)
            if utf8_len(v) > MAX_METADATA_VALUE_BYTES:
                raise Violation(path(".metadata"), f"[{k[:64]}] is {utf8_len(v)} bytes, the limit is "
                                f"{MAX_METADATA_VALUE_BYTES}", too_large=True)
    if size > MAX_MESSAGE_CONTENT_BYTES:
        raise Violation(path(".content"), f"is {size} bytes, the limit is {MAX_MESSAGE_CONTENT_BYTES}",
                        too_large=True)


def message(m: types.AgentMessage, field: str) -> None:
    """One well-formed message: id, known role, parts set, tool ids present,
    content within MAX_MESSAGE_CONTENT_BYTES."""
    _message(m, field)


def messages(items: Sequence[types.AgentMessage], field: str) -> None:
    """Well-formed messages with unique ids, at most MAX_MESSAGES."""
    if len(items) > MAX_MESSAGES:
        raise Violation(field, f"has {len(items)} messages, the limit is {MAX_MESSAGES}", too_large=True)
    seen: set[str] = set()
    for i, m in enumerate(items):
        _message(m, lambda: f"{field}[{i}]")
        mid = m.id
        if mid in seen:
            raise Violation(f"{field}[{i}].id", f"duplicates message id {quoted(mid)}")
        seen.add(mid)


def first_orphan_result(items: Sequence[types.AgentMessage]) -> tuple[int, int] | None:
    """The first tool result (message index, part index) whose call does not
    precede it."""
    calls: set[str] = set()
    for i, m in enumerate(items):
        for j, p in enumerate(m.content):
            kind = p.WhichOneof("part")
            if kind == "tool_call":
                calls.add(p.tool_call.id)
            elif kind == "tool_result" and p.tool_result.tool_call_id not in calls:
                return i, j
    return None


def tool_pairs(items: Sequence[types.AgentMessage], field: str) -> None:
    """Every tool result is preceded by the call it answers."""
    orphan = first_orphan_result(items)
    if orphan is not None:
        i, j = orphan
        call_id = items[i].content[j].tool_result.tool_call_id
        raise Violation(f"{field}[{i}].content[{j}].tool_result",
                        f"answers tool call {quoted(call_id)}, which does not precede it")


_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]+")


def tool_name(name: str, field: str) -> None:
    """1 to 64 of [a-zA-Z0-9_-], the rule model APIs share."""
    if not (1 <= len(name) <= MAX_TOOL_NAME_BYTES and _TOOL_NAME.fullmatch(name)):
        raise Violation(field, f"{quoted(name)} is not 1 to 64 of [a-zA-Z0-9_-]")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def is_json_object(text: str) -> bool:
    """Whether `text` is a JSON object (strict JSON: no NaN or Infinity)."""
    try:
        return isinstance(json.loads(text, parse_constant=_refuse_constant), dict)
    except (ValueError, RecursionError):
        return False


_AUDIENCES = frozenset(pb.ToolAudience.values())


def tools(items: Sequence[pb.ToolDefinition], field: str) -> None:
    """Tool declarations: at most MAX_TOOLS, names valid and unique,
    descriptions and schemas within their limits, each schema a JSON object."""
    if len(items) > MAX_TOOLS:
        raise Violation(field, f"declares {len(items)} tools, the limit is {MAX_TOOLS}", too_large=True)
    names: set[str] = set()
    for i, t in enumerate(items):
        at = f"{field}[{i}]"
        tool_name(t.name, f"{at}.name")
        if t.name in names:
            raise Violation(f"{at}.name", f"{quoted(t.name)} is declared twice")
        names.add(t.name)
        n = utf8_len(t.description)
        if n > MAX_TOOL_DESCRIPTION_BYTES:
            raise Violation(f"{at}.description", f"is {n} bytes, the limit is {MAX_TOOL_DESCRIPTION_BYTES}",
                            too_large=True)
        schema = t.parameters_json_schema
        n = utf8_len(schema)
        if n > MAX_TOOL_SCHEMA_BYTES:
            raise Violation(f"{at}.parameters_json_schema", f"is {n} bytes, the limit is {MAX_TOOL_SCHEMA_BYTES}",
                            too_large=True)
        if schema.strip() and not is_json_object(schema):
            raise Violation(f"{at}.parameters_json_schema", "is not a JSON object")
        if t.audience not in _AUDIENCES:
            raise Violation(f"{at}.audience", f"{t.audience} is not a ToolAudience")


# --- requests: what the server checks before engine code runs -----------------

def _bootstrap(r: pb.BootstrapRequest) -> None:
    check_id(r.session_id, "session_id")


def _ingest(r: pb.IngestRequest) -> None:
    check_id(r.session_id, "session_id")
    if not r.HasField("message"):
        raise Violation("message", "is required")
    message(r.message, "message")


def _ingest_batch(r: pb.IngestBatchRequest) -> None:
    check_id(r.session_id, "session_id")
    messages(r.messages, "messages")


def _assemble(r: pb.AssembleRequest) -> None:
    check_id(r.session_id, "session_id")
    messages(r.messages, "messages")


def _compact(r: pb.CompactRequest) -> None:
    check_id(r.session_id, "session_id")
    check_id(r.session_key, "session_key")


def _after_turn(r: pb.AfterTurnRequest) -> None:
    check_id(r.session_id, "session_id")
    messages(r.messages, "messages")
    if r.pre_prompt_message_count > len(r.messages):
        raise Violation("pre_prompt_message_count",
                        f"is {r.pre_prompt_message_count} but there are only {len(r.messages)} messages")


def _commit_turn(r: pb.CommitTurnRequest) -> None:
    check_id(r.session_id, "session_id")
    check_id(r.advancement_key, "advancement_key")
    if not r.HasField("admission"):
        raise Violation("admission", "is required")
    if r.admission.logical_turn_id != r.advancement_key:
        raise Violation("admission.logical_turn_id", "must equal advancement_key")
    if not r.HasField("terminal"):
        raise Violation("terminal", "is required")
    _generation(r.admission.anchor.generation, "admission.anchor.generation")
    _generation(r.terminal.generation, "terminal.generation")
    messages(r.messages, "messages")


def _generation(value: str, field: str) -> None:
    """An anchor's generation: opaque, possibly empty, at most an id's size."""
    n = utf8_len(value)
    if n > MAX_ID_BYTES:
        raise Violation(field, f"is {n} bytes, the limit is {MAX_ID_BYTES}", too_large=True)


def _maintain(r: pb.MaintainRequest) -> None:
    check_id(r.session_id, "session_id")


def _prepare_subagent_spawn(r: pb.PrepareSubagentSpawnRequest) -> None:
    check_id(r.parent_session_key, "parent_session_key")
    check_id(r.child_session_key, "child_session_key")
    if r.parent_session_key == r.child_session_key:
        raise Violation("child_session_key", "must differ from parent_session_key")


def _rollback_subagent_spawn(r: pb.RollbackSubagentSpawnRequest) -> None:
    check_id(r.rollback_token, "rollback_token")


def _on_subagent_ended(r: pb.OnSubagentEndedRequest) -> None:
    check_id(r.child_session_key, "child_session_key")


def _forget_session(r: pb.ForgetSessionRequest) -> None:
    check_id(r.session_id, "session_id")


def _call_tool(r: pb.CallToolRequest) -> None:
    check_id(r.session_id, "session_id")
    check_id(r.tool_call_id, "tool_call_id")
    tool_name(r.name, "name")
    n = utf8_len(r.arguments_json)
    if n > MAX_TOOL_ARGUMENTS_BYTES:
        raise Violation("arguments_json", f"is {n} bytes, the limit is {MAX_TOOL_ARGUMENTS_BYTES}", too_large=True)


def _nothing(_: Any) -> None:
    pass


REQUEST_CHECKS: dict[str, Callable[[Any], None]] = {
    "GetInfo": _nothing,
    "Bootstrap": _bootstrap,
    "Ingest": _ingest,
    "IngestBatch": _ingest_batch,
    "Assemble": _assemble,
    "Compact": _compact,
    "AfterTurn": _after_turn,
    "CommitTurn": _commit_turn,
    "Maintain": _maintain,
    "PrepareSubagentSpawn": _prepare_subagent_spawn,
    "RollbackSubagentSpawn": _rollback_subagent_spawn,
    "OnSubagentEnded": _on_subagent_ended,
    "Dispose": _nothing,
    "ForgetSession": _forget_session,
    "CallTool": _call_tool,
}


def check_request(method: str, request: Any) -> None:
    """Raises the first Violation of `request` to `method` (a wire name)."""
    REQUEST_CHECKS[method](request)


# --- results: what a caller checks of an engine's answers ---------------------

# Unicode category Cc, what Rust's `char::is_control` matches.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def result_info(i: pb.EngineInfo) -> None:
    if not i.id.strip():
        raise Violation("info.id", "is blank")
    if not i.name.strip():
        raise Violation("info.name", "is blank")
    # They become log fields, metric labels and an audit caller.
    for field, v in (("info.id", i.id), ("info.name", i.name), ("info.version", i.version)):
        n = utf8_len(v)
        if n > MAX_ID_BYTES:
            raise Violation(field, f"is {n} bytes, the limit is {MAX_ID_BYTES}", too_large=True)
        if _CONTROL.search(v):
            raise Violation(field, "contains a control character")
    if i.contract_version.split(".")[0] != "1":
        raise Violation("info.contract_version", f"is {quoted(i.contract_version)}, this side speaks 1.x")
    listed = list(i.implemented_methods)
    for m in methods.ALL:
        if m in methods.REQUIRED and m not in listed:
            raise Violation("info.implemented_methods", f"lacks required method {m}")
    seen: set[str] = set()
    for m in listed:
        if m not in methods.ALL:
            raise Violation("info.implemented_methods", f"names unknown method {quoted(m)}")
        if m in seen:
            raise Violation("info.implemented_methods", f"lists {m} twice")
        seen.add(m)
    if i.transcript_semantics.turn_advancement_idempotency != 0 and "CommitTurn" not in seen:
        raise Violation("info.transcript_semantics.turn_advancement_idempotency",
                        "is declared but CommitTurn is not implemented")
    if i.tools and "CallTool" not in seen:
        raise Violation("info.tools", "are declared but CallTool is not implemented")
    tools(i.tools, "info.tools")
    if i.history_delivery == pb.HISTORY_DELIVERY_DELTA and "IngestBatch" not in seen:
        raise Violation("info.history_delivery",
                        "is DELTA but IngestBatch (the resync after a history gap) is not implemented")


def result_assemble(r: pb.AssembleResult, request_messages: int) -> None:
    if not r.messages and request_messages > 0:
        raise Violation("messages", "is empty although the request had history")
    messages(r.messages, "messages")
    tool_pairs(r.messages, "messages")
    if (r.HasField("projection") and r.projection.mode == pb.PROJECTION_MODE_THREAD_BOOTSTRAP
            and not (r.projection.HasField("epoch") and r.projection.epoch.strip())):
        raise Violation("projection.epoch", "is required for thread_bootstrap")


def result_commit_turn(r: pb.CommitTurnResult) -> None:
    if r.status not in (pb.COMMIT_STATUS_COMMITTED, pb.COMMIT_STATUS_DUPLICATE):
        raise Violation("status", f"invalid commitTurn result status: {r.status}")


def result_call_tool(r: pb.CallToolResult) -> None:
    for i, p in enumerate(r.content):
        if p.WhichOneof("part") != "text":
            raise Violation(f"content[{i}]", "a tool's result carries text parts only")


def result_maintain(r: pb.MaintainResult) -> None:
    for i, rep in enumerate(r.replacements):
        at = f"replacements[{i}]"
        if not rep.HasField("message"):
            raise Violation(f"{at}.message", "is required")
        message(rep.message, f"{at}.message")
        if rep.message.id != rep.entry_id:
            raise Violation(f"{at}.message.id", "must equal entry_id")
