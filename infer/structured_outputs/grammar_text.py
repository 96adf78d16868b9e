"""llguidance's grammar text for a constraint, within the bounds that keep its compilation and every step
of its matcher cheap: what a grammar would cost is refused from its text, before it compiles.

    grammar_text(spec)   a JSON schema, a regex, a choice, a Lark or GBNF grammar as llguidance's grammar,
                         or ValueError naming the field and what passed which bound
"""

from __future__ import annotations

import copy

from infer.structured_outputs.constraint import MAX_CHOICE_CHARS, StructuredOutputs
from infer.structured_outputs.forced_text import lark_forced_chars, regex_forced_chars

# llguidance converts GBNF to Lark in Python, holding the GIL, in time quadratic in the rules: 8 KiB
# (~300 rules) take ~0.1 s, 16 KiB ~0.3 s, 1 MiB would take hours. Lark grammars compile in Rust.
MAX_GBNF_CHARS = 8192
# llguidance builds a regular expression in time and memory quadratic in its length ("a?" * 8,000: 1 s and
# +250 MB; * 40,000: 37-47 s and 6.6 GB), eagerly for a regex and Lark's terminals, lazily at the first
# mask for a JSON schema's patterns (also Lark's %json), which _compile then computes. Bounds: a regex and
# a schema's patterns together 8 KiB (~0.5 s at worst), a Lark grammar 16 KiB (~2 s at worst, off the
# engine thread; docs/structured-outputs.md).
MAX_REGEX_CHARS = 8192
MAX_LARK_CHARS = 16384
# The text a grammar forces costs every step a walk over it (infer.structured_outputs.forced_text): a regex,
# a schema's pattern, a Lark rule or terminal with a part whose shortest match passes this many characters
# is refused.
# At the bound a step's mask takes ~5 ms (a{16384}, (a{128}){128}); a{300000}, ((a{100}){100}){100} or
# "a"~32000 fail mid-output. A grammar within the length bounds above passes unless it repeats with counts.
MAX_FORCED_CHARS = 16384
# What a compiled grammar holds, for the cache's bound in bytes. llguidance reports no size: RSS growth per


def grammar_text(spec: StructuredOutputs) -> str:
    """llguidance's grammar text for a spec, as vLLM's guidance backend builds it (ValueError if the
    constraint cannot even be read: a schema that is not JSON, a grammar that is neither Lark nor GBNF)."""
    import llguidance

    options = {"whitespace_flexible": not spec.disable_any_whitespace}
    if spec.kind in ("json", "json_object"):
        schema = {"type": "object"} if spec.kind == "json_object" else spec.json
        # text is parsed once; a dict is copied only to be closed
        schema = _closed(schema) if spec.disable_additional_properties else _loaded(schema)
        _check_schema("structured_outputs json", schema)
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"structured_outputs json is not a JSON schema: {exc}") from None
    if spec.kind == "regex":
        if len(spec.regex) > MAX_REGEX_CHARS:
            raise ValueError(
                f"structured_outputs regex must be at most {MAX_REGEX_CHARS} characters (got "
                f"{len(spec.regex)}): llguidance's time and memory grow with its square"
            )
        _check_forced("structured_outputs regex", "the regex", regex_forced_chars(spec.regex))
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.kind == "choice":
        return llguidance.grammar_from("choice", list(spec.choice))
    from llguidance.gbnf_to_lark import gbnf_to_lark, is_lark_syntax

    if is_lark_syntax(spec.grammar):
        if len(spec.grammar) > MAX_LARK_CHARS:
            raise ValueError(
                f"structured_outputs grammar: a Lark grammar must be at most {MAX_LARK_CHARS} characters "
                f"(got {len(spec.grammar)}): llguidance's time and memory grow with the square of its "
                "regular expressions"
            )
        _check_lark(spec.grammar)
        return llguidance.LLMatcher.grammar_from_lark(spec.grammar)
    if len(spec.grammar) > MAX_GBNF_CHARS:  # converted in Python, in time quadratic in its rules
        raise ValueError(
            f"structured_outputs grammar: a GBNF grammar must be at most {MAX_GBNF_CHARS} characters "
            f"(got {len(spec.grammar)}); write a longer one in Lark syntax"
        )
    try:
        lark = gbnf_to_lark(spec.grammar)
    except Exception as exc:  # the converter raises what its parser meets
        raise ValueError(f"structured_outputs grammar is neither Lark nor GBNF: {exc}") from None
    _check_lark(lark)
    return llguidance.LLMatcher.grammar_from_lark(lark)


