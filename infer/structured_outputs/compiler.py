"""GrammarCompiler: a constraint compiled, once per distinct grammar, into a matcher each request copies.

The grammars are llguidance's (guidance-ai; one of vLLM's structured-output backends, `guidance`): a
JSON schema, a regex, a list of choices or a Lark / GBNF grammar compiles to a matcher that, given the
tokens generated so far, computes the set of tokens that may come next as a bitmask over the vocabulary,
lazily and in Rust (~0.2 ms a step for a JSON schema over a 32,000-token vocabulary; llguidance's parser
limits bound a step; infer.structured_outputs.matcher).

    compiler = GrammarCompiler(tokenizer.to_json(), vocab_size, eos_token_ids)
    compiler.check(spec)              # ValueError for a grammar that does not compile (the engine's 400)
    matcher = compiler.matcher(spec)  # a request's own copy

Compiled matchers are cached by their grammar's text (a server sees the same schema in many requests),
LRU within a bound in bytes, and compiled a few at a time with a bound on those waiting and on the time
each takes (infer.structured_outputs.compile_pool). Each request gets a copy, made before it reaches the
engine thread (AsyncEngine.add; `reserve` at add_request, `take` at its first sampled step), so the
engine's step never compiles; the server awaits the compilation without holding a thread (`compiled`, a
future), and a flood of distinct grammars gets CompileQueueFull (429).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable

from infer.config import EngineConfig
from infer.structured_outputs.compile_pool import CompilePool
from infer.structured_outputs.constraint import StructuredOutputs
from infer.structured_outputs.matcher import Grammar, banned
from infer.structured_outputs.text_process import build_text

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
    def from_config(cls, config: EngineConfig, tokenizer, model_vocab_size: int) -> GrammarCompiler:
        """The compiler that the engine's flags configure (deploy's ingress builds one too: it checks a
        request's grammar before routing it)."""
        return cls.for_tokenizer(
            tokenizer,
            model_vocab_size,
            cache_mb=config.grammar_cache_mb,
            max_compiling=config.max_grammar_compilations,
            max_queued=config.max_queued_grammars,
            timeout_s=config.grammar_compile_timeout,
        )

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

    def warm_up(self) -> None:
        """Build llguidance's tokenizer now (a long-lived engine's warm-up), not at the first grammar:
        writing the tokenizer's JSON and building its tables hold the GIL for hundreds of ms at a time,
        which would stall every running stream's decode steps."""
        self.tokenizer  # noqa: B018 (built once)

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
        grammar = build_text(spec)  # in a worker process: Python that would hold the GIL
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
