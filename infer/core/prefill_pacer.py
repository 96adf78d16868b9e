"""How many prefill tokens a step may carry beside running decodes, so that a long prompt does not stall
everyone's stream.

A decode step on a CPU costs about one read of the weights; a step that also carries a 2048-token prefill
chunk costs many times that, and every running stream waits for it. A client sees each gap, not their
mean, so the pacer bounds every step that carries decodes to about `max_decode_slowdown` times what a
decode-only step of the same decodes costs:

  - a step's prefill is at most `allowed` tokens: what the time left beside the decodes holds at the
    median cost per prefill token of recent paced steps with chunks of about that size (below a CPU's
    compute-bound knee a token costs ~nothing: small chunks say nothing of larger ones), so that what a
    linear model misses (attention over a long context, prompt logprobs, an eager step beside a
    replayed decode graph) counts as the time it takes, and the median so that a stall of a busy
    machine does not shrink the chunks. On a CPU the decodes' weight read is shared with the chunk;
  - a chunk that costs more than the bound at that rate anyway (the smallest chunk, or one that the
    allowance has not caught up with) leaves a debt, its time over the bound (at most MAX_PAYBACK_STEPS
    decode-only steps' worth; a step's own time is not used: a stall of the machine is not the
    prefill's doing), which decode-only steps pay back (each earns its time times
    max_decode_slowdown - 1) once it reaches half of one, so that the streams' pace holds on average;
  - the decode cost is the median of recent decode-only steps with about as many decodes, one of which
    the pacer asks for every PROBE_EVERY paced steps (a stream that joined while a long prompt was
    prefilled has never been seen alone).

Steps without decodes are not paced: a prompt alone gets the whole budget. A bystander's gaps are then
at most about max_decode_slowdown times its gaps alone, and the long prompt's time to first token grows
by what the decodes beside it take of each step. docs/robustness.md, "Long prompts: the streams' gaps
against the prompt's first token", has the measured tradeoff.
"""

from __future__ import annotations

import statistics
from collections import deque

MIN_PREFILL_TOKENS = 8  # a paced chunk at least: smaller ones cost a step's overhead for little progress
INITIAL_PREFILL_TOKENS = 32  # learned up by doubling: a chunk too small costs less than one too big
MAX_CHANGE = 2.0  # the allowance moves at most this factor per step (damping one noisy step)
PROBE_EVERY = 32  # paced steps between decode-only steps that refresh the decode cost
DECODE_SAMPLES = 32  # recent decode-only steps kept
PREFILL_SAMPLES = 8  # recent paced steps whose cost per prefill token sets the allowance
MAX_PAYBACK_STEPS = 2  # decode-only steps one slow paced step may cost at most


class PrefillPacer:
    def __init__(self, max_decode_slowdown: float, max_tokens: int) -> None:
        self.slowdown = max_decode_slowdown
        self.max_tokens = max_tokens
        self.allowed = min(INITIAL_PREFILL_TOKENS, max_tokens)
        self.decode_steps: deque[tuple[int, float]] = deque(maxlen=DECODE_SAMPLES)  # (decodes, seconds)
        # (prefill tokens, seconds per prefill token) of recent paced steps
        self.prefill_costs: deque[tuple[int, float]] = deque(maxlen=PREFILL_SAMPLES)
        self.debt = 0.0  # seconds over the target that decode-only steps have yet to pay back
        self.steps_since_decode_only = 0  # paced steps since the last decode-only one

    @property
    def enabled(self) -> bool:
        return self.slowdown > 1

    def decode_seconds(self, num_decodes: int) -> float | None:
        """What a decode-only step of num_decodes costs: the median of recent ones of about that size."""
        if not self.decode_steps:
            return None
        near = [t for n, t in self.decode_steps if num_decodes / 2 <= n <= num_decodes * 2]
        if near:
            return statistics.median(near)
        n, t = min(self.decode_steps, key=lambda s: abs(s[0] - num_decodes))
        return t * num_decodes / n if n < num_decodes else t

    def prefill_limit(self, num_decodes: int) -> int | None:
        """The prefill tokens a step with num_decodes decodes may carry; None = not paced."""
        if not self.enabled or num_decodes == 0:
            return None
        self.steps_since_decode_only += 1
        decode = self.decode_seconds(num_decodes)
        # a debt under half what a decode-only step pays back waits: a whole step for a hair over the
        # bound would cost the prompt more than it gives the streams
        owed = decode is None or self.debt > 0.5 * (self.slowdown - 1) * decode
        if owed or self.steps_since_decode_only > PROBE_EVERY:
            self.steps_since_decode_only = 0
            return 0  # a decode-only step: pays back the debt, or measures what the decodes cost alone
        return self.allowed

    def observe(self, num_decodes: int, num_prefill: int, seconds: float) -> None:
        if not self.enabled or num_decodes == 0 or seconds <= 0:
            return
        if num_prefill == 0:
            decode = self.decode_seconds(num_decodes)
            self.decode_steps.append((num_decodes, seconds))
            self.debt = max(0.0, self.debt - (self.slowdown - 1) * (decode or seconds))
            return
        decode = self.decode_seconds(num_decodes)
        if decode is None:
            return  # nothing to compare with yet
        target = self.slowdown * decode
        cost = max(seconds - decode, 1e-9) / num_prefill
        if num_prefill < self.allowed / 2 and cost * self.allowed <= target - decode:
            return  # a short chunk (a prompt's last) within the target says nothing against the allowance
        self.prefill_costs.append((num_prefill, cost))
        # chunks of about the size asked next: below a CPU's compute-bound knee a token costs ~nothing,
        # and small chunks' costs would grow the allowance past it
        costs = [c for n, c in self.prefill_costs if n >= self.allowed / 2] or [cost]
        # the median of recent steps' cost per token: one slow step (noise) moves it little
        per_token = statistics.median(costs)
        # the debt is what this chunk costs over the bound at that rate, not what the step took: a stall
        # of a busy machine is not the prefill's doing; MAX_PAYBACK_STEPS decode-only steps at most
        over = min(
            decode + per_token * num_prefill - target, MAX_PAYBACK_STEPS * (self.slowdown - 1) * decode
        )
        self.debt = max(0.0, self.debt + over)
        fitting = (target - decode) / per_token
        fitting = min(self.allowed * MAX_CHANGE, max(self.allowed / MAX_CHANGE, fitting))
        self.allowed = min(self.max_tokens, max(MIN_PREFILL_TOKENS, int(fitting)))
