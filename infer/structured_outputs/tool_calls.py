"""The grammar a forced tool_choice puts on the output, as vLLM builds it without a model's own parser.

A tool_choice that names a function constrains the output to that function's arguments (its
`parameters` schema); "required" to a list of calls `[{"name": ..., "parameters": {...}}, ...]` whose
items are any of the tools (vLLM's schema; at most one with `parallel_tool_calls: false`). `body` is a
chat or Responses request (their tools' shapes differ: function_of reads either).
"""

from __future__ import annotations


def named_function(body) -> str | None:
    """The function a tool_choice names: chat's {"function": {"name"}}, the Responses API's {"name"}."""
    choice = body.tool_choice
    return function_of(choice)["name"] if isinstance(choice, dict) else None


def function_of(tool: dict) -> dict:
    """A tool's function (name, description, parameters): nested in chat's tools, the tool itself in the
    Responses API's."""
    return tool.get("function", tool)


def forces_calls(body) -> bool:
    """The output is tool calls (a named function, or "required")."""
    return body.tools is not None and (body.tool_choice == "required" or named_function(body) is not None)


def _parameters(function: dict) -> dict:
    return function.get("parameters") or {"type": "object", "properties": {}}


def tool_schema(body) -> dict | None:
    """The JSON schema the output must follow, or None when tool_choice does not force calls."""
    if not forces_calls(body):
        return None
    functions = [function_of(tool) for tool in body.tools]
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
