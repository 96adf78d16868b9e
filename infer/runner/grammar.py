"""Structured outputs: each step, a request's grammar bans the tokens that would break it.

The grammars are llguidance's (guidance-ai; one of vLLM's structured-output backends, `guidance`): a
JSON schema, a regex, a list of choices or a Lark / GBNF grammar compiles to a matcher that, given the
tokens generated so far, computes the set of tokens that may come next as a bitmask over the vocabulary,
lazily and in Rust (~0.2 ms a step for a JSON schema over a 32,000-token vocabulary; llguidance's parser
limits bound a step). Once the grammar is complete, the mask holds only EOS, so a request ends where its
grammar does (or at max_tokens, cut short; under ignore_eos it goes on unconstrained after that EOS, as
in vLLM). A matcher that fails (a parser limit met) fails its request alone, with the reason.

    compiler = GrammarCompiler(tokenizer.to_json(), vocab_size, eos_token_ids)
    compiler.check(spec)              # ValueError for a grammar that does not compile (the engine's 400)
    grammar = Grammar(compiler.matcher(spec))
    grammar.advance(output_token_ids)   # each step: the tokens sampled since the last
    bans = banned([grammar, ...], compiler.vocab_size, num_logits)   # bool [rows, num_logits]

Compiled matchers are cached by their grammar's text (a server sees the same schema in many requests),
LRU within a bound in bytes, and compiled a few at a time on threads of their own with a bound on those
waiting and on the time each takes (infer.runner.compile_pool). Each request gets a copy, made before it
reaches the engine thread (AsyncEngine.add; `reserve` at add_request, `take` at its first sampled step),
so the engine's step never compiles; the server awaits the compilation without holding a thread
(`compiled`, a future), and a flood of distinct grammars gets CompileQueueFull (429).
"""

from __future__ import annotations

import concurrent.futures
import copy
import threading
from collections.abc import Callable

import numpy as np
import torch

from infer.runner.compile_pool import CompilePool
from infer.runner.forced_text import lark_forced_chars, regex_forced_chars
from infer.sampling_params import MAX_CHOICE_CHARS, StructuredOutputs

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
# The text a grammar forces costs every step a walk over it (infer.runner.forced_text): a regex, a schema's
# pattern, a Lark rule or terminal with a part whose shortest match passes this many characters is refused.
# At the bound a step's mask takes ~5 ms (a{16384}, (a{128}){128}); a{300000}, ((a{100}){100}){100} or
# "a"~32000 fail mid-output. A grammar within the length bounds above passes unless it repeats with counts.
MAX_FORCED_CHARS = 16384
# What a compiled grammar holds, for the cache's bound in bytes. llguidance reports no size: RSS growth per
# compiled grammar, measured over 20-100 distinct grammars of each kind (embedded model, 8,192 tokens),
# is ~50-140 KB plus per character of llguidance's grammar text ~95-120 B for a JSON schema, ~110 for
# strings (choices, Lark literals), ~25 for regexes and Lark terminals. The estimate takes the larger
# figures: never below what was measured, up to 4x above it for regex-heavy grammars.
GRAMMAR_BASE_BYTES = 128 << 10
GRAMMAR_BYTES_PER_CHAR = 128


def grammar_bytes(grammar: str) -> int:
    """The estimated memory of a compiled grammar, from llguidance's text of it."""
    return GRAMMAR_BASE_BYTES + GRAMMAR_BYTES_PER_CHAR * len(grammar)


