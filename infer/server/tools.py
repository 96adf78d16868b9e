"""Tool calls on chat completions, as vLLM makes them without a model's own parser.

A `tool_choice` that names a function, or "required", constrains the output to JSON (structured outputs,
the same grammar machinery as response_format): the named function's arguments (its `parameters`
schema), or a list of calls `[{"name": ..., "parameters": {...}}, ...]` whose items are any of the
tools (vLLM's schema; at most one with `parallel_tool_calls: false`). The response then carries that
JSON as the message's `tool_calls`, `content` null (OpenAI's shape), and finish_reason "tool_calls" for
"required" ("stop" for a named one, as OpenAI and vLLM). Streamed, a named call's arguments stream as
they come; "required" calls come in one chunk at the end (they are known once the list is complete).

"auto" (the default when tools are sent) and "none" leave the output as text: the tools reach the chat
template, and nothing reads calls out of the text (vLLM does that only with a model-specific
--tool-call-parser; none is built here).
"""

from __future__ import annotations

import json
import secrets

MAX_TOOLS = 128


def check_tools(tools: list[dict] | None, tool_choice) -> None:
    """vLLM's checks of a chat request's tools and tool_choice (ValueError: a 400)."""
    if tools is not None and not tools:
        raise ValueError("tools must not be an empty array; send at least one tool or leave it out")
    for i, tool in enumerate(tools or ()):
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict):
            raise ValueError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ...}}}}')
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string")
        if not isinstance(function.get("parameters", {}), dict | None):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema (an object)")
    if tools is not None and len(tools) > MAX_TOOLS:
        raise ValueError(f"tools: at most {MAX_TOOLS} tools, got {len(tools)}")
    if tool_choice in (None, "none"):
        return
    if not tools:
        raise ValueError("tool_choice needs tools: send the functions it may call")
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        if tool_choice.get("type") != "function" or not isinstance(function, dict):
            raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                             '"function": {"name": ...}}')  # fmt: skip
        if function.get("name") not in {tool["function"]["name"] for tool in tools}:
            raise ValueError(f"tool_choice names {function.get('name')!r}, which is not among the tools")


def named_function(body) -> str | None:
    choice = body.tool_choice
    return choice["function"]["name"] if isinstance(choice, dict) else None


def forces_calls(body) -> bool:
    """The output is tool calls (a named function, or "required")."""
    return body.tools is not None and (body.tool_choice == "required" or named_function(body) is not None)


def _parameters(function: dict) -> dict:
    return function.get("parameters") or {"type": "object", "properties": {}}


def tool_schema(body) -> dict | None:
    """The JSON schema the output must follow, or None when tool_choice does not force calls."""
    if not forces_calls(body):
        return None
    functions = [tool["function"] for tool in body.tools]
    name = named_function(body)
    if name is not None:
        return _parameters(next(f for f in functions if f["name"] == name))
    defs, calls = {}, []
    for function in functions:
        parameters = dict(_parameters(function))
        for key, value in (parameters.pop("$defs", None) or {}).items():
            if defs.setdefault(key, value) != value:  # vLLM's rule: $defs merge into one namespace
                raise ValueError(f"tools: the definition {key!r} has two different schemas")
        name_schema = {"type": "string", "enum": [function["name"]]}
        properties = {"name": name_schema, "parameters": parameters}
        calls.append({"properties": properties, "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    if body.parallel_tool_calls is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def call_id() -> str:
    return f"call_{secrets.token_hex(16)}"  # 128 random bits, as every id the server makes


def calls_and_reason(body, text: str, reason: str | None) -> tuple[list[dict] | None, str | None]:
    """A finished output's tool calls (None: it holds none) and its finish_reason: "tool_calls" for
    "required" calls that ended on their own, as OpenAI and vLLM ("stop" for a named call)."""
    calls = tool_calls(body, text) if forces_calls(body) else None
    if calls is not None and body.tool_choice == "required" and reason == "stop":
        reason = "tool_calls"
    return calls, reason


def tool_calls(body, text: str) -> list[dict] | None:
    """The calls in a finished output; None if it is not a complete list (cut short by max_tokens)."""
    name = named_function(body)
    if name is not None:
        return [_call(name, text)]
    try:
        calls = json.loads(text)
    except ValueError:
        return None
    if not isinstance(calls, list) or not all(isinstance(c, dict) and "name" in c for c in calls):
        return None
    return [_call(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False)) for c in calls]


def _call(name: str, arguments: str) -> dict:
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
