"""How many of a group's sequences decode in a step beside other clients' requests: a bound on the step's
cost, not on seats.

group_shares.py shares the batch's seats, but a seat is not a step's cost: 128 choices of one request
and one stream beside them make a step that costs many times the stream's step alone, and every one of
the stream's tokens waits for it. So while requests outside any group (or alone in theirs: a client's
only request, where the server groups a client's requests) run or wait (the others, B of them), the
groups' decode rows in a step are limited to K, the most for which the step's decode cost
stays within max_decode_slowdown (S) times the cost of the others' step alone, less the prefill pacer's
margin for what a price misses (PrefillPacer.spendable_beside, BESIDE_SHARE of the slowdown: a grammar's
mask, a logit_bias, the server's own work beside the step), as its group chunks do:

    cost(B + K) <= (1 + BESIDE_SHARE x (S - 1)) x cost(B)

cost(n) is what a decode-only step of n rows measured, the prefill pacer's table by batch size
(PrefillPacer.decode_costs, decode_costs.py): K runs up to where that cost first crosses the bound
(between two sizes measured, on the line through them, so that one slow wide step stops it early,
never late). K is at most twice the largest size measured, so the bound climbs to it a doubling at a
time instead of trusting costs far past what was measured; before any larger step was measured, or
where the largest measured no dearer than the others' (a stall of a busy machine), K = B (a step of
twice the others' rows costs at most twice theirs on any machine). When no step of about B rows was
ever measured, one step in PROBE_EVERY runs the others alone to measure it.

The K rows are shared alike among the groups (at least one each, so every group progresses), and within
a group go to the sequences with the fewest tokens generated: the rows rotate, every sequence progresses
and completes. A group alone, or groups beside each other only, run at their full width (no one waits
on them that is not one of them). The groups' admissions count in K too, a row per prompt token (the
scheduler admits a group's new sequences only into the rows its decodes left): a prompt token costs the
step a row of every linear, as a decode does, so 32 new choices of a 4-token prompt cost the others' step
what 128 decodes do.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from infer.core.prefill_pacer import PrefillPacer
from infer.core.request import Request

PROBE_EVERY = 32  # steps between runs of the others alone, when no step of about their size is known


class GroupDecodeBound:
    def __init__(self, pacer: PrefillPacer) -> None:
        self.pacer = pacer  # its slowdown, and the decode-only steps it measured
        self.steps_since_probe = PROBE_EVERY  # a first probe may come at once

    def held_back(self, decodes: Sequence[Request], num_others: int) -> tuple[set[Request], int | None]:
        """The grouped decodes that wait this step, and K (0 on a probe; None: unbounded). decodes: the
        running requests ready to decode; num_others: the requests outside any group, running or about
        to be admitted."""
        grouped: dict[str, list[Request]] = {}
        for req in decodes:
            if req.group_id is not None:
                grouped.setdefault(req.group_id, []).append(req)
        if not self.pacer.enabled or num_others == 0:
            return set(), None
        self.steps_since_probe += 1
        limit = self.rows_allowed(num_others)
        if limit is None:  # a probe: the others alone
            self.steps_since_probe = 0
            return {r for rows in grouped.values() for r in rows}, 0
        return _beyond_share(grouped.values(), limit), limit

    def rows_allowed(self, num_others: int) -> int | None:
        """K, the groups' decode rows beside num_others (module docstring); None: probe instead."""
        costs = self.pacer.decode_costs
        if not costs or not costs.measured(num_others / 2, 2 * num_others):
            return None if self.steps_since_probe >= PROBE_EVERY else num_others
        base = costs.seconds(num_others)
        above = costs.above(num_others)
        if not above or above[-1][0] <= 2 * num_others or above[-1][1] <= base:
            return num_others  # no wider step measured, or none dearer: no cost to trust past 2B
        limit = base + self.pacer.spendable_beside(base)
        ceiling = 2 * above[-1][0] - num_others  # at most a doubling past what was measured
        n0, t0 = num_others, base
        for n, t in above:
            if t > limit:  # the bound is crossed between n0 and n
                most = n0 + int((limit - t0) * (n - n0) / (t - t0) + 1e-9) if t > t0 else n0
                return max(1, min(most - num_others, ceiling))
            n0, t0 = n, t
        most = int(n0 * limit / t0)  # past the largest: its cost scaled by rows (decode_costs.py)
        return max(1, min(most - num_others, ceiling))


def _beyond_share(groups: Iterable[list[Request]], limit: int) -> set[Request]:
    """The rows past each group's share of limit (alike, at least one each), fewest tokens generated
    first: those that ran least wait least."""
    groups = sorted(groups, key=len)
    held: set[Request] = set()
    left = limit
    for i, rows in enumerate(groups):
        share = max(1, left // (len(groups) - i))  # what a smaller group leaves goes to the larger ones
        rows = sorted(rows, key=lambda r: (r.num_output_tokens, r.seq))
        held.update(rows[share:])
        left = max(0, left - min(share, len(rows)))
    return held
