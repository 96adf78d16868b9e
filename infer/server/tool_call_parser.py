"""Tool calls read out of forced output as it is generated, one text delta at a time.

Under a forced tool_choice the output is JSON (infer.server.tools): a named function's arguments, or a
list of calls `[{"name": ..., "parameters": {...}}, ...]`. A parser is fed the output's text deltas and
returns what each adds to the calls, as the OpenAI stream carries it:

    [{"name":"get_weather","parameters":{"city":"Paris"}},{"name":"get_time", ...
                   name complete: CallDelta(0, name="get_weather")
                                    {"city":"Paris"}  arguments of call 0, as they arrive
                                                                  CallDelta(1, name="get_time") ...

A call's arguments are the text of its `parameters` value exactly as generated (whitespace included), so
the deltas of a call concatenate to what a response that is not streamed returns. A call is announced
once its name is complete; arguments generated before that (a `parameters` key ahead of `name`) wait for
it. Text outside the calls (brackets, commas, other keys) is no call's and is never returned.

The same scan reads one call object, `{"name": ..., "arguments": {...}}`, inside the text a model writes on
its own (infer.server.tool_parsers): `CallListParser(single_object=True, argument_keys=("arguments",))`.

The scan is one pass over each character, in O(1) state besides the open brackets of the current value
and the text of a name or key being read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_WHITESPACE = " \t\n\r"
_CLOSING = {"{": "}", "[": "]"}


class JsonNesting:
    """Where the characters of a JSON value stand, fed one at a time: inside a string or not, and the
    brackets open around them."""

    def __init__(self) -> None:
        self.stack: list[str] = []  # the closing brackets awaited, innermost last
        self.in_string = self.escaped = False

    def feed(self, char: str) -> bool:
        """Take one character; False when it closes a bracket that is not open."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
        elif char == '"':
            self.in_string = True
        elif char in _CLOSING:
            self.stack.append(_CLOSING[char])
        elif char in "]}":
            return bool(self.stack) and self.stack.pop() == char
        return True


@dataclass
class CallDelta:
    """What one fed text adds to call `index`: its name in the call's first delta only (with the id a
    server gives it), then argument text."""

    index: int
    name: str | None = None
    arguments: str = ""


class NamedCallParser:
    """A named tool_choice: the whole output is the one call's arguments."""

    def __init__(self, name: str):
        self.name, self.started = name, False

    def feed(self, text: str) -> list[CallDelta]:
        if self.started:
            return [CallDelta(0, arguments=text)] if text else []
        self.started = True
        return [CallDelta(0, name=self.name, arguments=text)]


class _Call:
    def __init__(self):
        self.index = -1  # given when the name is complete: an object without one is no call
        self.name: str | None = None
        self.has_parameters = False
        self.pending = ""  # arguments generated before the name was complete


