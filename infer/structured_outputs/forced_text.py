"""How much text a grammar forces: the longest shortest match of any part of a regex or a Lark grammar.

llguidance's lexer walks the text a grammar forces (`a{300000}`, `((a{100}){100}){100}`, a string repeated
with `~`) a derivative at a time, at every step: such a grammar compiles, then fails mid-output once a
step's lexer fuel runs out ("too many expressions constructed"), after seconds and hundreds of MB. Open or
optional repetition is cheap (`a{0,1000000}`); what costs is a part that, once begun, must be finished:
its shortest match. So a grammar is refused up front when the longest such part passes a bound
(`b|a{300000}` and `(a{300000})?` too: the output may begin that part). A grammar without counted
repetition stays within its own length (each character a part forces is written in it).

The scanners read the syntax that matters and pass over the rest: Rust's regex syntax (llguidance's) or
Python's, and Lark with llguidance's extensions. An atom counts one character (a string its length), a
group the shortest of its alternatives, `{m,n}` and `~ m..n` m times, `*` and `?` none.
"""

from __future__ import annotations

import json
import re

_QUANTIFIER = re.compile(r"\{\s*(\d+)\s*(,\s*\d*\s*)?\}")
_ZERO_WIDTH_ESCAPES = set("bBAzZ<>")
_GROUP_PREFIX = re.compile(r"\?(?:P?<[^>]*>|[a-zA-Z\-]*:)")
_FLAGS = re.compile(r"\?[a-zA-Z\-]*\)")


class _Widths:
    """Fed a pattern atom by atom: the shortest width of nested groups of alternatives of sequences, and
    `forced`, the largest shortest width of any part (an atom, a repeated atom, an alternative)."""

    def __init__(self):
        self.frames = [[None, 0, 0]]  # per open group: shortest finished alternative, this one's, last atom
        self.forced = 0
        self.ended: int | None = None

    def atom(self, width: int) -> None:
        frame = self.frames[-1]
        frame[1] += width
        frame[2] = width
        self.forced = max(self.forced, width)

    def repeat(self, times: int) -> None:
        frame = self.frames[-1]
        frame[1] += frame[2] * (times - 1)
        frame[2] *= times
        self.forced = max(self.forced, frame[2])

    def alternative(self) -> None:
        frame = self.frames[-1]
        frame[0] = frame[1] if frame[0] is None else min(frame[0], frame[1])
        self.forced = max(self.forced, frame[1])
        frame[1] = frame[2] = 0

    def open(self) -> None:
        self.frames.append([None, 0, 0])

    def close(self) -> None:
        if len(self.frames) > 1:  # an unbalanced ")" is the compiler's to report
            self.alternative()
            self.atom(self.frames.pop()[0])

    def shortest(self) -> int:
        """Ends the pattern (closes what is open); then only returns the same."""
        if self.ended is None:
            while len(self.frames) > 1:
                self.close()
            self.alternative()
            self.ended = self.frames[0][0]
        return self.ended


def regex_forced_chars(regex: str) -> int:
    """The most characters a part of the regex forces once begun (its shortest match)."""
    widths = _regex_widths(regex)
    widths.shortest()
    return widths.forced


def _regex_widths(regex: str) -> _Widths:
    widths, i, n = _Widths(), 0, len(regex)
    while i < n:
        c = regex[i]
        i += 1
        if c == "\\" and i < n:
            e = regex[i]
            i += 1
            if e in "pPxu" and i < n and regex[i] == "{":  # \p{Greek}, \x{10FFFF}
                i = regex.find("}", i) + 1 or n
            elif e in "pP" and i < n:
                i += 1  # \pL
            widths.atom(0 if e in _ZERO_WIDTH_ESCAPES else 1)
        elif c == "[":
            i = _class_end(regex, i)
            widths.atom(1)
        elif c == "(":
            widths.open()
            if m := _GROUP_PREFIX.match(regex, i):  # (?:, (?i:, (?P<name>, (?<name>
                i = m.end()
            elif m := _FLAGS.match(regex, i):  # (?i): flags alone, a zero-width group
                i = m.end()
                widths.close()
        elif c == ")":
            widths.close()
        elif c == "|":
            widths.alternative()
        elif c in "*?":
            widths.repeat(0)
            i += regex.startswith("?", i)  # lazy
        elif c == "+":
            i += regex.startswith("?", i)
        elif c == "{" and (m := _QUANTIFIER.match(regex, i - 1)):
            widths.repeat(int(m.group(1)))
            i = m.end() + regex.startswith("?", m.end())
        elif c in "^$":
            widths.atom(0)
        else:
            widths.atom(1)
    return widths


def _class_end(regex: str, i: int) -> int:
    """The index past the `]` that closes a class opened before i (classes nest in Rust's syntax)."""
    depth, n = 1, len(regex)
    if regex.startswith("^", i):
        i += 1
    if regex.startswith("]", i):  # a leading "]" is a literal
        i += 1
    while i < n and depth:
        if regex[i] == "\\":
            i += 1
        elif regex[i] == "[" and not regex.startswith("[:", i):
            depth += 1
        elif regex[i] == "[":  # [:alpha:]
            i = regex.find(":]", i + 2) + 1 or n
        elif regex[i] == "]":
            depth -= 1
        i += 1
    return i


