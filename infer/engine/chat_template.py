"""Chat templates rendered in the sandbox transformers uses (transformers.utils.chat_template_utils),
with its globals and filters, so a prompt is byte-identical to `apply_chat_template(..., tokenize=False)`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Older names of a message's reasoning text; templates read `reasoning_content` (gpt-oss reads `thinking`).
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def plain(value: Any) -> Any:
    """Rebuild template inputs from plain JSON types; anything else becomes an inert "<TypeName>"."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (bool, str, int, float):  # subclasses (enums...) carry methods the sandbox does not know
        if isinstance(value, base):
            return base(value)
    if isinstance(value, Mapping):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models
        return plain(value.model_dump())
    return f"<{type(value).__name__}>"


def with_reasoning_aliases(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[k] for k in _REASONING_KEYS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; renders the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _TemplateDict:
    """`dict(...)` in templates, without the class itself (no type hackery from a Hub template)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore attributes (no path to CPython internals)."""

    def __init__(*args: Any, **kwargs: Any):
        self, args = args[0], args[1:]
        for name in dict(*args, **kwargs):
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, *args, **kwargs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set attribute {name!r}")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters and non-ASCII; chat templates expect plain json.dumps.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# What one `*` or `**` in a template may build: a chat prompt needs nothing near it, and without a bound
# `{{ 'x' * 10**9 }}` or `{{ 10**10**8 }}` holds a CPU and gigabytes for as long as it takes.
MAX_TEMPLATE_VALUE_SIZE = 1 << 20


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox, with `*` (repetition) and `**` (power) refused beyond MAX_TEMPLATE_VALUE_SIZE."""

    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            sized = [len(x) for x in (left, right) if isinstance(x, str | list | tuple)]
            counts = [x for x in (left, right) if isinstance(x, int)]
            if sized and counts and sized[0] * max(counts[0], 0) > MAX_TEMPLATE_VALUE_SIZE:
                raise jinja2.exceptions.SecurityError("the template builds too large a value")
        elif operator == "**" and _power_bits(left, right) > 8 * MAX_TEMPLATE_VALUE_SIZE:
            raise jinja2.exceptions.SecurityError("the template builds too large a number")
        return super().call_binop(context, operator, left, right)


def _power_bits(base: Any, exponent: Any) -> int:
    """About the bits of base ** exponent for ints (0 for anything else)."""
    if not (isinstance(base, int) and isinstance(exponent, int)) or abs(base) < 2 or exponent < 0:
        return 0
    return exponent * abs(base).bit_length()


def render(template: jinja2.Template, max_chars: int, **variables: Any) -> str:
    """Render, giving up (ValueError) as soon as the output passes max_chars."""
    parts, size = [], 0
    for part in template.generate(**variables):
        size += len(part)
        if size > max_chars:
            raise ValueError(f"the chat template's output passed {max_chars} characters")
        parts.append(part)
    return "".join(parts)


@lru_cache(maxsize=32)
def compile_template(template: str) -> jinja2.Template:
    env = _BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template is not valid Jinja (line {e.lineno}): {e.message}") from e
