"""A request's constraint on its output, as pure data: vLLM's `structured_outputs` (StructuredOutputsParams).

No torch and nothing compiled here: a SamplingParams carries it (requests cross to tensor-parallel ranks
pickled), and infer.structured_outputs.compiler compiles it.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from functools import cached_property

# A grammar's text at most (a JSON schema serialized, a regex, a grammar, the choices together): the
# compiler's time and memory grow with it, and it runs beside other requests' steps.
MAX_GRAMMAR_CHARS = 1 << 20
MAX_CHOICES = 1024  # llguidance's parser fails at 2,000 alternatives of one rule (max_items_in_row)
# A choice at most: the mask of each step costs time linear in the longest one, for every step of the
# batch it runs in (docs/structured-outputs.md, "What a grammar costs before its first token").
MAX_CHOICE_CHARS = 1024

STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on the generated text, vLLM's `structured_outputs` (its StructuredOutputsParams):
    exactly one of

    json: a JSON schema (a dict, or its JSON text): the output is a JSON value that matches it.
    json_object: True: the output is any JSON object (OpenAI's response_format {"type": "json_object"}).
    regex: the output matches this regular expression (Rust regex syntax, anchored at both ends).
    choice: the output is one of these strings.
    grammar: the output is a sentence of this context-free grammar, in Lark or GBNF (llama.cpp's) syntax.

    disable_any_whitespace: JSON without whitespace between its tokens (default: any JSON whitespace).
    disable_additional_properties: a JSON schema's objects get no properties beyond those it lists
        (JSON Schema allows them unless `additionalProperties` says otherwise).

    Pure data (requests cross to tensor-parallel ranks pickled); infer.structured_outputs.compiler
    compiles it."""

    json: str | dict | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        if self.choice is not None:
            if not isinstance(self.choice, list | tuple):
                raise ValueError(
                    f"structured_outputs choice must be a list of strings, got {self.choice!r:.80}"
                )
            if len(self.choice) > MAX_CHOICES:
                raise ValueError(f"structured_outputs choice must hold at most {MAX_CHOICES} strings")
            if any(isinstance(c, str) and len(c) > MAX_CHOICE_CHARS for c in self.choice):
                raise ValueError(f"structured_outputs choice: at most {MAX_CHOICE_CHARS} characters a string")
            object.__setattr__(self, "choice", tuple(self.choice))
        kinds = [k for k in STRUCTURED_KINDS if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise ValueError(
                "structured_outputs takes exactly one of json, json_object, regex, choice and grammar; "
                f"got {kinds or 'none'}"
            )
        kind = kinds[0]
        value = getattr(self, kind)
        if kind == "json" and not isinstance(value, str | dict):
            raise ValueError(
                f"structured_outputs json must be a JSON schema (an object or its text), got {value!r}"
            )
        if kind == "json_object" and value is not True:
            raise ValueError("structured_outputs json_object must be true (leave it out otherwise)")
        if kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
            raise ValueError(f"structured_outputs {kind} must be a non-empty string")
        if kind == "choice" and (not value or not all(isinstance(c, str) and c for c in value)):
            raise ValueError("structured_outputs choice must be a list of non-empty strings")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs {name} must be a bool, got {getattr(self, name)!r}")
        try:
            text = self.text
        except (RecursionError, ValueError):  # json.dumps of a cyclic or too deeply nested schema
            raise ValueError("structured_outputs json is nested too deeply, or is not JSON") from None
        if len(text) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"structured_outputs {kind} must be at most {MAX_GRAMMAR_CHARS} characters")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) is not None)

    @cached_property
    def text(self) -> str:
        """The constraint as one string (a compiled grammar's cache key, with the options): serialized once,
        as a schema of 128 tools takes milliseconds. A schema's keys stay in the order given: its
        properties' order is the order of the output's keys."""
        value = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, dict) or self.kind == "choice":
            return _json.dumps(list(value) if self.kind == "choice" else value)
        return str(value)
