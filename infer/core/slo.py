"""What the "slo" scheduling policy knows: each request's objectives, and what a step costs.

Objectives come with the request (the API's `ttft_slo_ms` / `tpot_slo_ms`), or from the class it falls
in (`SloClasses`, `--slo-config FILE.yaml`): such as siso / silo / liso / lilo (short or long input,
short or long output), matched by prompt length and max_tokens, so that clients that send none are
still served by class.

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
from pathlib import Path
from typing import Any


class LateRequest(ValueError):
    """Refused at admission (--slo-reject-late): the request cannot meet its TTFT objective."""


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

    @classmethod
    def from_ms(cls, ttft_ms: float | None, tpot_ms: float | None) -> Objectives:
        return cls(*(None if v is None else v / 1000 for v in (ttft_ms, tpot_ms)))


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


@dataclass(frozen=True)
class SloClass:
    """Requests with prompt_tokens in [min_prompt, max_prompt] and max_tokens in [min_output,
    max_output] get `objectives`."""

    name: str
    objectives: Objectives
    min_prompt: int = 0
    max_prompt: int | None = None
    min_output: int = 0
    max_output: int | None = None

    def matches(self, num_prompt: int, max_tokens: int) -> bool:
        return (
            self.min_prompt <= num_prompt
            and (self.max_prompt is None or num_prompt <= self.max_prompt)
            and self.min_output <= max_tokens
            and (self.max_output is None or max_tokens <= self.max_output)
        )


class SloClasses:
    """The classes of an --slo-config file, first match wins:

        classes:
          - {name: siso, prompt_tokens: [0, 256], max_tokens: [0, 128], ttft_ms: 500, tpot_ms: 100}
          - {name: lilo, prompt_tokens: [257, null], max_tokens: [129, null], ttft_ms: 4000, tpot_ms: 150}

    A range is [min, max] with null for no bound; a missing range matches everything; ttft_ms or
    tpot_ms may be left out (no objective of that kind)."""

    def __init__(self, classes: list[SloClass]):
        self.classes = classes

    @classmethod
    def from_dict(cls, doc: Any, source: str = "slo config") -> SloClasses:
        if not isinstance(doc, dict) or not isinstance(doc.get("classes"), list) or not doc["classes"]:
            raise ValueError(f"{source}: needs `classes:`, a list of classes (see infer.core.slo.SloClasses)")
        classes = []
        for i, entry in enumerate(doc["classes"]):
            where = f"{source}: class {i}"
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                raise ValueError(f"{where}: a mapping with a `name`")
            unknown = set(entry) - {"name", "prompt_tokens", "max_tokens", "ttft_ms", "tpot_ms"}
            if unknown:
                raise ValueError(f"{where} ({entry['name']}): unknown keys {sorted(unknown)}")
            try:
                objectives = Objectives.from_ms(entry.get("ttft_ms"), entry.get("tpot_ms"))
            except (TypeError, ValueError) as exc:
                message = f"{where} ({entry['name']}): ttft_ms and tpot_ms: numbers > 0 ({exc})"
                raise ValueError(message) from exc
            prompt = _range(entry.get("prompt_tokens"), f"{where}: prompt_tokens")
            output = _range(entry.get("max_tokens"), f"{where}: max_tokens")
            classes.append(SloClass(entry["name"], objectives, *prompt, *output))
        return cls(classes)

    @classmethod
    def from_file(cls, path: str) -> SloClasses:
        import yaml

        try:
            doc = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise ValueError(f"cannot read the SLO config {path}: {exc}") from exc
        return cls.from_dict(doc, source=path)

    def objectives_for(self, num_prompt: int, max_tokens: int) -> Objectives | None:
        for c in self.classes:
            if c.matches(num_prompt, max_tokens):
                return c.objectives
        return None


def _range(value: Any, where: str) -> tuple[int, int | None]:
    if value is None:
        return 0, None
    ok = isinstance(value, list) and len(value) == 2 and isinstance(value[0], int) and value[0] >= 0
    ok = ok and (value[1] is None or (isinstance(value[1], int) and value[1] >= value[0]))
    if not ok:
        raise ValueError(f"{where}: [min, max] token counts (max may be null), got {value!r}")
    return value[0], value[1]
