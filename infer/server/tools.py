"""Tool calls on chat completions, as vLLM makes them without a model's own parser.

A `tool_choice` that names a function, or "required", constrains the output to JSON (structured outputs,
the same grammar machinery as response_format; the schema: infer.structured_outputs.tool_calls): the
named function's arguments (its `parameters` schema), or a list of calls `[{"name": ..., "parameters":
{...}}, ...]` whose items are any of the tools (vLLM's schema; at most one with `parallel_tool_calls:
false`). The response then carries that JSON as the message's `tool_calls`, `content` null (OpenAI's
shape), and finish_reason "tool_calls" for "required" ("stop" for a named one, as OpenAI and vLLM). A
call's `arguments` are the text generated for them (for "required", the `parameters` value as written).
Streamed, each call is announced once its name is complete and its arguments follow as they are
generated (infer.server.tool_call_parser), so the stream accumulates to the response that is not
streamed; JSON that is no call's never becomes content.

"auto" (the default when tools are sent) leaves the output free: the tools reach the chat template, and
with --enable-auto-tool-choice the server's --tool-call-parser reads the calls the model writes out of
its text (infer.server.tool_parsers), the text before them being the content; without it, and under
"none", the output is text.
"""

from __future__ import annotations

import secrets

from infer.server.tool_call_parser import CallDelta, CallListParser, NamedCallParser, parse_calls
from infer.server.tool_parsers import ToolParser, tool_parser_class
from infer.structured_outputs.tool_calls import forces_calls, named_function

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
    check_unique_names([tool["function"]["name"] for tool in tools or ()])
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


def check_unique_names(names: list) -> None:
    """Two tools of one name: a call, which names its function, could not say which one it means."""
    first = {}
    for i, name in enumerate(names):
        if name is not None and first.setdefault(name, i) != i:
            raise ValueError(
                f"tools: the name {name!r} is used by tools[{first[name]}] and tools[{i}]; "
                "each tool needs a name of its own"
            )


def as_chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Tools as chat's shape, which chat templates read: {"type": "function", "function": {...}}."""
    if tools is None:
        return None
    functions = [tool["function"] if "function" in tool else _without_type(tool) for tool in tools]
    return [{"type": "function", "function": function} for function in functions]


def _without_type(tool: dict) -> dict:
    return {key: value for key, value in tool.items() if key != "type"}


def as_chat_tool_choice(choice):
    """The Responses API's tool_choice ({"type": "function", "name"}) as chat's."""
    if isinstance(choice, dict) and "function" not in choice:
        return {"type": choice.get("type"), "function": {"name": choice.get("name")}}
    return choice


def call_id() -> str:
    return f"call_{secrets.token_hex(16)}"  # 128 random bits, as every id the server makes


def call_parser(body) -> NamedCallParser | CallListParser:
    """A parser of one choice's forced output (forces_calls(body) holds)."""
    name = named_function(body)
    return NamedCallParser(name) if name is not None else CallListParser()


def finish_reason(parser: NamedCallParser | CallListParser, reason: str | None) -> str | None:
    """The finish_reason: "tool_calls" for "required" calls whose list ended on its own, as OpenAI and
    vLLM ("stop" for a named call; cut short by max_tokens, "length")."""
    if isinstance(parser, CallListParser) and parser.complete and reason == "stop":
        return "tool_calls"
    return reason


def calls_and_reason(body, text: str, reason: str | None) -> tuple[list[dict] | None, str | None]:
    """A finished output's tool calls (None when tool_choice does not force them; empty when the output
    was cut short before a call's name was complete) and its finish_reason. They are what the stream of
    the same output accumulates to, ids aside."""
    if not forces_calls(body):
        return None, reason
    parser = call_parser(body)
    calls = [_call(c["name"], c["arguments"]) for c in parse_calls(parser, text)]
    return calls, finish_reason(parser, reason)


def auto_parser(parser_name: str | None, body) -> ToolParser | None:
    """A parser of the calls in one choice's free output: with --enable-auto-tool-choice, tools and
    tool_choice "auto" (or left out); None otherwise."""
    if parser_name is None or not body.tools or body.tool_choice not in (None, "auto"):
        return None
    return tool_parser_class(parser_name)()


def auto_finish_reason(has_calls: bool, reason: str | None) -> str | None:
    """vLLM's: "tool_calls" once the output holds calls that parsed (an abort stays an abort)."""
    return "tool_calls" if has_calls and reason in ("stop", "length") else reason


def streamed_call(delta: CallDelta, new_id=call_id) -> dict:
    """A CallDelta as an entry of a chunk's `delta.tool_calls`: the id, type and name in the call's
    first entry only (clients concatenate what repeats)."""
    if delta.name is None:
        return {"index": delta.index, "function": {"arguments": delta.arguments}}
    function = {"name": delta.name, "arguments": delta.arguments}
    return {"index": delta.index, "id": new_id(), "type": "function", "function": function}


def _call(name: str, arguments: str) -> dict:
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
