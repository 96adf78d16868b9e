"""`hermes`: Qwen2.5, Qwen3 and the Hermes fine-tunes write each call as JSON between tags,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

any text before the first call being the message's content. A call's arguments are the text of its
`arguments` value as written; some fine-tunes (Granite 4) write that value as a JSON string holding the
serialized object, which is then unwrapped once (vLLM's rule: only a string that holds a JSON object;
any other string stays the JSON string it is). A string's rule is known when it closes, so its text
waits for that."""

from __future__ import annotations

import json

from infer.server.tool_call_parser import CallDelta, CallListParser
from infer.server.tool_parsers.base import Scanner, ToolParser

_WHITESPACE = " \t\n\r"


class _UnwrappedArguments(Scanner):
    """The call object's scanner, with a string-valued `arguments` unwrapped when it holds an object."""

    def __init__(self):
        self._calls = CallListParser(single_object=True, argument_keys=("arguments",), needs_arguments=True)
        self._string: str | None = None  # the arguments' text while it is a string not yet closed
        self._escaped = False
        self._sent = False  # some of the arguments has been sent: a quote is inside them, not their start

    def feed(self, char: str) -> list[CallDelta]:
        out = []
        for delta in self._calls.feed(char):
            arguments = self._arguments(delta.arguments)
            if delta.name is not None or arguments:
                out.append(CallDelta(delta.index, delta.name, arguments))
        self.complete, self.failed, self.num_calls = (
            self._calls.complete,
            self._calls.failed,
            self._calls.num_calls,
        )
        return out

    def _arguments(self, text: str) -> str:
        """What of the arguments' text to send: as it comes, but for a string, held until it closes."""
        out = ""
        for char in text:
            if self._string is None:
                if char == '"' and not self._sent:
                    self._string = char
                else:
                    out += char
                    self._sent = self._sent or char not in _WHITESPACE
                continue
            self._string += char
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                out += _unwrapped(self._string)
                self._string, self._sent = None, True
        return out


def _unwrapped(literal: str) -> str:
    """A JSON string literal of arguments: the object it serializes, or the literal itself."""
    value = json.loads(literal)
    try:
        inner = json.loads(value)
    except ValueError:
        return literal
    return value.strip() if isinstance(inner, dict) else literal


class HermesToolParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)

    def new_scanner(self, marker: str) -> tuple[Scanner, str]:
        return _UnwrappedArguments(), ""
