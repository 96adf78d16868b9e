"""Per-request sampling parameters, validated once when they are built.

Pure Python (no torch): the scheduler reads `max_tokens`, `min_tokens`, `ignore_eos` and
`stop_token_ids`; the runner's sampler reads the rest. Stop *strings* are matched on detokenized text by
the engine, which then finishes the request through `Scheduler.finish_requests`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature: 0 = greedy (argmax); otherwise logits are divided by it before sampling.
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
        _check_number("temperature", self.temperature, "a float >= 0 (0 = greedy)", 0.0)
        _check_int("top_k", self.top_k, "an int >= 1, or 0 / -1 to disable it", -1)
        if not (isinstance(self.top_p, int | float) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1.0 disables it), got {self.top_p!r}")
        if not (isinstance(self.min_p, int | float) and 0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1] (0.0 disables it), got {self.min_p!r}")
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
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must be token ids (ints >= 0), got {self.stop_token_ids!r}")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, "None or an int >= 0 (number of top alternatives)", 0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check_int(name: str, value: object, expected: str, minimum: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def _check_number(name: str, value: object, expected: str, minimum: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= minimum:
        raise ValueError(f"{name} must be {expected}, got {value!r}")
