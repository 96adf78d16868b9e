"""Per-request sampling parameters, validated once when they are built.

Pure Python (no torch): the scheduler reads `max_tokens`, `min_tokens`, `ignore_eos` and
`stop_token_ids`; the runner's sampler reads the rest. Stop *strings* are matched on detokenized text by
the engine, which then finishes the request through `Scheduler.finish_requests`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Below this a temperature is greedy, as in vLLM: dividing logits by 1e-50 overflows to inf (NaN rows).
MIN_SAMPLING_TEMPERATURE = 1e-5
# Stop strings are matched by an automaton (infer.engine.stop_strings) whose cost per generated character
# does not depend on their number; these bounds cap its size (a node per character) and a request's memory.
MAX_STOP_STRINGS = 128
MAX_STOP_STRING_LEN = 512
MAX_STOP_TOKEN_IDS = 1024


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
    stop_token_ids: extra token ids that end the request (finish reason "stop"); the token is kept in
        the output ids, as EOS is, and the detokenizer decides whether to show it.
    logprobs: None = none; N >= 0 = log-probability of the sampled token plus the top-N alternatives.
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
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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
