"""The contract's token estimate (`proto/src/estimate.rs`): chars/4, CJK
characters one token each, images a flat 2000, and a provider-reported
output count winning where a message has one."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .pb import types

IMAGE_TOKENS = 2000


def _is_cjk(o: int) -> bool:
    return (0x3040 <= o <= 0x30FF or 0x3400 <= o <= 0x4DBF or 0x4E00 <= o <= 0x9FFF
            or 0xAC00 <= o <= 0xD7AF or 0xF900 <= o <= 0xFAFF or 0x20000 <= o <= 0x2FA1F)


def text_tokens(text: str) -> int:
    if text.isascii():
        return (len(text) + 3) // 4
    cjk = sum(1 for ch in text if _is_cjk(ord(ch)))
    return (len(text) - cjk + 3) // 4 + cjk


def message_tokens(m: types.AgentMessage) -> int:
    if m.HasField("usage") and m.usage.HasField("output_tokens"):
        return m.usage.output_tokens
    total = 0
    for p in m.content:
        kind = p.WhichOneof("part")
        if kind == "text":
            total += text_tokens(p.text)
        elif kind == "thinking":
            total += text_tokens(p.thinking.text)
        elif kind == "image":
            total += IMAGE_TOKENS
        elif kind == "tool_call":
            total += text_tokens(p.tool_call.name) + text_tokens(p.tool_call.arguments_json)
        elif kind == "tool_result":
            total += text_tokens(p.tool_result.text)
    return total


def messages_tokens(messages: Iterable[types.AgentMessage]) -> int:
    return sum(message_tokens(m) for m in messages)


def fit_budget(messages: Sequence[types.AgentMessage], budget: int | None) -> tuple[list[types.AgentMessage], int]:
    """What of `messages` to assemble under `budget` tokens: the newest
    messages that fit, and their estimate. A message with tool calls and the
    tool results that follow it (answering those calls) are kept or dropped
    together, with everything between, so the model never sees a result
    without its call; a tool result whose call precedes it nowhere in
    `messages` is dropped first (and a message it leaves empty), as the
    contract refuses it. The walk stops at the first unit that does not fit (the
    context stays one contiguous run of the newest history), and the newest
    unit is kept even over the budget (the contract refuses an empty answer
    to a request with history; the estimate shows the overflow). No budget
    (`None`) keeps everything. The same rule as every
    SDK's, pinned by `proto/testdata/budget.json`."""
    messages = _without_orphan_results(messages)
    if budget is None:
        return list(messages), messages_tokens(messages)
    start, tokens = len(messages), 0
    while start > 0:
        unit = _unit_start(messages, start - 1)
        cost = messages_tokens(messages[unit:start])
        if tokens + cost > budget and start < len(messages):
            break
        start, tokens = unit, tokens + cost
    return list(messages[start:]), tokens


def _without_orphan_results(messages: Sequence[types.AgentMessage]) -> Sequence[types.AgentMessage]:
    """`messages` without the tool results whose call precedes them nowhere
    (in the order the contract's validation walks), and without a message
    that leaves empty."""
    calls: set[str] = set()

    def orphan(p: types.ContentPart) -> bool:
        kind = p.WhichOneof("part")
        if kind == "tool_call":
            calls.add(p.tool_call.id)
        return kind == "tool_result" and p.tool_result.tool_call_id not in calls

    if not any(orphan(p) for m in messages for p in m.content):
        return messages
    calls.clear()
    kept: list[types.AgentMessage] = []
    for m in messages:
        content = [p for p in m.content if not orphan(p)]
        if content:
            copy = types.AgentMessage()
            copy.CopyFrom(m)
            del copy.content[:]
            copy.content.extend(content)
            kept.append(copy)
    return kept


def _unit_start(messages: Sequence[types.AgentMessage], last: int) -> int:
    """Where the unit that ends at `last` starts: a tool result pulls it back
    to the nearest earlier message holding its call, and so do the results
    between."""
    start = i = last
    while i >= start:
        for p in messages[i].content:
            if p.WhichOneof("part") != "tool_result":
                continue
            call = next((j for j in range(i - 1, -1, -1) if _holds_call(messages[j], p.tool_result.tool_call_id)), None)
            if call is not None:
                start = min(start, call)
        i -= 1
    return start


def _holds_call(m: types.AgentMessage, call_id: str) -> bool:
    return any(p.WhichOneof("part") == "tool_call" and p.tool_call.id == call_id for p in m.content)