class CallListParser:
    """tool_choice "required": a JSON list of {"name", "parameters"} objects, fed as it is generated.
    `complete` once the list has closed; text after it, or after anything that is not such a list,
    is ignored.

    `single_object`: one call object, not a list of them. `argument_keys`: the keys whose value is the
    call's arguments (the first one present counts). `needs_arguments`: a call is announced only once its
    arguments begin, so that an object with a name and no arguments is no call (what a model writes
    unprompted may be any JSON); otherwise a call without arguments has "{}"."""

    def __init__(
        self,
        single_object: bool = False,
        argument_keys: tuple[str, ...] = ("parameters",),
        needs_arguments: bool = False,
    ):
        self._state = self._item_start if single_object else self._before_list
        self.single_object, self.argument_keys = single_object, argument_keys
        self.needs_arguments = needs_arguments
        self.complete = False
        self.failed = False
        self._call = _Call()
        self._num_calls = 0  # calls announced
        self._target: str | None = None  # what the value being scanned is: "name", "parameters" or neither
        self._key = ""  # raw text of the key being read, then its decoded value
        self._value: list[str] = []  # raw text of a `name` value being read
        self._nesting = JsonNesting()  # where the value being scanned stands
        self._escaped = False
        self._out: list[CallDelta] = []

    def feed(self, text: str) -> list[CallDelta]:
        for char in text:
            if self.complete or self.failed:
                break
            self._state(char)
        out, self._out = self._out, []
        return _merged(out)

    # each state takes one character

    def _before_list(self, char: str) -> None:
        if char == "[":
            self._state = self._list_start
        elif char not in _WHITESPACE:
            self.failed = True

    def _list_start(self, char: str) -> None:
        if char == "]":
            self.complete = True
        else:
            self._item_start(char)

    def _item_start(self, char: str) -> None:
        if char == "{":
            self._call = _Call()
            self._state = self._key_or_end
        elif char not in _WHITESPACE:
            self.failed = True

    def _key_or_end(self, char: str) -> None:
        if char == "}":
            self._end_call()
        else:
            self._key_start(char)

    def _key_start(self, char: str) -> None:
        if char == '"':
            self._key, self._escaped, self._state = "", False, self._key_text
        elif char not in _WHITESPACE:
            self.failed = True

    def _key_text(self, char: str) -> None:
        if self._escaped:
            self._escaped = False
        elif char == "\\":
            self._escaped = True
        elif char == '"':
            self._key = _decoded(f'"{self._key}"')
            self._state = self._colon
            return
        self._key += char

    def _colon(self, char: str) -> None:
        if char == ":":
            self._state = self._value_start
        elif char not in _WHITESPACE:
            self.failed = True

    @property
    def num_calls(self) -> int:
        """Calls announced so far."""
        return self._num_calls

    def _value_start(self, char: str) -> None:
        if char in _WHITESPACE:
            return
        call = self._call
        self._target = None
        if self._key == "name" and call.name is None:
            self._target, self._value = "name", []
        elif self._key in self.argument_keys and not call.has_parameters:
            self._target, call.has_parameters = "parameters", True
            if call.name is not None and call.index < 0:
                self._announce()
        self._nesting = JsonNesting()
        self._state = self._value_text
        self._value_text(char)

    def _value_text(self, char: str) -> None:
        """One character of a value; a scalar ends at the first character not its own, which then
        belongs to what follows the value."""
        nesting = self._nesting
        if not (nesting.in_string or nesting.stack) and (char in _WHITESPACE or char in ",]}"):
            self._end_value()
            self._after_value(char)
            return
        if not nesting.feed(char):
            self.failed = True
            return
        self._value_char(char)
        if not (nesting.stack or nesting.in_string) and (char == '"' or char in "]}"):
            self._end_value()  # a string, object or list just closed

    def _value_char(self, char: str) -> None:
        if self._target == "name":
            self._value.append(char)
        elif self._target == "parameters":
            self._arguments(char)

    def _end_value(self) -> None:
        self._state = self._after_value
        if self._target != "name":
            return
        name = _decoded("".join(self._value))
        if not isinstance(name, str):
            self.failed = True  # not a call: the grammar's schema makes names strings
            return
        self._call.name = name
        if self._call.has_parameters or not self.needs_arguments:
            self._announce()

    def _announce(self) -> None:
        call = self._call
        call.index = self._num_calls
        self._num_calls += 1
        self._out.append(CallDelta(call.index, name=call.name, arguments=call.pending))

    def _after_value(self, char: str) -> None:
        if char == ",":
            self._state = self._key_start
        elif char == "}":
            self._end_call()
        elif char not in _WHITESPACE:
            self.failed = True

    def _end_call(self) -> None:
        call = self._call
        if call.index >= 0 and not call.has_parameters:  # no parameters: none, as an empty object
            self._out.append(CallDelta(call.index, arguments="{}"))
        self._state = self._after_item
        self.complete = self.single_object

    def _after_item(self, char: str) -> None:
        if char == ",":
            self._state = self._item_start
        elif char == "]":
            self.complete = True
        elif char not in _WHITESPACE:
            self.failed = True

    def _arguments(self, text: str) -> None:
        call = self._call
        if call.index < 0:
            call.pending += text
        else:
            self._out.append(CallDelta(call.index, arguments=text))


def _decoded(text: str):
    """A JSON string's value (None if it is not one, which the grammar does not let through)."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def _merged(deltas: list[CallDelta]) -> list[CallDelta]:
    """One delta per call, in order: a name and the argument text after it in the same feed go
    together."""
    merged: list[CallDelta] = []
    for delta in deltas:
        if merged and merged[-1].index == delta.index and delta.name is None:
            merged[-1].arguments += delta.arguments
        else:
            merged.append(delta)
    return merged


def parse_calls(parser: NamedCallParser | CallListParser, text: str) -> list[dict]:
    """A whole output's calls, [{"name", "arguments"}], exactly as its deltas accumulate."""
    calls: list[dict] = []
    for delta in parser.feed(text):
        if delta.name is not None:
            calls.append({"name": delta.name, "arguments": ""})
        calls[-1]["arguments"] += delta.arguments
    return calls
