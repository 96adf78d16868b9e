"""A Responses API request's `input` as the chat messages it amounts to: a string is one user message;
items are messages (a string, or input_text / output_text parts, joined as chat joins text parts),
`function_call` items (an assistant's calls, joined to the assistant message before them) and
`function_call_output` items (a tool's answer: chat's `tool` message). Anything else is a 400."""

from __future__ import annotations

from infer.server.protocol import bad_request

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")


def input_messages(items: str | list[dict]) -> list[dict]:
    """The request's input as chat messages; 400 for items that are not messages of text, function calls
    or their outputs. Calls join the assistant message before them (one turn), or make one."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "function_call":
            call = _input_call(item, i)
            if not (messages and messages[-1]["role"] == "assistant"):
                messages.append({"role": "assistant", "content": ""})
            messages[-1] = {**messages[-1], "tool_calls": [*messages[-1].get("tool_calls", []), call]}
            continue
        if kind == "function_call_output":
            messages.append(_input_call_output(item, i))
            continue
        if kind != "message":
            raise bad_request(
                f"input[{i}]: items of type {kind!r} are not supported; this server takes messages of text, "
                "function_call and function_call_output items (no reasoning, files or images)",
                param="input",
            )
        role = item.get("role")
        if role not in _ROLES:
            raise bad_request(
                f"input[{i}].role must be one of {', '.join(_ROLES)}; got {role!r}", param="input"
            )
        messages.append({"role": _ROLES[role], "content": _text(item.get("content"), f"input[{i}].content")})
    return messages


def _text(content, where: str) -> str:
    """A string, or text parts joined as chat joins them; 400 otherwise."""
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not _is_text_part(part):
                raise bad_request(
                    f"{where}[{j}]: only text parts (input_text, output_text) are supported", param="input"
                )
        content = "\n".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise bad_request(f"{where} must be a string or a list of text parts", param="input")
    return content


def _input_call(item: dict, i: int) -> dict:
    """A function_call item as a chat tool call."""
    for field in ("call_id", "name", "arguments"):
        if not isinstance(item.get(field), str):
            raise bad_request(f"input[{i}]: a function_call needs {field} (a string)", param="input")
    function = {"name": item["name"], "arguments": item["arguments"]}
    return {"id": item["call_id"], "type": "function", "function": function}


def _input_call_output(item: dict, i: int) -> dict:
    """A function_call_output item as chat's tool message."""
    if not isinstance(item.get("call_id"), str):
        raise bad_request(f"input[{i}]: a function_call_output needs call_id (a string)", param="input")
    output = _text(item.get("output"), f"input[{i}].output")
    return {"role": "tool", "tool_call_id": item["call_id"], "content": output}


def _is_text_part(part) -> bool:
    return isinstance(part, dict) and part.get("type") in _TEXT_PARTS and isinstance(part.get("text"), str)
