"""Structured outputs: each step, a request's grammar bans the tokens that would break it.

The grammars are llguidance's (guidance-ai; one of vLLM's structured-output backends, `guidance`): a
JSON schema, a regex, a list of choices or a Lark / GBNF grammar compiles to a matcher that, given the
tokens generated so far, computes the set of tokens that may come next as a bitmask over the vocabulary,
lazily and in Rust (~0.2 ms a step for a JSON schema over a 32,000-token vocabulary). Once the grammar is
complete, the mask holds only EOS, so a request ends where its grammar does (or at max_tokens, cut short,
as in vLLM).

    compiler = GrammarCompiler(tokenizer.to_json(), vocab_size, eos_token_ids)
    compiler.check(spec)              # ValueError for a grammar that does not compile (the engine's 400)
    grammar = Grammar(compiler.matcher(spec))
    grammar.advance(output_token_ids)   # each step: the tokens sampled since the last
    bans = banned([grammar, ...], compiler.vocab_size, num_logits)   # bool [rows, num_logits]

Compiled matchers are cached by their grammar's text (a server sees the same schema in many requests), and
each request gets a copy, so compiling happens once: in the server's worker thread when it checks a
request, not in the engine's step.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections import OrderedDict

import numpy as np
import torch

from infer.sampling_params import StructuredOutputs

logger = logging.getLogger("infer.engine")

CACHED_GRAMMARS = 256  # compiled matchers kept (LRU); a copy per request


class GrammarCompiler:
    """Compiles StructuredOutputs into matchers for one tokenizer. Thread-safe: the server compiles on its
    worker threads while the engine copies from the cache."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids):
        self.tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size  # the model's or the tokenizer's, whichever is larger
        self.eos_token_ids = sorted(eos_token_ids)
        self._tokenizer = None  # llguidance's, built at the first grammar (~0.1 s for 32,000 tokens)
        self._cache: OrderedDict[tuple, object] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance

                # a padded embedding's ids past the tokenizer's stay banned
                self._tokenizer = llguidance.LLTokenizer(
                    self.tokenizer_json, n_vocab=self.vocab_size, eos_token=self.eos_token_ids
                )
            return self._tokenizer

    def check(self, spec: StructuredOutputs) -> None:
        """ValueError, naming what is wrong, unless the grammar compiles (it is then cached)."""
        if not self.eos_token_ids:  # llguidance would take token 0 for it, and generate past the grammar
            raise ValueError(
                "structured_outputs need an EOS token to end the output where the grammar ends; this "
                "model's tokenizer names none (eos_token in tokenizer_config.json)"
            )
        self._template(spec)

    def matcher(self, spec: StructuredOutputs):
        """A fresh matcher for one request (a copy of the cached compiled one)."""
        return self._template(spec).deep_copy()

    def _template(self, spec: StructuredOutputs):
        key = (spec.kind, spec.text, spec.disable_any_whitespace, spec.disable_additional_properties)
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                return template
        import llguidance

        tokenizer = self.tokenizer
        template = llguidance.LLMatcher(tokenizer, _grammar(spec), log_level=0)  # compiles without the GIL
        if template.is_error():
            raise ValueError(f"structured_outputs {spec.kind} does not compile: {template.get_error()}")
        with self._lock:
            self._cache[key] = template
            while len(self._cache) > CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return template


def _grammar(spec: StructuredOutputs) -> str:
    """llguidance's grammar text for a spec, as vLLM's guidance backend builds it (ValueError if the
    constraint cannot even be read: a schema that is not JSON, a grammar that is neither Lark nor GBNF)."""
    import llguidance

    options = {"whitespace_flexible": not spec.disable_any_whitespace}
    if spec.kind in ("json", "json_object"):
        schema = {"type": "object"} if spec.kind == "json_object" else spec.json
        if spec.disable_additional_properties:
            schema = _closed(schema)
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"structured_outputs json is not a JSON schema: {exc}") from None
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.kind == "choice":
        return llguidance.grammar_from("choice", list(spec.choice))
    try:
        return llguidance.grammar_from("grammar", spec.grammar)  # Lark, or GBNF converted to it
    except ValueError as exc:
        raise ValueError(f"structured_outputs grammar: {exc}") from None


def _closed(schema: str | dict) -> dict:
    """The schema with `additionalProperties: false` on every object that lists its properties and does
    not say (vLLM's disable_additional_properties)."""
    import json

    try:
        schema = json.loads(schema) if isinstance(schema, str) else copy.deepcopy(schema)
    except json.JSONDecodeError as exc:
        raise ValueError(f"structured_outputs json is not JSON: {exc}") from None

    def walk(node) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item)
        elif isinstance(node, dict):
            for value in node.values():
                walk(value)
            if isinstance(node.get("properties"), dict) and "additionalProperties" not in node:
                node["additionalProperties"] = False

    walk(schema)
    return schema


class Grammar:
    """One request's matcher and how many of its output tokens it consumed. Kept by the sampler from the
    request's first sampled step to its end, so preemption (recomputing the same tokens) changes nothing."""

    def __init__(self, matcher):
        self.matcher = matcher
        self.num_consumed = 0

    def advance(self, output_token_ids: list[int]) -> None:
        """Feed the tokens sampled since the last call. After the grammar completes, tokens that follow
        (EOS under ignore_eos) are not fed: the mask then stays EOS alone, as in vLLM."""
        for token_id in output_token_ids[self.num_consumed :]:
            if self.matcher.is_stopped():
                break
            if not self.matcher.consume_token(token_id):
                # not expected (the sampler keeps to the grammar's tokens); the mask is EOS alone now
                logger.warning("a structured output left its grammar: %s", self.matcher.get_error())
        self.num_consumed = len(output_token_ids)


def banned(grammars: list[Grammar], vocab_size: int, num_logits: int, executor=None) -> torch.Tensor:
    """bool [len(grammars), num_logits]: True where a grammar bans the token next (vocab_size: the
    compiler's, >= num_logits). With an llguidance LLExecutor, the rows' masks are computed on its
    threads, the GIL released."""
    import llguidance.torch as llg_torch

    width = -(-vocab_size // 32)
    bitmask = torch.full((len(grammars), width), -1, dtype=torch.int32)
    if executor is not None and len(grammars) > 1:
        pairs = [(g.matcher, i) for i, g in enumerate(grammars)]
        llg_torch.fill_next_token_bitmask_par(executor, pairs, bitmask)
    else:
        for i, grammar in enumerate(grammars):
            llg_torch.fill_next_token_bitmask(grammar.matcher, bitmask, i)
    # a set bit allows its token: the complement's bits are the bans, one pass over the words
    bits = np.unpackbits((~bitmask).numpy().view(np.uint8), axis=1, bitorder="little")[:, :num_logits]
    return torch.from_numpy(bits).view(torch.bool)