def _check_forced(field: str, what: str, length: int) -> None:
    if length > MAX_FORCED_CHARS:
        raise ValueError(
            f"{field}: {what} has a part that matches no text shorter than {length} characters; at most "
            f"{MAX_FORCED_CHARS}, as llguidance's lexer walks text a grammar forces at every token: repeat "
            "with smaller counts"
        )


def _check_schema(field: str, schema) -> None:
    """ValueError unless a schema's patterns and literals are within the bounds."""
    size, longest, forced = _schema_sizes(schema)
    if size > MAX_REGEX_CHARS:
        raise ValueError(
            f"{field}: the schema's patterns hold {size} characters together; at most "
            f"{MAX_REGEX_CHARS} (llguidance's time and memory grow with their square)"
        )
    if longest > MAX_CHOICE_CHARS:  # a literal, as a choice: each step's mask costs time linear in it
        raise ValueError(
            f"{field}: a const or enum string holds {longest} characters; at most "
            f"{MAX_CHOICE_CHARS}, as a choice (each step's mask costs time linear in the longest)"
        )
    _check_forced(field, "a pattern", forced)


def _check_lark(lark: str) -> None:
    """ValueError unless each rule and terminal of a Lark grammar, and each schema it inlines (%json), is
    within the bounds."""
    field = "structured_outputs grammar"
    forced, schemas = lark_forced_chars(lark)
    for name, length in forced.items():
        _check_forced(field, f"{name!r}", length)
    for schema in schemas:
        _check_schema(field, schema)


# where a JSON schema holds subschemas (the rest of its values are data: const, enum, default, examples)
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_KEYWORDS = (
    "additionalProperties", "unevaluatedProperties", "propertyNames", "contains", "additionalItems",
    "unevaluatedItems", "not", "if", "then", "else", "items", "prefixItems", "allOf", "anyOf", "oneOf",
)  # fmt: skip


def _loaded(schema: str | dict) -> dict:
    """A schema sent as JSON text, parsed (ValueError, naming the field, if it is not JSON)."""
    import json

    if not isinstance(schema, str):
        return schema
    try:
        return json.loads(schema)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"structured_outputs json is not JSON, or nested too deeply: {exc}") from None


def _schema_sizes(schema: dict) -> tuple[int, int, int]:
    """The characters of a schema's regular expressions (every `pattern` and `patternProperties` key),
    of its longest literal string (a `const` or an `enum` item) and of the longest shortest match of its
    regular expressions, at any depth (a walk of all of it, data included, which only counts high)."""
    size, longest, forced, pending = 0, 0, 0, [schema]
    while pending:
        node = pending.pop()
        if isinstance(node, list):
            pending += node
        elif isinstance(node, dict):
            patterns = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
            if isinstance(node.get("patternProperties"), dict):
                patterns += node["patternProperties"]
            size += sum(len(p) for p in patterns)
            forced = max([forced, *(regex_forced_chars(p) for p in patterns)])
            literals = node.get("enum") if isinstance(node.get("enum"), list) else []
            for literal in [node.get("const"), *literals]:
                if isinstance(literal, str):
                    longest = max(longest, len(literal))
            pending += node.values()
    return size, longest, forced


def _closed(schema: str | dict) -> dict:
    """The schema with `additionalProperties: false` on every object schema that lists properties and
    does not say (vLLM's disable_additional_properties), walking subschemas only, without recursion."""
    if isinstance(schema, str):
        schema = _loaded(schema)  # parsed afresh: nothing to copy
    else:
        try:
            schema = copy.deepcopy(schema)
        except RecursionError as exc:
            raise ValueError(f"structured_outputs json is not JSON, or nested too deeply: {exc}") from None
    pending = [schema]
    while pending:
        node = pending.pop()
        if isinstance(node, list):
            pending += node
            continue
        if not isinstance(node, dict):
            continue
        for key in SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                pending += node[key].values()
        pending += [node[key] for key in SCHEMA_KEYWORDS if isinstance(node.get(key), dict | list)]
        props = node.get("properties"), node.get("patternProperties")
        if any(isinstance(p, dict) for p in props) and "additionalProperties" not in node:
            node["additionalProperties"] = False
    return schema
