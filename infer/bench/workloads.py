"""Five serving workloads (baseline, continuous_batching, paged_attention, chunked_prefill,
prefix_caching), and scale presets that shrink them for a small machine.

| workload            | requests | prompt tokens                  | max tokens | arrivals            |
|---------------------|---------:|--------------------------------|------------|---------------------|
| baseline            |       10 | ~256                           | 256        | sequential          |
| continuous_batching |       32 | ~[64, 512]                     | [64, 256]  | uniform 4 req/s     |
| paged_attention     |       48 | ~[128, 384]                    | [128, 256] | one burst           |
| chunked_prefill     |       48 | 75% ~[1024, 2048], 25% [64, 128] | [64, 256] | Poisson 6 req/s     |
| prefix_caching      |       48 | ~1024 shared + ~[32, 128]      | 256        | uniform 8 req/s     |

A scale multiplies counts, prompt lengths, max tokens and rates; each workload keeps its character (a
sequential floor, staggered arrivals, one burst, mostly-long prompts among short ones, one shared prefix).
"""

from __future__ import annotations

import dataclasses
import random
import zlib
from dataclasses import dataclass

from infer.bench.arrivals import Arrivals
from infer.bench.client import RequestSpec
from infer.bench.prompts import PromptFactory


@dataclass(frozen=True)
class Scale:
    """Multipliers applied to a workload; results are rounded and kept >= the minimums."""

    requests: float = 1.0
    prompt: float = 1.0
    max_tokens: float = 1.0
    rate: float = 1.0
    min_requests: int = 2


SCALES = {
    "full": Scale(),
    # the whole `all` run in a few minutes on a 2-core CPU with the embedded model (context 1024)
    "small": Scale(requests=0.5, prompt=0.25, max_tokens=0.25, rate=1.0),
    # a smoke test: a handful of short requests per workload
    "tiny": Scale(requests=0.1, prompt=0.0625, max_tokens=1 / 32, rate=2.0, min_requests=3),
}