class GrammarCompiler:
    """Compiles StructuredOutputs into matchers for one tokenizer. Thread-safe: compilations run on the
    pool's threads while the server and the engine read the cache."""

    @classmethod
    def for_tokenizer(cls, tokenizer, model_vocab_size: int, **bounds) -> GrammarCompiler:
        """For an infer Tokenizer and a model whose logits may be wider than its vocabulary (padded)."""
        vocab_size = max(model_vocab_size, tokenizer.vocab_size)
        # its JSON written at the first grammar, not at every model load (~0.1 s for 32,000 tokens)
        return cls(tokenizer.to_json, vocab_size, tokenizer.eos_token_ids, **bounds)

    def __init__(
        self,
        tokenizer_json: str | Callable[[], str],
        vocab_size: int,
        eos_token_ids,
        cache_mb: int = 64,
        max_compiling: int = 1,
        max_queued: int = 16,
        timeout_s: float = 10.0,
    ):
        """`tokenizer_json`: tokenizer.json's text, or what returns it (called once, at the first grammar).
        cache_mb, max_compiling, max_queued, timeout_s: the bounds of CompilePool (its docstring)."""
        self.tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size  # the model's or the tokenizer's, whichever is larger
        self.eos_token_ids = sorted(eos_token_ids)
        self._tokenizer = None  # llguidance's, built at the first grammar (~0.1 s for 32,000 tokens)
        self._building = threading.Lock()
        self._pool = CompilePool(
            self._compile,
            cache_mb << 20,
            self._prepare,
            max_compiling,
            max_queued,
            timeout_s,
            label="structured_outputs grammar",  # a message's first word names the field (the server's)
        )
        self._reserved: dict[str, object] = {}  # req_id -> its matcher, until its first sampled step
        # llguidance's ParserLimits at their defaults (its copies keep them: the compiling thread's first
        # mask and every step's are under the same ones)
        self.parser_limits = {"verbose_errors": False}

    @property
    def tokenizer(self):
        with self._building:  # built once, by the first compilation (~2 s)
            if self._tokenizer is None:
                import llguidance

                if callable(self.tokenizer_json):
                    self.tokenizer_json = self.tokenizer_json()
                # a padded embedding's ids past the tokenizer's stay banned
                tokenizer = llguidance.LLTokenizer(
                    self.tokenizer_json, n_vocab=self.vocab_size, eos_token=self.eos_token_ids
                )
                # The first mask over a tokenizer builds its tables (~1.7 s for 8,192 tokens): here, on
                # a compiling thread, not in an engine step.
                matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_regex("[a-z]+"))
                banned([Grammar(matcher)], self.vocab_size, self.vocab_size)
                self._tokenizer = tokenizer
            return self._tokenizer

    def compiled(self, spec: StructuredOutputs) -> concurrent.futures.Future:
        """The spec's compiled matcher, done (cached) or to come; ValueError (a grammar that does not
        compile) from the future. CompileQueueFull at once when too many are compiling. Cheap."""
        if not self.eos_token_ids:  # llguidance would take token 0 for it, and generate past the grammar
            raise ValueError(
                "structured_outputs need an EOS token to end the output where the grammar ends; this "
                "model's tokenizer names none (eos_token in tokenizer_config.json)"
            )
        key = (spec.kind, spec.text, spec.disable_any_whitespace, spec.disable_additional_properties)
        return self._pool.future(key, spec)

    def check(self, spec: StructuredOutputs) -> None:
        """ValueError, naming what is wrong, unless the grammar compiles (it is then cached). Blocks."""
        self.compiled(spec).result()

    def matcher(self, spec: StructuredOutputs):
        """A fresh matcher for one request (a copy of the compiled one). Blocks while it compiles."""
        return self.compiled(spec).result().deep_copy()

    def reserve(self, req_id: str, spec: StructuredOutputs, matcher=None) -> None:
        """Keep a request's matcher (made by AsyncEngine.add off the engine thread, or copied here), so
        that its first sampled step never compiles, whatever the cache evicted since."""
        self._reserved[req_id] = matcher if matcher is not None else self.matcher(spec)

    def take(self, req_id: str, spec: StructuredOutputs):
        """The request's reserved matcher (or a fresh one, for a request added another way)."""
        matcher = self._reserved.pop(req_id, None)
        return matcher if matcher is not None else self.matcher(spec)

    def release(self, req_id: str) -> None:
        self._reserved.pop(req_id, None)  # a request that ended before its first sampled step

    def _prepare(self, spec: StructuredOutputs) -> tuple[StructuredOutputs, str]:
        """llguidance's grammar text, within the bounds (refused from the text alone), and the tokenizer
        built: what a compilation needs before the part that is timed."""
        grammar = _grammar(spec)
        self.tokenizer  # noqa: B018 (built once)
        return spec, grammar

    def _compile(self, prepared: tuple[StructuredOutputs, str]) -> tuple[object, int]:
        """(the compiled matcher, its estimated bytes): on a CompilePool thread."""
        import llguidance

        spec, grammar = prepared
        tokenizer = self.tokenizer
        # compiles without the GIL; errors without the grammar's text (a grammar can be 1 MiB)
        limits = llguidance.LLParserLimits(**self.parser_limits)
        template = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
        if not template.is_error():
            # The first mask builds what the lexer left for later (a schema's patterns): here, once, off
            # the engine thread; the copies share it.
            banned([Grammar(template)], self.vocab_size, self.vocab_size)
        if template.is_error():
            reason = template.get_error().split("<backtrace>")[0].strip()  # a Rust panic's trace: internals
            raise ValueError(f"structured_outputs {spec.kind} does not compile: {reason}")
        return template, grammar_bytes(grammar)


