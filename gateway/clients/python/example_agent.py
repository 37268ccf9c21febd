"""An example agent: its own model loop and two tools, with ctxgate as the
context layer. Every model call is preceded by a context from the gateway.

    gateway/clients/python/run.sh example --gateway http://127.0.0.1:7300 \\
        --model-url https://api.openai.com/v1 --model gpt-4.1-mini --session demo --turns 3

Tools: ``calculator`` (arithmetic) and ``read_file`` (a file under --workdir).
The model is any OpenAI-compatible chat-completions server (--model-url;
the key comes from OPENAI_API_KEY). Each finished turn prints one JSON line.
"""

import argparse
import ast
import json
import operator
import os
import sys
import urllib.error
import urllib.request

from ctxgate_harness import Gateway, Host, Model, TurnFailed, assistant, openai_tools, to_openai, tool_result

SYSTEM = "You are a careful assistant. Use the tools when they help; answer briefly."

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluates an arithmetic expression (+ - * / ** % and parentheses).",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Reads a text file from the agent's work directory.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    },
]

DEFAULT_PROMPTS = [
    "What is {n} times 7, plus 1? And what do my notes say?",
    "Check notes.txt again and compute {n} * 7 + 1 for me.",
]

MAX_STEPS = 8  # model calls per turn
MAX_FILE_BYTES = 64 * 1024

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.Mod: operator.mod,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculate(expression):
    """Arithmetic only: no names, no calls."""

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            if isinstance(node.op, ast.Pow) and abs(ev(node.right)) > 100:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("only arithmetic is allowed")

    if len(expression) > 200:
        raise ValueError("expression too long")
    return ev(ast.parse(expression, mode="eval"))


def read_file(workdir, path):
    """A file under ``workdir`` (no escaping it), at most 64 KiB."""
    root = os.path.realpath(workdir)
    full = os.path.realpath(os.path.join(root, path))
    if os.path.commonpath([root, full]) != root:
        raise ValueError(f"{path}: outside the work directory")
    with open(full, "rb") as f:
        data = f.read(MAX_FILE_BYTES + 1)
    text = data[:MAX_FILE_BYTES].decode("utf-8", errors="replace")
    return text + ("\n[truncated]" if len(data) > MAX_FILE_BYTES else "")


def run_tool(workdir, name, arguments_json):
    """(text, is_error) for one tool call."""
    try:
        args = json.loads(arguments_json or "{}")
        if name == "calculator":
            return str(calculate(str(args.get("expression", "")))), False
        if name == "read_file":
            return read_file(workdir, str(args.get("path", ""))), False
        return f"unknown tool {name!r}", True
    except Exception as e:  # a tool failure is the model's to handle
        return f"error: {e}", True


class Overflow(Exception):
    pass


def chat(model_url, model, messages, max_tokens, api_key, tools=TOOLS):
    """One non-streaming chat completion: the assistant message dict."""
    body = json.dumps(
        {"model": model, "messages": messages, "tools": tools, "max_tokens": max_tokens, "stream": False}
    ).encode()
    req = urllib.request.Request(
        model_url.rstrip("/") + "/chat/completions", data=body, headers={"content-type": "application/json"}
    )
    if api_key:
        req.add_header("authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            reply = json.load(resp)
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")
        if e.code == 400 and "context_length_exceeded" in detail:
            raise Overflow(detail) from e
        raise RuntimeError(f"model call failed: HTTP {e.code}: {detail[:300]}") from e
    return reply["choices"][0]["message"], reply.get("usage") or {}


def one_turn(gw, args, n, prompt):
    """Runs one turn; returns its report."""
    model = Model(args.model, args.context_window, args.max_output_tokens, provider="openai-compatible")
    report = {"turn": n, "model_calls": 0, "contexts": 0, "tool_calls": 0}
    with gw.begin(args.session, Host(args.name), model, prompt, tools=[t["function"]["name"] for t in TOOLS],
                  system_prompt=SYSTEM) as turn:
        ctx = turn.context
        for _ in range(MAX_STEPS):
            system = SYSTEM + ("\n\n" + ctx.system_prompt_addition if ctx.system_prompt_addition else "")
            try:
                report["model_calls"] += 1
                # The engine's tools (e.g. history_search) beside the agent's own.
                tools = TOOLS + openai_tools(ctx.engine_tools)
                message, usage = chat(args.model_url, args.model, to_openai(ctx.messages, system),
                                      args.max_output_tokens or 1024, args.api_key, tools)
            except Overflow:
                try:
                    ctx = turn.overflow()
                    continue
                except TurnFailed as e:
                    turn.end("failed", str(e))
                    report["failed"] = e.reason
                    return report
            calls = [(c["id"], c["function"]["name"], c["function"].get("arguments", "{}"))
                     for c in message.get("tool_calls") or []]
            usage_fields = {
                "input_tokens": usage.get("prompt_tokens"),
                "output_tokens": usage.get("completion_tokens"),
                "total_tokens": usage.get("total_tokens"),
            }
            turn.append([assistant(message.get("content") or "", calls,
                                   {k: v for k, v in usage_fields.items() if v is not None})])
            if not calls:
                report["reply"] = message.get("content") or ""
                break
            report["tool_calls"] += len(calls)
            engine_tools = turn.engine_tool_names()
            for (i, name, a) in calls:
                if name in engine_tools:
                    turn.call_tool(i)  # the gateway runs it and stores the result
                    report["engine_tool_calls"] = report.get("engine_tool_calls", 0) + 1
                else:
                    turn.append([tool_result(i, name, *run_tool(args.workdir, name, a))])
            ctx = turn.assemble()  # before the next model call
        else:
            report["reply"] = "(stopped: too many steps)"
        ended = turn.end("accepted")
        report["contexts"] = turn.contexts
        report["engine"] = turn.engine.engine_id
        report["engine_committed"] = ended.engine_committed
    return report


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gateway", required=True, help="the gateway's API, e.g. http://127.0.0.1:7300")
    p.add_argument("--model-url", required=True, help="an OpenAI-compatible base URL, e.g. https://api.openai.com/v1")
    p.add_argument("--model", default="gpt-4.1-mini")
    p.add_argument("--session", required=True, help="the session key")
    p.add_argument("--turns", type=int, default=1)
    p.add_argument("--prompt", action="append", help="a user message ({n} is the turn number); repeatable")
    p.add_argument("--workdir", default=".", help="where read_file reads")
    p.add_argument("--name", default="example", help="the harness name (host id agent-harness:<name>)")
    p.add_argument("--context-window", type=int, default=32_000)
    p.add_argument("--max-output-tokens", type=int, default=1_024)
    p.add_argument("--token", default=os.environ.get("CTXGATE_AUTH_TOKEN"), help="the gateway's bearer token")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    args = p.parse_args()
    if args.turns < 1:
        p.error("--turns must be at least 1")
    prompts = args.prompt or DEFAULT_PROMPTS
    gw = Gateway(args.gateway, token=args.token)
    try:
        for n in range(args.turns):
            report = one_turn(gw, args, n, prompts[n % len(prompts)].format(n=n))
            print(json.dumps(report), flush=True)
    except Exception as e:
        print(f"example agent: {e}", file=sys.stderr)
        return 1
    finally:
        gw.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