_LARK_TOKEN = re.compile(
    r"""(?P<comment>//[^\n]*)
    | (?P<string>"(?:\\.|[^"\\])*"i?)
    | (?P<regex>/(?:\\.|[^/\\\n])+/[imslux]*)
    | (?P<repeat>~\s*(?P<times>\d+)(?:\s*\.\.\s*\d+)?)
    | (?P<braces>\{\s*(?P<min>\d*)\s*(?:,\s*\d*\s*)?\})
    | (?P<embedded>%(?:json|regex|llguidance)\s*(?=\{))
    | (?P<name>[!?]?_?[A-Za-z][\w\-]*)
    | (?P<op>[()\[\]|+*?])
    | (?P<other>.)""",
    re.VERBOSE | re.DOTALL,
)
# where a definition ("name:", "NAME.2:", "name[stop=...]:", not GBNF's "::=") or a directive starts
_LARK_DEFINITION = re.compile(
    r"^[ \t]*(?:[!?]?(_?[A-Za-z][\w\-]*)(?:\.-?\d+)?[ \t]*(?:\[[^\]\n]*\])?[ \t]*:(?![:=])"
    r"|%(?:ignore|import|declare|override|llguidance)\b)",
    re.MULTILINE,
)


def lark_forced_chars(grammar: str) -> tuple[dict[str, int], list[object]]:
    """({rule or terminal: the most characters a part of it forces}, the JSON schemas inlined with %json).
    A name in a definition counts its own shortest match, counted first (a loop, not recursion: chains
    of thousands of rules); a name met again while being counted (recursion) counts 0."""
    starts = list(_LARK_DEFINITION.finditer(grammar))
    ends = [m.start() for m in starts[1:]] + [len(grammar)]
    schemas: list[object] = []
    tokens = {
        m.group(1) or f"%{k}": _lark_tokens(grammar[m.end() : end], schemas)
        for k, (m, end) in enumerate(zip(starts, ends, strict=True))
    }
    shortest: dict[str, int] = {}
    forced: dict[str, int] = {}
    for root in tokens:
        pending = [(root, False)]  # depth first; (name, its references counted)
        while pending:
            name, ready = pending.pop()
            if name in forced or name not in tokens:
                continue
            if ready:
                widths = _lark_widths(tokens[name], shortest)
                shortest[name], forced[name] = widths.shortest(), widths.forced
                continue
            shortest.setdefault(name, 0)  # while its references are counted
            pending.append((name, True))
            pending += [(ref, False) for kind, ref in tokens[name] if kind == "name" and ref not in shortest]
    return {name: n for name, n in forced.items() if not name.startswith("%")}, schemas


def _lark_tokens(body: str, schemas: list[object]) -> list[tuple[str, object]]:
    """One definition's tokens that count: ("atom", width), ("regex", (shortest, forced)), ("repeat", times),
    ("name", name), ("op", one of ( ) [ ] | * ?). A %json schema goes to `schemas`."""
    found, i = [], 0
    while i < len(body):
        m = _LARK_TOKEN.match(body, i)
        i = m.end()
        if m.group("string") is not None:
            text = m.group("string").removesuffix("i")[1:-1]
            found.append(("atom", len(text) - text.count("\\")))
        elif m.group("regex") is not None:
            regex = _regex_widths(m.group("regex").rstrip("imslux")[1:-1])
            found.append(("regex", (regex.shortest(), regex.forced)))
        elif m.group("repeat") is not None:
            found.append(("repeat", int(m.group("times"))))
        elif m.group("braces") is not None:
            found.append(("repeat", int(m.group("min") or 0)))
        elif m.group("embedded") is not None:
            try:
                value, i = json.JSONDecoder().raw_decode(body, i)
            except json.JSONDecodeError:
                continue  # the compiler's to report
            if m.group("embedded").startswith("%json"):
                schemas.append(value)
            found.append(("atom", 0))
        elif m.group("name") is not None:
            found.append(("name", m.group("name").lstrip("!?")))
        elif m.group("op") is not None:
            found.append(("op", m.group("op")))
    return found


def _lark_widths(tokens: list[tuple[str, object]], shortest: dict[str, int]) -> _Widths:
    """One definition's widths, a name counting its entry in `shortest` (0 if none: imported, say)."""
    widths = _Widths()
    for kind, value in tokens:
        if kind == "atom":
            widths.atom(value)
        elif kind == "regex":
            widths.atom(value[0])
            widths.forced = max(widths.forced, value[1])
        elif kind == "repeat":
            widths.repeat(value)
        elif kind == "name":
            widths.atom(shortest.get(value, 0))
        elif value in ("(", "["):
            widths.open()
        elif value in (")", "]"):
            widths.close()
            if value == "]":
                widths.repeat(0)
        elif value == "|":
            widths.alternative()
        elif value in ("*", "?"):
            widths.repeat(0)
    return widths
