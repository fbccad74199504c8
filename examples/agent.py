"""A two-tool agent loop with the official `openai` client against `bitnet serve`.

    bitnet serve &                       # any model; the bundled one works
    python examples/agent.py --base-url http://127.0.0.1:8080/v1 "What time is it, and what is 17*3?"

Step 1 forces a tool call (tool_choice "required": the server's grammar makes even a tiny model emit a valid
call), the script runs the tool, sends the result back as a `tool` message, and step 2 lets the model answer in
text (tool_choice "none"). Prints every step; exits 0 when the loop completed. A step 1 cut short (finish_reason
"length": its last call is partial) runs no tool: one line says to raise --max-tokens, or, when the server's context
ended it (fewer tokens than --max-tokens), to start the server with a larger -c. A server
that cannot be reached or refuses a request (a 400: the two tools past a small -c, say) is one line too, exit 1.
"""
from __future__ import annotations

import argparse
import ast
import datetime
import json
import operator
import sys

from openai import APIConnectionError, APIError, OpenAI

TOOLS = [
    {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression with + - * / and parentheses",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["expression"],
                       "properties": {"expression": {"type": "string", "pattern": "^[0-9+*/() .-]{1,40}$"}}}}},
    {"type": "function", "function": {
        "name": "clock", "description": "The current date and time (UTC, ISO 8601)",
        "parameters": {"type": "object", "additionalProperties": False, "properties": {}}}},
]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: str) -> str:
    """Arithmetic only (never eval): walks the expression's syntax tree."""
    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("not arithmetic")
    try:
        return str(ev(ast.parse(expression, mode="eval").body))
    except (ValueError, SyntaxError, ZeroDivisionError, RecursionError) as e:
        return f"error: {e}"


def clock() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def run_tool(name: str, arguments: str) -> str:
    """The tool's result, or one line "error: ..." (sent back to the model as the result) when the arguments are
    not what the tool takes."""
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError as e:
        return f"error: the arguments are not JSON ({e.msg})"
    if not isinstance(args, dict):
        return "error: the arguments are not a JSON object"
    if name == "calculator":
        if not isinstance(args.get("expression"), str):
            return "error: calculator takes {\"expression\": \"...\"}"
        return calculator(args["expression"])
    if name == "clock":
        return clock()
    return f"error: no tool {name}"


def error_line(e: APIError, base_url: str) -> str:
    """One line for what the client raised: the server's own message (its `error.message`) and status, or that it
    could not be reached."""
    if isinstance(e, APIConnectionError):   # (a timeout included)
        return f"agent: cannot reach {base_url} ({e.message}): is `bitnet serve` running there?"
    body = e.body if isinstance(e.body, dict) else {}
    message = body.get("message") if isinstance(body.get("message"), str) else e.message
    status = getattr(e, "status_code", None)
    return "agent: the server answered " + (f"{status}: " if status else "") + " ".join(str(message).split())


def n_ctx_of(client) -> int | None:
    """The server's context (bitnet serve and llama-server give it in /v1/models' meta.n_ctx), or None."""
    try:
        meta = client.models.list().data[0].model_extra.get("meta") or {}
    except (APIError, AttributeError, IndexError):
        return None
    return meta.get("n_ctx") if isinstance(meta.get("n_ctx"), int) else None


def cut_by(response, max_tokens: int, n_ctx: int | None) -> str:
    """What ended an answer with finish_reason "length", and what to do: --max-tokens, or the server's context (the
    answer has fewer tokens than --max-tokens: raising it cannot help)."""
    usage = response.usage
    if usage is None or usage.completion_tokens >= max_tokens:
        return f"cut at {max_tokens} tokens (finish_reason length): raise --max-tokens"
    of = f" of its {n_ctx}-token context" if n_ctx else ""
    return (f"cut by the server's context (finish_reason length: the prompt's {usage.prompt_tokens} tokens and the "
            f"answer's {usage.completion_tokens} filled it{of}): start the server with a larger -c")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("question", nargs="?", default="What time is it, and what is 17*3?")
    ap.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    ap.add_argument("--api-key", default="unused")
    # the bundled model's three calls take 129 tokens: at 128 the last one was cut (finish_reason length)
    ap.add_argument("--max-tokens", type=int, default=256)
    a = ap.parse_args(argv)
    try:
        return agent(a)
    except APIError as e:   # connection refused, a 400 (context_length_exceeded), a 401, ...: one line
        print(error_line(e, a.base_url), file=sys.stderr)
        return 1


def agent(a) -> int:
    """The two steps against the server at a.base_url (APIError out of here when it fails)."""
    client = OpenAI(base_url=a.base_url, api_key=a.api_key, max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": a.question}]
    first = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=a.max_tokens)
    msg = first.choices[0].message
    if first.choices[0].finish_reason == "length":   # a call cut off is not to be run (its arguments are partial)
        print(f"agent: step 1's answer was {cut_by(first, a.max_tokens, n_ctx_of(client))}", file=sys.stderr)
        return 1
    if not msg.tool_calls:
        print(f"agent: step 1 made no tool call (finish_reason {first.choices[0].finish_reason})", file=sys.stderr)
        return 1
    messages.append(msg.model_dump(exclude_none=True))
    for call in msg.tool_calls:
        result = run_tool(call.function.name, call.function.arguments)
        print(f"tool {call.function.name}({call.function.arguments}) -> {result}")
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    final = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="none",
                                           temperature=0, max_tokens=a.max_tokens)
    print(f"answer: {final.choices[0].message.content}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
