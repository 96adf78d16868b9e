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
        while len(self.frames) > 1:
            self.close()
        self.alternative()
        return self.frames[0][0]


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
    r"^[ \t]*(?:[!?]?(_?[A-Za-z][\w\-]*)[^:\n]*?(?<!:):(?![:=])"
    r"|%(?:ignore|import|declare|override|llguidance)\b)",
    re.MULTILINE,
)


def lark_forced_chars(grammar: str) -> tuple[dict[str, int], list[object]]:
    """({rule or terminal: the most characters a part of it forces}, the JSON schemas inlined with %json).
    A name in a definition counts its own shortest match (0 while that is being counted: recursion)."""
    starts = list(_LARK_DEFINITION.finditer(grammar))
    ends = [m.start() for m in starts[1:]] + [len(grammar)]
    bodies = {
        m.group(1) or f"%{k}": grammar[m.end() : end]
        for k, (m, end) in enumerate(zip(starts, ends, strict=True))
    }
    found: dict[str, _Widths] = {}
    schemas: list[object] = []

    def shortest(name: str) -> int:
        if name not in bodies:
            return 0  # imported, or the compiler's to report
        if name not in found:
            found[name] = _Widths()  # its shortest is 0 until counted
            found[name] = _lark_widths(bodies[name], shortest, schemas)
        return found[name].frames[0][0] or 0

    for name in bodies:
        shortest(name)
    return {name: w.forced for name, w in found.items() if not name.startswith("%")}, schemas


def _lark_widths(body: str, shortest, schemas: list[object]) -> _Widths:
    """One definition's widths, counting the names in it by `shortest`."""
    widths, i = _Widths(), 0
    while i < len(body):
        m = _LARK_TOKEN.match(body, i)
        i = m.end()
        if m.group("string") is not None:
            text = m.group("string").removesuffix("i")[1:-1]
            widths.atom(len(text) - text.count("\\"))
        elif m.group("regex") is not None:
            regex = _regex_widths(m.group("regex").rstrip("imslux")[1:-1])
            widths.atom(regex.shortest())
            widths.forced = max(widths.forced, regex.forced)
        elif m.group("repeat") is not None:
            widths.repeat(int(m.group("times")))
        elif m.group("braces") is not None:
            widths.repeat(int(m.group("min") or 0))
        elif m.group("embedded") is not None:
            try:
                value, i = json.JSONDecoder().raw_decode(body, i)
            except json.JSONDecodeError:
                continue  # the compiler's to report
            if m.group("embedded").startswith("%json"):
                schemas.append(value)
            widths.atom(0)
        elif m.group("name") is not None:
            widths.atom(shortest(m.group("name").lstrip("!?")))
        elif m.group("op") in ("(", "["):
            widths.open()
        elif m.group("op") in (")", "]"):
            widths.close()
            if m.group("op") == "]":
                widths.repeat(0)
        elif m.group("op") == "|":
            widths.alternative()
        elif m.group("op") in ("*", "?"):
            widths.repeat(0)
    widths.shortest()
    return widths
