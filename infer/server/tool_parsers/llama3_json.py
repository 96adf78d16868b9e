"""`llama3_json`: Llama 3.1 and 3.2 answer a tool prompt with a JSON call, after `<|python_tag|>` or
without it, several separated by `;`:

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}

A call is any JSON object with a name and `parameters` (or `arguments`), as vLLM reads them: text before
the first call is content, text after the calls is dropped. An object that is no call (no name, or no
arguments) stays text."""

from __future__ import annotations

from infer.server.tool_call_parser import CallListParser
from infer.server.tool_parsers.base import Scanner, ToolParser

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    markers = (PYTHON_TAG, "{")

    def new_scanner(self, marker: str) -> tuple[Scanner, str]:
        keys = ("parameters", "arguments")
        scanner = CallListParser(single_object=True, argument_keys=keys, needs_arguments=True)
        return scanner, "{" if marker == "{" else ""
