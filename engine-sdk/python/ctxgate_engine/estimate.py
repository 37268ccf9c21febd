"""The contract's token estimate (`proto/src/estimate.rs`): chars/4, CJK
characters one token each, images a flat 2000, and a provider-reported
output count winning where a message has one."""

from __future__ import annotations

from collections.abc import Iterable

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