@dataclass(frozen=True)
class Workload:
    """A named request mix. `prompt_tokens` is a tuple of (share, lo, hi): a share of the requests draws its
    prompt length uniformly in [lo, hi]. With `shared_prefix_tokens` every prompt starts with one prefix."""

    name: str
    num_requests: int
    prompt_tokens: tuple[tuple[float, int, int], ...]
    max_tokens: tuple[int, int]
    arrival: str  # Arrivals.parse syntax: synchronous, constant:4, burst, poisson:6
    shared_prefix_tokens: int = 0
    measures: str = ""

    def __post_init__(self):
        if self.num_requests < 1:
            raise ValueError(f"workload {self.name}: needs at least 1 request")
        if abs(sum(s for s, _, _ in self.prompt_tokens) - 1.0) > 1e-6:
            raise ValueError(f"workload {self.name}: prompt length shares must sum to 1")
        for _, lo, hi in self.prompt_tokens:
            if not 1 <= lo <= hi:
                raise ValueError(f"workload {self.name}: prompt range [{lo}, {hi}] must have 1 <= lo <= hi")
        if not 1 <= self.max_tokens[0] <= self.max_tokens[1]:
            raise ValueError(f"workload {self.name}: max_tokens range {self.max_tokens} is invalid")
        Arrivals.parse(self.arrival)  # validates

    def arrivals(self, seed: int) -> Arrivals:
        return Arrivals.parse(self.arrival, seed=seed)

    def scaled(self, scale: Scale) -> Workload:
        def n(x: float, f: float, floor: int = 1) -> int:
            return max(floor, round(x * f))

        mode, _, arg = self.arrival.partition(":")
        arrival = f"{mode}:{float(arg) * scale.rate:g}" if mode in ("constant", "poisson") else self.arrival
        return dataclasses.replace(
            self,
            num_requests=n(self.num_requests, scale.requests, scale.min_requests),
            prompt_tokens=tuple(
                (s, n(lo, scale.prompt), n(hi, scale.prompt)) for s, lo, hi in self.prompt_tokens
            ),
            max_tokens=(n(self.max_tokens[0], scale.max_tokens), n(self.max_tokens[1], scale.max_tokens)),
            arrival=arrival,
            shared_prefix_tokens=n(self.shared_prefix_tokens, scale.prompt, 0),
        )

    def longest(self) -> int:
        """The most tokens one request may hold (prompt + output), at ~4 chars/token."""
        return self.shared_prefix_tokens + max(hi for _, _, hi in self.prompt_tokens) + self.max_tokens[1]

    def build(self, seed: int, max_model_len: int | None = None, nonce: str = "") -> list[RequestSpec]:
        """The workload's requests, reproducible from `seed` and the workload's name.

        A non-empty `nonce` (a cache buster) starts every prompt, so a run never hits the prefix cache
        left by an earlier run: one per request (`[nonce 7] `), or, with a shared prefix, one before the
        prefix so the requests of this run still share it. With `max_model_len`, prompt lengths are cut
        so prompt + max_tokens stays within ~80% of the context (the token estimate is approximate)."""
        rng = random.Random(seed + zlib.crc32(self.name.encode()))
        prompts = PromptFactory(rng.randrange(2**32))
        prefix = prompts.shared_prefix(self.shared_prefix_tokens) if self.shared_prefix_tokens else ""
        if nonce and prefix:
            prefix = f"[{nonce}] {prefix}"
        shares = [s for s, _, _ in self.prompt_tokens]
        specs = []
        for i in range(self.num_requests):
            _, lo, hi = rng.choices(self.prompt_tokens, weights=shares)[0]
            num_prompt = rng.randint(lo, hi)
            max_tokens = rng.randint(*self.max_tokens)
            if max_model_len is not None:
                budget = int(0.8 * max_model_len) - max_tokens - self.shared_prefix_tokens
                if budget < 1:
                    raise ValueError(
                        f"workload {self.name}: max_tokens {max_tokens} and a "
                        f"{self.shared_prefix_tokens}-token prefix do not fit the server's context of "
                        f"{max_model_len}; use a smaller --scale"
                    )
                num_prompt = min(num_prompt, budget)
            head = prefix or (f"[{nonce} {i}] " if nonce else "")
            specs.append(
                RequestSpec(
                    prompt=head + prompts.text(num_prompt),
                    max_tokens=max_tokens,
                    req_class=self.name,
                    target_prompt_tokens=self.shared_prefix_tokens + num_prompt,
                )
            )
        return specs


WORKLOADS = {
    w.name: w
    for w in [
        Workload("baseline", 10, ((1.0, 256, 256),), (256, 256), "synchronous",
                 measures="single-request overhead floor"),
        Workload("continuous_batching", 32, ((1.0, 64, 512),), (64, 256), "constant:4",
                 measures="TTFT P95/P99 (benefit of per-step admit/retire)"),
        Workload("paged_attention", 48, ((1.0, 128, 384),), (128, 256), "burst",
                 measures="throughput + TTFT (paged admits more per memory budget)"),
        Workload("chunked_prefill", 48, ((0.75, 1024, 2048), (0.25, 64, 128)), (64, 256), "poisson:6",
                 measures="ITL P95/P99 (long prefills block decode)"),
        Workload("prefix_caching", 48, ((1.0, 32, 128),), (256, 256), "constant:8", shared_prefix_tokens=1024,
                 measures="TTFT P50/P95 (repeated prefill cost)"),
    ]
}  # fmt: skip


def get_workloads(names: str, scale: str | Scale = "full") -> list[Workload]:
    """`names` is 'all' or a comma-separated list; `scale` a preset name or a Scale."""
    if isinstance(scale, str):
        if scale not in SCALES:
            raise ValueError(f"unknown scale {scale!r}; expected one of {', '.join(SCALES)}")
        scale = SCALES[scale]
    wanted = list(WORKLOADS) if names == "all" else [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in WORKLOADS]
    if unknown or not wanted:
        raise ValueError(
            f"unknown workload {unknown or names!r}; expected 'all' or some of {', '.join(WORKLOADS)}"
        )
    return [WORKLOADS[n].scaled(scale) for n in wanted]
