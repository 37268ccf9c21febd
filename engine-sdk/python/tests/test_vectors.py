"""The shared validation vectors (`proto/testdata/`): every request and
result is accepted or refused exactly as the vector says, with the status
code and the field path -- by the validation itself, and over the wire
(a refused request never reaches the engine). And `fit_budget` keeps of
every budget vector what it says."""

from __future__ import annotations

import json
import os
from typing import Any

import grpc
import grpc.aio
from google.protobuf import json_format
from google.protobuf.message import Message

from ctxgate_engine import fit_budget, validate
from ctxgate_engine.pb import pb, types
from helpers import REPLIES, REQUESTS, REPO, run_async, serving, unary, compact
from probe import ProbeWithTools

RESULTS: dict[str, type[Message]] = {
    "GetInfo": pb.EngineInfo, "Assemble": pb.AssembleResult, "CommitTurn": pb.CommitTurnResult,
    "Maintain": pb.MaintainResult, "CallTool": pb.CallToolResult,
}


def load(name: str) -> list[dict[str, Any]]:
    with open(os.path.join(REPO, "proto", "testdata", name)) as f:
        cases: list[dict[str, Any]] = json.load(f)
    return cases


def expand(v: Any) -> Any:
    """`{"$repeat": s, "times": n, "then"?: t}` as its string."""
    if isinstance(v, dict):
        if "$repeat" in v:
            return v["$repeat"] * v["times"] + v.get("then", "")
        return {k: expand(x) for k, x in v.items()}
    if isinstance(v, list):
        return [expand(x) for x in v]
    return v


def decode(kind: type[Message], v: Any) -> Message:
    return json_format.ParseDict(expand(v), kind())


def disagreement(case: dict[str, Any], got: validate.Violation | None) -> str | None:
    name, expect = case["name"], case["expect"]
    if got is None:
        return None if expect.get("ok") else f"{name}: accepted, the vector refuses it ({expect})"
    if expect.get("ok"):
        return f"{name}: refused ({got}), the vector accepts it"
    if (got.code.name, got.field) != (expect["code"], expect["field"]):
        return f"{name}: refused as {got.code.name} at {got.field!r} ({got}), the vector says {expect}"
    return None


def violation(check: Any, *args: Any) -> validate.Violation | None:
    try:
        check(*args)
    except validate.Violation as v:
        return v
    return None


def test_every_request_vector_is_accepted_or_refused_as_it_says() -> None:
    cases = load("requests.json")
    assert len(cases) >= 40, "the vectors are all there"
    problems = [p for c in cases if (p := disagreement(c, violation(
        validate.check_request, c["method"], decode(REQUESTS[c["method"]], c["request"])))) is not None]
    assert not problems, "\n".join(problems)


def test_every_result_vector_is_accepted_or_refused_as_it_says() -> None:
    cases = load("results.json")
    assert len(cases) >= 30, "the vectors are all there"
    checks: dict[str, Any] = {
        "GetInfo": validate.result_info, "CommitTurn": validate.result_commit_turn,
        "Maintain": validate.result_maintain, "CallTool": validate.result_call_tool,
    }
    problems = []
    for c in cases:
        result = decode(RESULTS[c["method"]], c["result"])
        if c["method"] == "Assemble":
            got = violation(validate.result_assemble, result, c.get("requestMessages", 0))
        else:
            got = violation(checks[c["method"]], result)
        if (p := disagreement(c, got)) is not None:
            problems.append(p)
    assert not problems, "\n".join(problems)


def test_every_budget_vector_keeps_what_it_says() -> None:
    cases = load("budget.json")
    assert len(cases) >= 10, "the vectors are all there"
    problems = []
    for c in cases:
        messages = [json_format.ParseDict(expand(m), types.AgentMessage()) for m in c["messages"]]
        kept, tokens = fit_budget(messages, c["budget"])
        ids = [m.id for m in kept]
        if (ids, tokens) != (c["kept"], c["estimatedTokens"]):
            problems.append(f"{c['name']}: kept {ids} ({tokens} tokens), "
                            f"the vector says {c['kept']} ({c['estimatedTokens']})")
    assert not problems, "\n".join(problems)


@run_async
async def test_every_request_vector_gets_the_same_answer_over_the_wire() -> None:
    """The status code, and a message that starts with the field path."""
    engine = ProbeWithTools()
    async with serving(engine) as (_, channel):
        problems = []
        for c in load("requests.json"):
            method, expect = c["method"], c["expect"]
            request = decode(REQUESTS[method], c["request"])
            seen = len(engine.seen)
            try:
                if method == "Compact":
                    async for _ in compact(channel)(request, timeout=10):
                        pass
                else:
                    await unary(channel, method, REPLIES[method])(request, timeout=10)
                got = None
            except grpc.aio.AioRpcError as e:
                got = e
            if expect.get("ok"):
                # Accepted: it reached the engine (which may not implement it).
                if got is not None and got.code() != grpc.StatusCode.UNIMPLEMENTED:
                    problems.append(f"{c['name']}: {got.code().name} {got.details()}")
            elif got is None or got.code().name != expect["code"] or \
                    not (got.details() or "").startswith(f"{expect['field']}: "):
                what = "OK" if got is None else f"{got.code().name} {got.details()!r}"
                problems.append(f"{c['name']}: {what}, the vector says {expect}")
            elif len(engine.seen) != seen:
                problems.append(f"{c['name']}: refused, but it reached the engine")
        assert not problems, "\n".join(problems)
