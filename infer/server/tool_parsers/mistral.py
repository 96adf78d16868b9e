"""`mistral`: Mistral's models open their calls with the `[TOOL_CALLS]` token, in one of two forms:

    [TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}, {"name": ...}]     tokenizers before v11
    [TOOL_CALLS]add{"a": 1}[TOOL_CALLS]multiply{"a": 3}                      v11 and later

Text before the first call is content. Ids are 9 letters and digits, the only ones Mistral's chat
templates accept back in the history."""

from __future__ import annotations

from infer.server.tool_call_parser import CallDelta, CallListParser, JsonNesting
from infer.server.tool_parsers.base import Scanner, ToolParser, short_id

_WHITESPACE = " \t\n\r"


class _MistralSection(Scanner):
    """After `[TOOL_CALLS]`: a JSON list of calls, or a name and its arguments object."""

    def __init__(self):
        self._list: CallListParser | None = None
        self._name = ""
        self._nesting = JsonNesting()  # where the arguments' text stands

    def feed(self, char: str) -> list[CallDelta]:
        if self._list is not None:
            deltas = self._list.feed(char)
            self.complete, self.failed = self._list.complete, self._list.failed
            self.num_calls = self._list.num_calls
            return deltas
        if self.num_calls:
            return self._arguments(char)
        if not self._name and char in _WHITESPACE:
            return []
        if not self._name and char == "[":
            self._list = CallListParser(argument_keys=("arguments",), needs_arguments=True)
            return self.feed(char)
        if char == "{" and self._name:
            self.num_calls = 1
            return [CallDelta(0, name=self._name), *self._arguments(char)]
        if char.isalnum() or char in "_-.":
            self._name += char
        else:
            self.failed = True
        return []

    def _arguments(self, char: str) -> list[CallDelta]:
        """The arguments object's raw text, until its brackets close."""
        nesting = self._nesting
        if not nesting.feed(char):
            self.failed = True
            return []
        if char in "]}" and not nesting.in_string:
            self.complete = not nesting.stack
        return [CallDelta(0, arguments=char)]


class MistralToolParser(ToolParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)

    def new_scanner(self, marker: str) -> tuple[Scanner, str]:
        return _MistralSection(), ""

    def call_id(self) -> str:
        return short_id()
