"""Whether the next step's decodes get proposals: speculation where this engine measured that it pays, per
batch size, rather than wherever few enough requests run.

A step in which B decoding requests verify proposals costs c_v(B), a plain decode step of B costs c_d(B)
(DecodeCosts tables of this engine's own decode-only steps, the proposing for them included), and a
verification step yields y tokens a request: 1 + the proposals it accepted, over the latest such steps
(a request whose lookup found nothing yields its one token). Decoding plainly, y tokens take y steps of
c_d; so speculating pays while y x c_d(B) > c_v(B). Proposals cost compute: at one stream of a model whose
step is its weights' reads a verification costs little more than a decode, and a modest acceptance pays;
in a wide batch, or where the text does not repeat itself (acceptance near 0), it does not.

Per batch size the gate speculates until MIN_VERIFY verification steps were measured, then decodes
plainly until MIN_PLAIN plain ones were (enough for each kind's decode graph to be captured and the
latest DecodeCosts samples to be replays: an eager step costs ~2x one replayed on a small model), then
follows the inequality; every PROBE_EVERY-th decision at a size goes the other way, so that the costs
and the yield it judges by stay current (a text that starts quoting itself turns speculation back on).
speculative_config's disable_by_batch_size stays a hard cap, and "disable_by_gain": false turns the gate
off (speculate whenever the cap allows, as vLLM does).
What it buys: docs/speculative-decoding.md, "When it switches itself off".
"""

from __future__ import annotations

import logging
import statistics
from collections import deque

from infer.core.decode_costs import DecodeCosts

logger = logging.getLogger("infer.engine")

# steps of each kind measured at a batch size before the gate judges it: past a decode graph's capture
# (decode_graph.STEADY_STEPS, then the capture), so that DecodeCosts' latest SAMPLES are replays
MIN_VERIFY = 16
MIN_PLAIN = 12
PROBE_EVERY = 32  # decisions at a batch size between two that go against the verdict
YIELD_STEPS = 8  # latest verification steps whose tokens per request make the yield


class SpeculationGate:
    def __init__(self, max_batch: int, by_gain: bool = True) -> None:
        self.max_batch, self.by_gain = max_batch, by_gain
        self.plain = DecodeCosts()  # decode-only steps without proposals, by batch size
        self.verify = DecodeCosts()  # decode-only steps that verified proposals
        self.yields: deque[float] = deque(maxlen=YIELD_STEPS)  # tokens per request of a verification step
        self._decisions: dict[int, int] = {}  # per batch size, decisions made
        self._verdicts: dict[int, bool] = {}  # per batch size, the last verdict logged

    def speculate(self, running: int, decoding: int) -> bool:
        """Whether the next step's decodes get proposals: `running` requests, `decoding` of them decoding."""
        if running > self.max_batch:
            return False
        if not self.by_gain or decoding == 0:
            return True
        if self.verify.count(decoding) < MIN_VERIFY:  # each verification step measured left a yield
            return True
        if self.plain.count(decoding) < MIN_PLAIN:
            return False
        verdict = self.pays(decoding)
        if self._verdicts.get(decoding) != verdict:
            self._verdicts[decoding] = verdict
            logger.info(
                "speculation %s at %d decoding requests: %.2f tokens a request per verification step, "
                "which costs %.2fx a decode step",
                "on" if verdict else "off",
                decoding,
                self.tokens_per_verification(),
                self.verify.seconds(decoding) / self.plain.seconds(decoding),
            )
        made = self._decisions[decoding] = self._decisions.get(decoding, 0) + 1
        return verdict != (made % PROBE_EVERY == 0)

    def pays(self, decoding: int) -> bool:
        """y x c_d(B) > c_v(B) with what was measured (both tables measured at B)."""
        return self.tokens_per_verification() * self.plain.seconds(decoding) > self.verify.seconds(decoding)

    def tokens_per_verification(self) -> float:
        return statistics.fmean(self.yields)

    def observe(self, decoding: int, verified: bool, seconds: float, tokens: int) -> None:
        """A decode-only step of `decoding` requests, with proposals verified or not, its wall time (the
        proposing for it included) and the tokens it made."""
        if decoding == 0:
            return
        (self.verify if verified else self.plain).add(decoding, seconds)
        if verified:
            self.yields.append(tokens / decoding)
