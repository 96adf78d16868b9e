"""`hermes`: Qwen2.5, Qwen3 and the Hermes fine-tunes write each call as JSON between tags,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

any text before the first call being the message's content. A call's arguments are the text of its
`arguments` value as written."""

from __future__ import annotations

from infer.server.tool_call_parser import CallListParser
from infer.server.tool_parsers.base import Scanner, ToolParser


class HermesToolParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)

    def new_scanner(self, marker: str) -> tuple[Scanner, str]:
        return CallListParser(single_object=True, argument_keys=("arguments",), needs_arguments=True), ""