def _grammar(spec: StructuredOutputs) -> str:
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


class Grammar:
    """One request's matcher and how many of its output tokens it consumed. Kept by the sampler from the
    request's first sampled step to its end, so preemption (recomputing the same tokens) changes nothing."""

    def __init__(self, matcher, ignore_eos: bool = False):
        self.matcher = matcher
        self.ignore_eos = ignore_eos
        self.num_consumed = 0
        self.terminated = False  # EOS came after the grammar completed, and did not stop the request

    def advance(self, output_token_ids: list[int]) -> None:
        """Feed the tokens sampled since the last call. Under ignore_eos, the EOS after the grammar
        completed ends the constraint: the output goes on free, as in vLLM. Otherwise only EOS follows
        (min_tokens may make several), and is not fed."""
        for token_id in output_token_ids[self.num_consumed :]:
            if self.matcher.is_stopped():
                self.terminated = self.ignore_eos
                break
            self.matcher.consume_token(token_id)  # an error shows in `error` (the mask allows EOS alone)
        self.num_consumed = len(output_token_ids)

    @property
    def error(self) -> str | None:
        """Why the matcher failed (a parser limit met at this output: a grammar too wide for llguidance's
        limits, say), or None. Its mask then holds EOS alone, which would end the output as if complete."""
        return self.matcher.get_error() if self.matcher.is_error() else None


def banned(grammars: list[Grammar], vocab_size: int, num_logits: int, executor=None) -> torch.Tensor:
    """bool [len(grammars), num_logits]: True where a grammar bans the token next (vocab_size: the
    compiler's, >= num_logits; a terminated grammar bans nothing). With an llguidance LLExecutor, the
    rows' masks are computed on its threads, the GIL released."""
    import llguidance.torch as llg_torch

    width = -(-vocab_size // 32)
    bitmask = torch.full((len(grammars), width), -1, dtype=torch.int32)
    live = [(g.matcher, i) for i, g in enumerate(grammars) if not g.terminated]
    if executor is not None and len(live) > 1:
        llg_torch.fill_next_token_bitmask_par(executor, live, bitmask)
    else:
        for matcher, i in live:
            llg_torch.fill_next_token_bitmask(matcher, bitmask, i)
    # a set bit allows its token: the complement's bits are the bans, one pass over the words
    bits = np.unpackbits((~bitmask).numpy().view(np.uint8), axis=1, bitorder="little")[:, :num_logits]
    return torch.from_numpy(bits).view(torch.bool)
