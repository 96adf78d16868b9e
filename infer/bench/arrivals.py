"""Arrival processes: when each request of a run is meant to leave the client.

Two families:

- closed loop (`synchronous`, `concurrent`): N workers each send a request, wait for it to finish, send the
  next. A request's intended send time is the moment its worker became free, so there is no backlog to
  omit; `synchronous` is `concurrent` with N = 1.
- open loop (`constant`, `poisson`, `burst`): intended send times are fixed in advance, whatever the server
  does. With a concurrency cap a request may leave late; the client then measures from the intended time
  (see `metrics`), never from the actual one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MODES = ("synchronous", "concurrent", "constant", "poisson", "burst")


def constant_times(num_requests: int, rate: float) -> list[float]:
    """Evenly spaced sends at `rate` requests per second: 0, 1/rate, 2/rate, ..."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    return [i / rate for i in range(num_requests)]


def poisson_times(num_requests: int, rate: float, seed: int) -> list[float]:
    """A Poisson process at `rate` requests per second: exponential gaps with mean 1/rate, the first
    request at 0. The same seed gives the same times."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    if num_requests == 0:
        return []
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=num_requests - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


@dataclass(frozen=True)
class Arrivals:
    """An arrival process; `max_concurrency` caps in-flight requests of an open loop (None: no cap)."""

    mode: str
    rate: float | None = None  # requests/s, for constant and poisson
    concurrency: int = 1  # workers, for concurrent
    max_concurrency: int | None = None
    seed: int = 0

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown arrival mode {self.mode!r}; expected one of {', '.join(MODES)}")
        if self.mode in ("constant", "poisson") and (self.rate is None or self.rate <= 0):
            raise ValueError(f"arrival mode {self.mode!r} needs a rate > 0 requests/s")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")

    @property
    def closed_loop(self) -> bool:
        return self.mode in ("synchronous", "concurrent")

    @property
    def num_workers(self) -> int:
        """Closed loop only: how many requests are in flight at once."""
        return 1 if self.mode == "synchronous" else self.concurrency

    def schedule(self, num_requests: int) -> list[float]:
        """Open loop only: intended send offsets in seconds from the start of the run."""
        if self.mode == "constant":
            return constant_times(num_requests, self.rate)
        if self.mode == "poisson":
            return poisson_times(num_requests, self.rate, self.seed)
        if self.mode == "burst":
            return [0.0] * num_requests
        raise ValueError(f"arrival mode {self.mode!r} is closed loop: it has no schedule")

    def describe(self) -> str:
        if self.mode == "concurrent":
            return f"concurrent({self.concurrency})"
        text = f"{self.mode} {self.rate:g} req/s" if self.mode in ("constant", "poisson") else self.mode
        return text + (f", cap {self.max_concurrency}" if self.max_concurrency else "")

    @classmethod
    def parse(cls, spec: str, seed: int = 0) -> Arrivals:
        """From a short string: 'synchronous', 'concurrent:8', 'constant:4', 'poisson:6', 'burst'."""
        mode, _, arg = spec.partition(":")
        if mode == "concurrent":
            return cls(mode, concurrency=int(arg or 1), seed=seed)
        if mode in ("constant", "poisson"):
            if not arg:
                raise ValueError(f"arrival {spec!r} needs a rate, e.g. '{mode}:4'")
            return cls(mode, rate=float(arg), seed=seed)
        return cls(mode, seed=seed)
