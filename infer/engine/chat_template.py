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


# transformers' marker of the end of the final message (continue_final_message), found in the rendering
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def tag_final_message(chat: list[dict[str, Any]], template: str) -> str:
    """continue_final_message before rendering, as transformers 5 (which vLLM 0.32 calls) does it:
    CONTINUE_TAG appended to the last message's content (its last text part, for a list of parts);
    `chat[-1]` is replaced, not mutated. Returns the content before the tag; ValueError with transformers'
    reason where there is nothing to continue."""
    final = chat[-1].get("content")
    if final is None:
        raise ValueError('continue_final_message is set but the final message has no "content" to continue!')
    if "content" not in template:
        raise ValueError(
            'continue_final_message is set to "content" but this is not an accepted field in the '
            "chat_template"
        )
    if isinstance(final, list | tuple):
        parts = list(final)
        texts = [i for i, p in enumerate(parts) if isinstance(p, dict) and isinstance(p.get("text"), str)]
        if not texts:
            raise ValueError(
                "continue_final_message is set but we could not find any text to continue in the final "
                "message!"
            )
        text = parts[texts[-1]]["text"]
        parts[texts[-1]] = {**parts[texts[-1]], "text": text + CONTINUE_TAG}
        chat[-1] = {**chat[-1], "content": parts}
        return text
    if not isinstance(final, str):
        raise ValueError("continue_final_message is set but the final message's content is not text")
    chat[-1] = {**chat[-1], "content": final + CONTINUE_TAG}
    return final


def continue_final(rendered: str, final: str) -> str:
    """The rendering cut where the tag ended the final message (transformers'), so that the prompt ends
    with that message's text, open: the template's end-of-turn and what follows are gone. A template that
    trimmed the message's trailing space has it trimmed here too."""
    if final.strip() not in rendered or CONTINUE_TAG.strip() not in rendered:
        raise ValueError(
            "continue_final_message is set but the final message does not appear in the chat after applying "
            "the chat template: the template deletes portions of the final message"
        )
    at = rendered.rindex(CONTINUE_TAG.strip())
    if rendered[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG:  # the template kept the spacing
        return rendered[:at]
    return rendered[:at].rstrip()


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
