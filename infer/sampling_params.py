"""Per-request sampling parameters, validated once when they are built.

Pure Python (no torch): the scheduler reads `max_tokens`, `min_tokens`, `ignore_eos` and
`stop_token_ids`; the runner's sampler reads the rest. Stop *strings* are matched on detokenized text by
the engine, which then finishes the request through `Scheduler.finish_requests`.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

from infer.structured_outputs.constraint import StructuredOutputs

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Below this a temperature is greedy, as in vLLM: dividing logits by 1e-50 overflows to inf (NaN rows).
MIN_SAMPLING_TEMPERATURE = 1e-5
# Stop strings are matched by an automaton (infer.engine.stop_strings) whose cost per generated character
# does not depend on their number; these bounds cap its size (a node per character) and a request's memory.
MAX_STOP_STRINGS = 128
MAX_STOP_STRING_LEN = 512
MAX_STOP_TOKEN_IDS = 1024
MAX_BAD_WORDS = 128  # as vLLM's VLLM_MAX_NUM_BAD_WORDS (it counts their token sequences)


class Unsatisfiable(ValueError):
    """A request whose own parameters leave it nothing to sample, found while it generates (bans that
    empty a row; a grammar its parser cannot follow on): it ends that request alone, and a server answers
    it as the client's error (400), not its own."""


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature: 0 = greedy (argmax); otherwise logits are divided by it before sampling. Below
        MIN_SAMPLING_TEMPERATURE it is greedy too (set to 0 here).
    top_k: keep the k most likely tokens; 0 or -1 = off.
    top_p: nucleus sampling, keep the smallest set whose probability reaches top_p; 1.0 = off.
    min_p: drop tokens whose probability is below min_p * p(most likely token); 0.0 = off.
    seed: per-request seed, so the output does not depend on what else is in the batch; None = unseeded.
    max_tokens: generated tokens at most (finish reason "length").
    min_tokens: EOS and stop_token_ids are ignored until this many tokens were generated.
    ignore_eos: keep generating through the model's EOS token(s) (stop_token_ids still stop).
    stop: stop strings; the engine ends the request when one appears and strips it from the text.
    include_stop_str_in_output: keep the matched stop string, or the text of the stop token, at the end
        of the text (vLLM's).
    skip_special_tokens: leave special tokens (EOS, ...) out of the text (vLLM's; the token ids keep them).
    spaces_between_special_tokens: False: an added token that follows another added token is written as
        its own text, without what the tokenizer's decoder puts before it (a space, for decoders that
        join tokens with one); only with skip_special_tokens False (vLLM's, as its fast detokenizer).
    stop_token_ids: extra token ids that end the request (finish reason "stop"); the token is kept in
        the output ids, as EOS is, and left out of the text unless include_stop_str_in_output (as vLLM).
    logprobs: None = none; N >= 0 = log-probability of the sampled token plus the top-N alternatives.
        They are the model's own (before logit_bias, penalties and temperature), as vLLM reports them.
    prompt_logprobs: None = none; N >= 0 = each prompt token's log-probability given the tokens before
        it (None for the first), with its rank and the top-N alternatives (vLLM's). A request that asks
        for them computes its whole prompt (no prefix-cache hit), as in vLLM.
    allowed_token_ids: only these tokens can be sampled (vLLM's); None = every token.
    logit_bias: {token id: value in [-100, 100]} added to those tokens' logits before sampling (OpenAI's).
    presence_penalty: subtracted once from the logit of every token already generated (OpenAI's; in
        [-2, 2], 0 = off; negative values favour repeats).
    frequency_penalty: subtracted from a token's logit once per time it was generated (OpenAI's; in
        [-2, 2], 0 = off).
    repetition_penalty: every token of the prompt or the output has a positive logit divided by it and a
        negative one multiplied (CTRL's, as vLLM's and transformers'; > 0, 1.0 = off, > 1 discourages).
    bad_words: words the output must not contain (vLLM's): each word's last token is banned where the
        output ends with the tokens before it. Tokenized by the engine, as written and after a space
        (`bad_words_token_ids`, which it fills: leave that None).
    structured_outputs: a grammar the output must follow (JSON schema, regex, choice, ...): tokens that
        would break it are banned at each step; once it is complete only EOS is left. None = free text.
    grammar_after_ids: the grammar constrains only what follows the first appearance of these token ids
        in the output (the end of a model's thinking, `</think>`: vLLM's reasoning parsers start the
        grammar there); the output is free up to them. Empty: from the first token.
    Applied in that order (grammar, allowed ids, bad words, bias, then the penalties), as vLLM applies
    them; greedy requests take the argmax of the adjusted logits.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None
    bad_words: list[str] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] | None = None
    grammar_after_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # a single stop string is a common convenience
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        _check_number("temperature", self.temperature, "a finite float >= 0 (0 = greedy)", 0.0)
        if self.temperature < MIN_SAMPLING_TEMPERATURE:
            self.temperature = 0.0
        _check_int("top_k", self.top_k, "an int >= 1, or 0 / -1 to disable it", -1)
        _check_number("top_p", self.top_p, "in (0, 1] (1.0 disables it)", 0.0, 1.0)
        if self.top_p == 0.0:
            raise ValueError(f"top_p must be in (0, 1] (1.0 disables it), got {self.top_p!r}")
        _check_number("min_p", self.min_p, "in [0, 1] (0.0 disables it)", 0.0, 1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, "None or an int", None)
        _check_int("max_tokens", self.max_tokens, "an int >= 1", 1)
        _check_int("min_tokens", self.min_tokens, "an int >= 0", 0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) cannot exceed max_tokens ({self.max_tokens}); "
                "lower min_tokens or raise max_tokens"
            )
        for name in (
            "ignore_eos",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "spaces_between_special_tokens",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop must hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_LEN:
                raise ValueError(
                    f"stop must be a list of non-empty strings of at most {MAX_STOP_STRING_LEN} characters"
                )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids must hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}"
            )
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, "a list of token ids (ints >= 0)", 0)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, "None or an int >= 0 (number of top alternatives)", 0)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, "None or an int >= 0 (top alternatives)", 0)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (leave it out to allow every token)")
            for t in self.allowed_token_ids:
                _check_int("allowed_token_ids", t, "a list of token ids (ints >= 0)", 0)
        self.logit_bias = dict(self.logit_bias or {})
        for token_id, bias in self.logit_bias.items():  # the ranges are OpenAI's (and vLLM's)
            _check_int("logit_bias", token_id, "a map of token ids (ints >= 0) to values", 0)
            _check_number("logit_bias", bias, "a map of token ids to values in [-100, 100]", -100.0, 100.0)
        for name in ("presence_penalty", "frequency_penalty"):
            _check_number(name, getattr(self, name), "in [-2, 2] (0 = off)", -2.0, 2.0)
        _check_number(
            "repetition_penalty",
            self.repetition_penalty,
            "a finite float > 0 (1.0 = off)",
            0.0,
            sys.float_info.max,
        )
        if self.repetition_penalty == 0:
            raise ValueError("repetition_penalty must be a finite float > 0 (1.0 = off), got 0")
        self.bad_words = list(dict.fromkeys(self.bad_words or []))  # vLLM drops repeats too
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words must hold at most {MAX_BAD_WORDS} words, got {len(self.bad_words)}")
        for word in self.bad_words:
            if not isinstance(word, str) or not word.strip() or len(word) > MAX_STOP_STRING_LEN:
                raise ValueError(
                    f"bad_words must be a list of words (non-blank strings of at most {MAX_STOP_STRING_LEN} "
                    "characters)"
                )
        if self.bad_words_token_ids is not None and not self.bad_words:
            raise ValueError("bad_words_token_ids are the engine's, made from bad_words: set bad_words")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise ValueError(
                f"structured_outputs must be a StructuredOutputs, got {self.structured_outputs!r}"
            )
        self.grammar_after_ids = tuple(self.grammar_after_ids)
        for t in self.grammar_after_ids:
            _check_int("grammar_after_ids", t, "a list of token ids (ints >= 0)", 0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Needs the request's tokens so far (prompt and output) to sample."""
        return bool(self.presence_penalty or self.frequency_penalty) or self.repetition_penalty != 1.0

    @property
    def needs_history(self) -> bool:
        """Sampling reads the request's tokens so far: penalties count them, a grammar consumes them, bad
        words look at the last of them."""
        return self.penalized or self.structured_outputs is not None or bool(self.bad_words)

    @property
    def has_adjustment(self) -> bool:
        """Sampling keeps state for the request (the sampler's Adjustment): allowed ids, a bias, penalties
        or bad words."""
        return (
            self.penalized
            or bool(self.logit_bias)
            or self.allowed_token_ids is not None
            or bool(self.bad_words)
        )

    @property
    def adjusts_logits(self) -> bool:
        return self.has_adjustment or self.structured_outputs is not None


def _check_int(name: str, value: object, expected: str, minimum: int | None) -> None:
    """An int >= minimum that fits int64 (torch tensors and generators take no more)."""
    low = INT64_MIN if minimum is None else minimum
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= INT64_MAX:
        shown = value if not isinstance(value, int) or abs(value) < 10**30 else f"{str(value)[:12]}..."
        raise ValueError(f"{name} must be {expected} (at most {INT64_MAX}), got {shown!r}")


def _check_number(name: str, value: object, expected: str, minimum: float, maximum: float = math.inf) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or (isinstance(value, float) and not math.isfinite(value))
        or not minimum <= value <= maximum
    ):
        raise ValueError(f"{name} must be {expected}, got {value!r}")
