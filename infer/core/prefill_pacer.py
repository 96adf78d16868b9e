"""When a step may carry a prefill chunk beside running decodes, and how large, so that a long prompt
neither stalls everyone's stream nor crawls.

What a client judges is a stream's whole time, against its time alone, and a prompt's time to first
token. On a CPU a prefill chunk's cost per token falls steeply with its size (a 512-token chunk costs
~1.7x per token what a 2,048-token one does on a 135M model), so pacing every gap with small chunks makes
the prompt pay 2.4-2.9x its time to first token. Instead each stream holds a slowdown budget, its credit:

  - earned: (max_decode_slowdown - 1) x its decode pace (a decode-only step of this many decodes) for
    every token it has made and for up to CREDIT_TOKENS tokens it may still make (at most its
    max_tokens): a stream that just started holds credit, and its credit never exceeds that lookahead's
    worth, so a stream that ran alone for long does not absorb a whole prefill in one stall;
  - spent: a step that carries decodes and a prefill chunk costs each of its decodes the chunk's time
    (the step's over a decode-only one), at most STALL_FACTOR x its price at the median cost per token
    of the latest chunks of about that size (a stall of a busy machine is not the prefill's doing);
  - a step beside decodes carries a whole planned chunk (the budget, or --long-prefill-token-threshold
    for a long prompt: large chunks are the efficient ones) when SPEND_SHARE of the poorest decode's
    credit pays for the whole remaining prefill of the prompt the step serves first (a margin for what
    the price misses: attention grows with the context).

When the credit cannot pay for that whole prefill, sharing the steps helps nobody: a chunk spent beside a
stream that outlasts its credit delays the stream, and the prompt still waits for the stream's end. So
one order is chosen instead (prompt_goes_first), from the prompt's remaining prefill T (its cost units
at the measured price, in whole chunks) and each stream's remaining time alone A ((max_tokens - made) x
its decode pace) and remaining slowdown budget (its credit and what its tokens to come still earn):

  - the streams first (decode-only steps, which earn, until they end or their credit pays for the
    rest) when the prompt, having waited W since it arrived, still gets its first token within
    PROMPT_SLOWDOWN x its time alone: W + max A + T <= 1.5 x its whole prefill;
  - else the prompt first, the whole budget to the end of its prefill (as --max-decode-slowdown 0),
    unless that breaks the budget of a stream that was running before the prompt arrived: where only
    one bound can hold, the stream's is kept. A stream that came after the prompt does not hold it
    past its 1.5x, so a prompt does not starve behind a line of new streams: it waits at most for the
    streams that were there before it (each shorter than its prefill, or its budget would cover it).
    While it waits, a newcomer whose whole prompt the streams' credit pays for (`spare`) is prefilled
    beside them: a short request does not wait with the held prompt.

Paper bounds, for a prompt of prefill time T beside a stream of remaining time alone A, at
max_decode_slowdown 2: T <= A, the credit pays for it (or, the credit being capped, the stream's
budget does and the prompt goes first): both hold; T >= 2A, the stream goes first and the prompt waits
A <= T/2: both hold; A < T < 2A, no schedule holds both (whichever finishes first pays the other's whole
time): the stream goes first and keeps 1x, the prompt pays (A + T) / T, up to 2x; if the stream arrived
after the prompt, the prompt goes first and the stream pays (A + T) / A, up to 3x. A stream that stops
early (EOS, a stop string) was counted for all its max_tokens: after a prompt that went first, it may
end past its bound. A decode in a step that also carries a chunk costs the prompt little on a CPU (the
weights are read once for both), which narrows the band.

Before a chunk of about the wanted size was measured, a prefill token is priced at a decode step /
PRIOR_TOKENS_PER_DECODE, or at the largest smaller chunk's cost per token if lower: both on the safe side
on a CPU (a 2,048-token chunk costs ~30-100 decode steps there, not 256), so the first chunks do not
overshoot, and while the price is such a guess, the smaller chunk the credit buys goes through to
measure it; a decode-only step comes first when no decode step was measured yet, and one
every PROBE_EVERY paced steps refreshes it (a stream that joined while a long prompt was prefilled has
never been seen alone). Steps without decodes are not paced (the scheduler runs a short newcomer's
prefill alone before the running prompts' next chunks and the queued long prompts, so its first token
does not wait for them).

A crowded group (one client's several requests in flight, where the server tells clients apart, or one
request's n choices) is one client flooding the server: its prompts' chunks in a step are cut together
to `group_chunk`. Beside anyone else, that is a step of at most about 1 + BESIDE_SHARE x
(max_decode_slowdown - 1) decode-only ones at the latest chunks' price (on a 2-core CPU, where a 135M
model's prefill token costs about a tenth of its decode step and more deep in a long prompt, a few
tokens), so other clients' gaps keep their bound; the flood's prefill then runs at that chunk's cost
per token. Alone, the flood gets GROUP_ALONE_CHUNK tokens a step: near
the largest chunks' cost per token (a newcomer stops such a step between layers: llm_engine.py). A lone
long prompt keeps its whole chunks and the order above (its time to first token is bounded too).
docs/robustness.md, "Long prompts: the streams' gaps against the prompt's first token", has what no
schedule can do and how to measure the tradeoff.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

from infer.core.decode_costs import DecodeCosts
from infer.core.request import Request

MIN_PREFILL_TOKENS = 8  # a chunk at least: smaller ones cost a step's overhead for little progress
CREDIT_TOKENS = 256  # a stream's credit looks this many tokens ahead, and holds at most their worth
PRIOR_TOKENS_PER_DECODE = 8  # before a chunk was measured: a prefill token costs a decode step / this
PROBE_EVERY = 32  # paced steps between decode-only steps that refresh the decode cost
PREFILL_SAMPLES = 8  # recent chunks kept
SPEND_SHARE = 0.8  # of a credit a chunk may be priced at
STALL_FACTOR = 2.0  # a chunk is charged at most this many times its price
RATE_SAMPLES = 3  # the latest chunks of about a size whose median cost per token prices the next
PROMPT_SLOWDOWN = 1.5  # a prompt's time to first token held behind streams, at most this x its time alone
GROUP_CHUNK_FLOOR = 1  # a crowded group's chunk beside others at least, so that it progresses
# of the slowdown others allow, what a crowded group's step beside them is planned to take: they judge
# each gap (a p99 lands on the worst steps), and the rest is the margin for what a price misses
BESIDE_SHARE = 0.5
GROUP_ALONE_CHUNK = 256  # a crowded group's chunk while no one else runs or waits (module docstring)


class NextPrompt(NamedTuple):
    """The prompt a step's prefill serves first: its prefill's cost units still to run and in all, and
    the seconds since it arrived."""

    req: Request
    remaining: int
    total: int
    waited: float


class PrefillPacer:
    """max_decode_slowdown: a stream's whole time beside prefills, at most about this many times its
    time alone (<= 1: off, every step takes the whole budget). Prefill is counted in the scheduler's
    cost units, where a prompt-logprob token counts its LM-head row and logprob work too."""

    def __init__(self, max_decode_slowdown: float) -> None:
        self.slowdown = max_decode_slowdown
        self.decode_costs = DecodeCosts()  # decode-only steps' cost by batch size
        # (prefill cost units, seconds over a decode-only step) of recent steps that carried a chunk
        self.prefill_steps: deque[tuple[int, float]] = deque(maxlen=PREFILL_SAMPLES)
        self.steps_since_decode_only = 0  # paced steps since the last decode-only one
        self.prompt_first: Request | None = None  # a prompt whose whole prefill runs before the streams
        # while a prompt waits for the streams: the units their credit pays for a newcomer's whole prompt
        self.spare = 0

    @property
    def enabled(self) -> bool:
        return self.slowdown > 1

    def decode_seconds(self, num_decodes: int) -> float | None:
        """What a decode-only step of num_decodes costs (decode_costs.py); None before one was measured."""
        return self.decode_costs.seconds(num_decodes)

    def seconds_per_unit(self, units: int, num_decodes: int) -> tuple[float, bool] | None:
        """A chunk of `units`' time per unit, and whether chunks of about that size priced it: the median
        of the latest RATE_SAMPLES chunks of at least half that size (attention's cost grows with the
        context: the latest); else a guess on the safe side, the lower of the prior and the largest
        smaller chunk's (a CPU's cost per token falls with the chunk); None before any decode step."""
        near = [t / n for n, t in self.prefill_steps if n >= units / 2][-RATE_SAMPLES:]
        if near:
            return statistics.median(near), True
        decode = self.decode_seconds(max(1, num_decodes))
        if decode is None:
            return None
        guess = decode / PRIOR_TOKENS_PER_DECODE
        if self.prefill_steps:
            n, t = max(self.prefill_steps)
            guess = min(guess, t / n)
        return guess, False

    def group_chunk(self, num_decodes: int, others: bool) -> int:
        """The cost units of a crowded group's prompt chunks in one step (one client's several requests
        in flight, or one request's n choices). Beside others (requests outside the group, running or
        waiting): a step that costs at most about a decode-only step of num_decodes (at least one) and
        spendable_beside it, at the latest chunks' price, at least GROUP_CHUNK_FLOOR; alone,
        GROUP_ALONE_CHUNK."""
        if not others:
            return GROUP_ALONE_CHUNK
        decode = self.decode_seconds(max(1, num_decodes))
        price = self.seconds_per_unit(GROUP_CHUNK_FLOOR, num_decodes)
        if decode is None or price is None:
            return GROUP_CHUNK_FLOOR
        return max(GROUP_CHUNK_FLOOR, int(self.spendable_beside(decode) / price[0]))

    def spendable_beside(self, decode: float) -> float:
        """What a step beside others may cost over their decode-only step of `decode` seconds: BESIDE_SHARE
        of the slowdown they allow, a margin for what a price misses (the group's chunks here, its
        decode rows in group_decode_bound.py)."""
        return BESIDE_SHARE * (self.slowdown - 1) * decode

    def credit_of(self, req: Request, decode: float) -> float:
        """req's credit now, after earning for the tokens it has made and those it may still make (up to
        CREDIT_TOKENS ahead), capped at the lookahead's worth."""
        params = req.sampling_params
        ahead = min(max(0, params.max_tokens - req.num_output_tokens), CREDIT_TOKENS)
        earned_to = req.num_output_tokens + ahead
        if earned_to > req.pace_credited_tokens:
            req.pace_credit += (self.slowdown - 1) * decode * (earned_to - req.pace_credited_tokens)
            req.pace_credited_tokens = earned_to
        req.pace_credit = min(req.pace_credit, (self.slowdown - 1) * decode * CREDIT_TOKENS)
        return req.pace_credit

    def prefill_limit(
        self, decodes: Sequence[Request], wanted: int, prompt: NextPrompt | None = None
    ) -> int | None:
        """The prefill cost units a step with these decodes may carry (0: a decode-only step); None: not
        paced. wanted: the units of the chunks the step would carry unpaced (the budget, a long prompt's
        threshold, a prompt's last chunk); prompt: the one those chunks serve first, whose whole remaining
        prefill the credit must pay for chunks to share the steps (else an order: module docstring)."""
        self.spare = 0
        if not self.enabled or not decodes:
            return None
        decode = self.decode_seconds(len(decodes))
        if decode is None or self.steps_since_decode_only > PROBE_EVERY:
            self.steps_since_decode_only = 0
            return 0  # measures what the decodes cost alone
        credits = [self.credit_of(r, decode) for r in decodes]
        wanted = max(1, wanted)
        per_unit, measured = self.seconds_per_unit(wanted, len(decodes))
        # a margin for what the price misses: attention grows with the context a chunk reaches
        affordable = int(SPEND_SHARE * min(credits) / per_unit)
        self.steps_since_decode_only += 1
        if prompt is not None and prompt.req is self.prompt_first:
            return wanted  # its order was chosen: the whole budget to its end
        self.prompt_first = None
        if affordable >= max(wanted, prompt.remaining if prompt else 0):
            return wanted  # the credit pays for the whole prefill: chunks beside the streams
        if not measured and affordable >= MIN_PREFILL_TOKENS:
            return affordable  # a guessed price: the chunk it buys measures it
        if prompt is not None and self.prompt_goes_first(decodes, credits, decode, per_unit, wanted, prompt):
            self.prompt_first = prompt.req
            return wanted
        self.steps_since_decode_only = 0
        self.spare = affordable  # a short newcomer still passes the held prompt (spare)
        return 0  # the streams first: a decode-only step, which earns and measures the decodes alone

    def prompt_goes_first(
        self,
        decodes: Sequence[Request],
        credits: Sequence[float],
        decode: float,
        per_unit: float,
        chunk: int,
        prompt: NextPrompt,
    ) -> bool:
        """Whether the prompt's whole remaining prefill runs before the streams end (else they run first):
        held behind the streams, the prompt waits for the longest; run first, it stalls every stream for
        its whole prefill, which a stream's remaining slowdown budget (its credit and what its tokens
        still to come earn) may not cover. The streams go first when that keeps the prompt within
        PROMPT_SLOWDOWN x its time to first token alone, or when the prompt going first would break the
        bound of a stream that was there before it (a stream's bound is kept where only one can hold);
        a stream that came after the prompt does not hold it past its bound (no prompt starves behind a
        line of newcomers)."""
        charge = prompt.remaining * per_unit  # what the prompt's chunks cost each stream, run first
        left = charge + math.ceil(prompt.remaining / chunk) * decode  # its prefill from here, alone
        alone = prompt.total * per_unit + math.ceil(prompt.total / chunk) * decode
        streams_left = (
            max(max(0, r.sampling_params.max_tokens - r.num_output_tokens) for r in decodes) * decode
        )
        if prompt.waited + streams_left + left <= PROMPT_SLOWDOWN * alone:
            return False  # the streams first keep every bound
        for req, credit in zip(decodes, credits, strict=True):
            unearned = max(0, req.sampling_params.max_tokens - req.pace_credited_tokens)
            budget = credit + (self.slowdown - 1) * decode * unearned
            if SPEND_SHARE * budget < charge and req.arrival_time <= prompt.req.arrival_time:
                return False
        return True

    def observe(self, decodes: Sequence[Request], prefill_units: int, seconds: float) -> None:
        """The last step, with these decodes and prefill_units of prefill, took seconds."""
        if not self.enabled or seconds <= 0 or (not decodes and not prefill_units):
            return
        if not prefill_units:
            self.decode_costs.add(len(decodes), seconds)
            return
        # over a decode-only step: a prompt alone also reads the weights once (before any decode step
        # was measured, its whole time: a price on the safe side)
        over = max(seconds - (self.decode_seconds(max(1, len(decodes))) or 0.0), 1e-9)
        price = self.seconds_per_unit(prefill_units, len(decodes))
        priced = (price[0] if price else over / prefill_units) * prefill_units
        self.prefill_steps.append((prefill_units, over))
        # what the chunk took, but at most STALL_FACTOR x its price: a stall of a busy machine is not
        # the prefill's doing
        charge = min(over, STALL_FACTOR * priced)
        for req in decodes:
            req.pace_credit -= charge
