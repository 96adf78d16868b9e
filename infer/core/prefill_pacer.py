"""How many prefill tokens a step may carry beside running decodes, so that a long prompt does not stall
everyone's stream.

A decode step on a CPU costs about one read of the weights; a step that also carries a 2048-token prefill
chunk costs many times that, and every running stream waits for it. The pacer keeps a step with decodes
within `max_decode_slowdown` times what a decode-only step of the same decodes costs, by the number of
prefill tokens it lets in:

    target  = max_decode_slowdown * decode_cost(num_decodes)       decode_cost: fit on decode-only steps
    allowed = allowed * ((target - decode) / (observed - decode))  after each step with both, damped

The allowance follows measured step times rather than a model of them, so that what a linear model misses
(attention over a long context, prompt logprobs, a busy machine) is counted as the time it takes. Steps
without decodes are not paced: a prompt alone gets the whole budget. With a streak of paced steps and no
decode-only step to learn from, one step in `PROBE_EVERY` runs without prefill, so that the decode cost
follows the batch (a stream that joins while a long prompt is prefilled has never been seen alone).

A bystander's time is then at most about max_decode_slowdown times its time alone, and the long prompt's
own time to first token grows by about the bystanders' time alone (each paced step carries about
(max_decode_slowdown - 1) decode steps' worth of prefill). docs/engine.md, "Long prompts beside running
streams", has the measured tradeoff.
"""

from __future__ import annotations

from infer.core.slo import StepCostModel

MIN_PREFILL_TOKENS = 1  # a step with decodes keeps at least this much prefill: prompts always progress
PROBE_EVERY = 32  # paced steps between decode-only steps that refresh the decode cost
INITIAL_PREFILL_TOKENS = 64  # learned up by doubling: a chunk too small costs less than one too big
MAX_CHANGE = 2.0  # the allowance moves at most this factor per step (damping one noisy step)


class PrefillPacer:
    def __init__(self, max_decode_slowdown: float, max_tokens: int) -> None:
        self.slowdown = max_decode_slowdown
        self.max_tokens = max_tokens
        self.allowed = min(INITIAL_PREFILL_TOKENS, max_tokens)
        self.decode_cost = StepCostModel(min_steps=1)
        self.steps_since_decode_only = 0  # paced steps since the last decode-only one

    @property
    def enabled(self) -> bool:
        return self.slowdown > 1

    def prefill_limit(self, num_decodes: int) -> int | None:
        """The prefill tokens a step with num_decodes decodes may carry; None = not paced."""
        if not self.enabled or num_decodes == 0:
            return None
        self.steps_since_decode_only += 1
        if self.steps_since_decode_only > PROBE_EVERY or self.decode_cost.num_steps == 0:
            self.steps_since_decode_only = 0
            return 0  # a decode-only step, to learn what these decodes cost alone
        return self.allowed

    def observe(self, num_decodes: int, num_prefill: int, seconds: float) -> None:
        if not self.enabled or num_decodes == 0 or seconds <= 0:
            return
        if num_prefill == 0:
            self.decode_cost.observe(num_decodes, seconds)
            return
        if self.decode_cost.num_steps == 0:
            return  # nothing to compare with yet
        decode = self.decode_cost.seconds(num_decodes)
        target_prefill = (self.slowdown - 1) * decode
        observed_prefill = max(seconds - decode, 1e-6)
        fitting = num_prefill * target_prefill / observed_prefill  # the tokens that would have met the target
        if num_prefill < self.allowed and fitting >= self.allowed:
            return  # a short chunk (a prompt's last) within the target says nothing against the allowance
        fitting = min(self.allowed * MAX_CHANGE, max(self.allowed / MAX_CHANGE, fitting))
        self.allowed = min(self.max_tokens, max(MIN_PREFILL_TOKENS, int(fitting)))
