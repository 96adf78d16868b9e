"""What the "slo" scheduling policy knows: each request's objectives, and what a step costs.

A request may carry a time-to-first-token objective and a time-per-output-token objective (`Objectives`,
seconds; either may be None). The scheduler (infer/core/scheduler.py) serves waiting requests by TTFT
deadline and, when requests are decoding, sizes the step's prefill so that the step ends in time for
the decode with the least slack to its TPOT objective. For that it needs the time of a step of N tokens:
`StepCostModel`, a line a + b * N fit online from the engine's own step times (injectable, so that
tests decide the costs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Objectives:
    """Per-request objectives in seconds: first token within ttft_s of arrival; each later token within
    tpot_s on average (the decode rate). None: no objective of that kind."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            value = getattr(self, name)
            ok = value is None or (isinstance(value, int | float) and math.isfinite(value) and value > 0)
            if not ok:
                raise ValueError(f"{name} must be a finite number > 0 (seconds) or None, got {value!r}")


class StepCostModel:
    """seconds(N) = a + b * N for a step of N tokens: exponentially weighted least squares over the
    observed steps (weight `decay` per step, so that it follows a machine that drifts). The prior (a, b)
    holds until `min_steps` steps have been seen; while every step seen has the same size, only `a`
    is fit (the slope stays)."""

    def __init__(self, a: float = 0.005, b: float = 1e-4, decay: float = 0.99, min_steps: int = 8):
        if not (a >= 0 and b > 0 and 0 < decay <= 1 and min_steps >= 1):
            raise ValueError("StepCostModel needs a >= 0, b > 0, 0 < decay <= 1, min_steps >= 1")
        self.a, self.b, self.decay, self.min_steps = a, b, decay, min_steps
        self.num_steps = 0
        self._w = self._n = self._t = self._nn = self._nt = 0.0  # weighted sums over (N, t)

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        n, d = float(num_tokens), self.decay
        self._w = d * self._w + 1.0
        self._n = d * self._n + n
        self._t = d * self._t + seconds
        self._nn = d * self._nn + n * n
        self._nt = d * self._nt + n * seconds
        self.num_steps += 1
        if self.num_steps < self.min_steps:
            return
        var = self._w * self._nn - self._n**2
        if var > 1e-9 * self._w * self._nn:
            b = (self._w * self._nt - self._n * self._t) / var
            if b > 0:  # a cost that falls with more tokens is noise: keep the last slope
                self.b = b
        self.a = max(0.0, (self._t - self.b * self._n) / self._w)

    def seconds(self, num_tokens: int) -> float:
        return self.a + self.b * num_tokens

    def tokens_within(self, seconds: float) -> int:
        """The most tokens a step may hold and still end within `seconds` (0 if none)."""
        return max(0, int((seconds - self.a) / self.b))
