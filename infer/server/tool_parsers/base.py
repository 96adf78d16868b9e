"""What every parser of a model's own tool calls shares: the text split into content and call sections,
one character at a time, so that the same text gives the same pieces however it is split into deltas.

    Let me check.<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>
    └── content ─┘└ marker ─┘└───────────── section (a scanner) ─┘└ between ┘

Content is sent as it comes, but for a tail that may begin a marker (`<tool_` is held until the next
character tells). A section's text is held until its scanner announces a call; a section that ends or
fails before that was no call, and its text is content again (before any call) or dropped (after one:
vLLM keeps only the text before the first call). Once a call is announced the stream cannot take it back:
if its text then fails or stops short, the parser is `broken`, and a response that is not streamed
returns the whole text as content (vLLM's: a call that does not parse is text).
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field

from infer.server.tool_call_parser import CallDelta

Piece = str | CallDelta  # a content text, or what a delta adds to one call


class Scanner:
    """One call section's scanner: fed one character at a time, it returns what it adds to the calls
    (indices from 0 within the section). `complete`: the section ended well; `failed`: it is no call
    text (anything fed after either is ignored)."""

    complete: bool = False
    failed: bool = False
    num_calls: int = 0

    def feed(self, char: str) -> list[CallDelta]:
        raise NotImplementedError


class ToolParser:
    """Splits a model's output into content and tool calls, fed as it is generated (`feed`), then told
    it ended (`finish`). Subclasses name their `markers` and build a section's scanner."""

    name: str = ""
    markers: tuple[str, ...] = ()
    # vLLM turns skip_special_tokens off for these parsers: their markers may be special tokens
    keeps_special_tokens: bool = True

    def __init__(self):
        self.num_calls = 0  # calls announced, over every section
        self.broken = False
        self._mode = "content"  # content | section | between | dropped
        self._held = ""  # text that may begin a marker
        self._raw = ""  # the current section's text, from its marker on
        self._scanner: Scanner | None = None
        self._section_calls = 0  # calls the current scanner announced
        self._out: list[Piece] = []

    # the subclass's part

    def new_scanner(self, marker: str) -> tuple[Scanner, str]:
        """A scanner for the section that `marker` opens, and the part of the marker to feed it."""
        raise NotImplementedError

    def call_id(self) -> str:
        return f"call_{secrets.token_hex(16)}"

    # the shared part

    def feed(self, text: str) -> list[Piece]:
        for char in text:
            self._char(char)
        return self._take()

    def finish(self) -> list[Piece]:
        """The output ended: held text is content; a section still open was cut short."""
        if self._mode == "section":
            self._end_section(complete=False)
        if self._mode == "content":
            self._content(self._held)
        self._held = ""
        return self._take()

    def _take(self) -> list[Piece]:
        """What was found since the last call, merged: one content text, one delta per call."""
        out, self._out = self._out, []
        merged: list[Piece] = []
        for piece in out:
            last = merged[-1] if merged else None
            if isinstance(piece, str) and isinstance(last, str):
                merged[-1] = last + piece
            elif isinstance(piece, CallDelta) and piece.name is None and _same_call(last, piece):
                last.arguments += piece.arguments
            elif piece:
                merged.append(piece)
        return merged

    def _content(self, text: str) -> None:
        if self.num_calls == 0:
            self._out.append(text)

    def _char(self, char: str) -> None:
        if self._mode == "section":
            self._raw += char
            self._section_char(char)
        elif self._mode in ("content", "between"):
            self._watch(char)

    def _watch(self, char: str) -> None:
        """Content (or, between calls, dropped text) up to a marker; a tail that may begin one is held."""
        held = self._held + char
        for marker in self.markers:
            if held.endswith(marker):
                self._held = ""
                self._content(held[: -len(marker)])
                self._open_section(marker)
                return
        keep = max((_overlap(held, marker) for marker in self.markers), default=0)
        self._content(held[: len(held) - keep])
        self._held = held[len(held) - keep :]

    def _open_section(self, marker: str) -> None:
        self._scanner, fed = self.new_scanner(marker)
        self._mode, self._raw, self._section_calls = "section", marker, 0
        for char in fed:
            self._section_char(char)

    def _section_char(self, char: str) -> None:
        scanner = self._scanner
        for delta in scanner.feed(char):
            self._out.append(CallDelta(self.num_calls + delta.index, delta.name, delta.arguments))
        self._section_calls = scanner.num_calls
        if scanner.complete or scanner.failed:
            self._end_section(complete=scanner.complete)

    def _end_section(self, complete: bool) -> None:
        announced = self._section_calls
        if announced:
            self.num_calls += announced
            self.broken = self.broken or not complete
            self._mode = "between" if complete else "dropped"
            return
        self._mode = "content" if self.num_calls == 0 else "between"
        self._content(self._raw)  # no call after all: its text was content


def _same_call(last: Piece | None, delta: CallDelta) -> bool:
    return isinstance(last, CallDelta) and last.index == delta.index


def _overlap(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (shorter than the marker)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


@dataclass
class Extracted:
    """A whole output read by a parser: the content (None when empty) and the calls
    [{"id", "type", "function": {"name", "arguments"}}]."""

    content: str | None
    calls: list[dict] = field(default_factory=list)


def extract(parser: ToolParser, text: str) -> Extracted:
    """A finished output's content and calls: what its deltas accumulate to, but for a call that does
    not parse or was cut short, when the whole text is content (vLLM's)."""
    content, calls = "", []
    for piece in [*parser.feed(text), *parser.finish()]:
        if isinstance(piece, str):
            content += piece
        elif piece.name is not None:
            function = {"name": piece.name, "arguments": piece.arguments}
            calls.append({"id": parser.call_id(), "type": "function", "function": function})
        else:
            calls[-1]["function"]["arguments"] += piece.arguments
    if parser.broken or not calls or not all(_is_json(c["function"]["arguments"]) for c in calls):
        return Extracted(text or None)
    return Extracted(content if content.strip() else None, calls)


def short_id() -> str:
    """Mistral's tool call ids: 9 letters and digits (its chat templates refuse any other)."""
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(9))


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
