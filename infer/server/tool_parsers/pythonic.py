"""`pythonic`: Llama 3.2's small models (and others prompted so) answer with a Python list of calls,

    [get_weather(city='Paris', metric='celsius'), get_time()]

the whole output being the list (text first: no calls, as vLLM). Arguments are Python literals, turned
into JSON; a call whose arguments have no JSON form (bytes, inf) is left out, its siblings kept. A call
is sent whole, name and arguments, once its closing parenthesis arrives: a prefix of Python literals
has no JSON prefix to send."""

from __future__ import annotations

import ast
import json

from infer.server.tool_call_parser import CallDelta
from infer.server.tool_parsers.base import Scanner, ToolParser

_WHITESPACE = " \t\n\r"
_OPENING = "([{"
_CLOSING = ")]}"


def _call(text: str) -> tuple[str, str] | None:
    """(name, JSON arguments) of one call's text `name(key=literal, ...)`; None if it has no JSON form.
    Raises SyntaxError for text that is no call."""
    node = ast.parse(text, mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        raise SyntaxError("not a call with keyword arguments")
    if any(kw.arg is None for kw in node.keywords):  # **kwargs
        raise SyntaxError("not a call with keyword arguments")
    try:
        arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        return node.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return None


class _CallList(Scanner):
    """After `[`: calls separated by commas, up to `]`."""

    def __init__(self):
        self._state = "call"  # call | name | arguments | after
        self._text = ""  # the current call's text
        self._depth = 0
        self._quote = ""  # the open string's quote character
        self._escaped = False

    def feed(self, char: str) -> list[CallDelta]:
        if self._state == "arguments":
            return self._argument_char(char)
        if char in _WHITESPACE and self._state != "name":
            return []
        if self._state == "call":
            self._state, self._text = "name", ""
        if self._state == "name":
            if char.isidentifier() or (self._text and char.isalnum()):
                self._text += char
            elif char == "(" and self._text:
                self._text += char
                self._state = "arguments"
            else:
                self.failed = True
        elif char == ",":
            self._state = "call"
        elif char == "]" and self.num_calls:
            self.complete = True
        else:
            self.failed = True
        return []

    def _argument_char(self, char: str) -> list[CallDelta]:
        self._text += char
        if self._quote:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == self._quote:
                self._quote = ""
        elif char in "'\"":
            self._quote = char
        elif char in _OPENING:
            self._depth += 1
        elif char in _CLOSING and self._depth:
            self._depth -= 1
        elif char == ")":
            return self._end_call()
        return []

    def _end_call(self) -> list[CallDelta]:
        self._state = "after"
        try:
            call = _call(self._text)
        except (SyntaxError, ValueError, RecursionError):
            self.failed = True
            return []
        if call is None:  # no JSON form: left out (vLLM's), its siblings kept
            return []
        self.num_calls += 1
        return [CallDelta(self.num_calls - 1, name=call[0], arguments=call[1])]


class PythonicToolParser(ToolParser):
    name = "pythonic"
    markers = ("[",)
    keeps_special_tokens = False

    def __init__(self):
        super().__init__()
        self._started = False  # a character other than whitespace has come

    def new_scanner(self, marker: str) -> tuple[Scanner, str]:
        return _CallList(), ""

    def _watch(self, char: str) -> None:
        """Only a list that begins the output holds calls: anything else first makes it all text."""
        if self._started or self.num_calls:
            if self._mode == "content":
                self._content(self._held + char)
                self._held = ""
            return
        if char in _WHITESPACE:
            self._held += char
            return
        self._started = True
        if char == "[":
            held, self._held = self._held, ""
            self._open_section(char)
            self._raw = held + self._raw  # leading whitespace: content only if no call follows
        else:
            self._content(self._held + char)
            self._held = ""
