"""Serving metrics as pure functions of per-request timestamps: no I/O, no clock, no server.

Every time is in seconds on one monotonic clock, relative to the start of the run. One request's life:

    intended_send ──► sent ──► first_token ──► chunk ... chunk ──► end
    |<- dispatch ->|
    |<------ ttft ------------>|
    |<------------------------ latency -------------------------->|

Latencies are measured from `intended_send`, the time the arrival process wanted the request to leave. When
the client falls behind (a concurrency cap, a slow event loop), measuring from `sent` would hide the time a
user already waited: that is coordinated omission. The dispatch delay (intended -> actual send) is reported
on its own, so a slow load generator shows up as itself and not as a fast server.

Token counts come from the server's `usage`, never from counting stream chunks (one chunk may hold several
tokens, or none).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

STATUSES = ("ok", "error", "timeout", "aborted")
PERCENTILES = (50, 95, 99)


@dataclass
class RequestRecord:
    """What the client saw of one request. Times are None when the event never happened."""

    req_id: int
    intended_send: float
    sent: float | None = None
    first_token: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # every chunk that carried text
    end: float | None = None
    status: str = "ok"  # one of STATUSES
    http_status: int | None = None
    error: str | None = None
    num_prompt_tokens: int | None = None  # from usage
    num_completion_tokens: int | None = None  # from usage
    num_cached_tokens: int | None = None  # from usage.prompt_tokens_details, when the server says
    req_class: str = "default"
    target_prompt_tokens: int | None = None  # what the workload asked for (approximate)
    max_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict:
        return asdict(self)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default).

    None for an empty sequence, so a table can print "-" rather than a made-up number."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: Sequence[float], qs: Iterable[float] = PERCENTILES) -> dict:
    """{count, mean, min, max, p50, p95, p99} of `values` (None entries when empty)."""
    values = list(values)
    out = {"count": len(values), "mean": sum(values) / len(values) if values else None}
    out["min"] = min(values) if values else None
    out["max"] = max(values) if values else None
    for q in qs:
        out[f"p{q:g}"] = percentile(values, q)
    return out


# ---- one request ------------------------------------------------------------------------------------


def dispatch_delay(rec: RequestRecord) -> float | None:
    """Intended -> actual send: how far the load generator fell behind its schedule."""
    return None if rec.sent is None else rec.sent - rec.intended_send


def ttft(rec: RequestRecord, from_intended: bool = True) -> float | None:
    """Time to first token, from the intended send time (default) or from the actual send."""
    if rec.first_token is None:
        return None
    start = rec.intended_send if from_intended else rec.sent
    return None if start is None else rec.first_token - start


def latency(rec: RequestRecord, from_intended: bool = True) -> float | None:
    """End-to-end latency, from the intended send time (default) or from the actual send."""
    if rec.end is None:
        return None
    start = rec.intended_send if from_intended else rec.sent
    return None if start is None else rec.end - start


def itls(rec: RequestRecord) -> list[float]:
    """Inter-token latencies as the client saw them: gaps between consecutive text chunks."""
    ts = rec.chunk_times
    return [b - a for a, b in zip(ts, ts[1:], strict=False)]


def tpot(rec: RequestRecord) -> float | None:
    """Time per output token after the first: (end - first_token) / (completion_tokens - 1), from usage."""
    n = rec.num_completion_tokens
    if rec.first_token is None or rec.end is None or n is None or n < 2:
        return None
    return (rec.end - rec.first_token) / (n - 1)


# ---- SLOs and goodput --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SLO:
    """A request class's service-level objective; a None bound is not checked. Seconds."""

    ttft: float | None = None
    itl_p95: float | None = None
    e2e: float | None = None

    def __post_init__(self):
        for name in ("ttft", "itl_p95", "e2e"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"SLO {name} must be > 0 seconds, got {v}")

    @classmethod
    def from_ms(cls, d: dict) -> SLO:
        """From a config block such as {ttft_ms: 500, itl_p95_ms: 100, e2e_ms: 10000}."""
        known = {"ttft_ms", "itl_p95_ms", "e2e_ms"}
        if unknown := set(d) - known:
            raise ValueError(f"unknown SLO keys {sorted(unknown)}; expected some of {sorted(known)}")
        return cls(**{k[:-3]: v / 1000 for k, v in d.items() if v is not None})


def meets_slo(rec: RequestRecord, slo: SLO) -> bool:
    """A request meets its SLO when it succeeded and every bound holds (times from intended send)."""
    if not rec.ok:
        return False
    if slo.ttft is not None and not ((t := ttft(rec)) is not None and t <= slo.ttft):
        return False
    if slo.itl_p95 is not None:
        gaps = itls(rec)
        if gaps and percentile(gaps, 95) > slo.itl_p95:
            return False
    return slo.e2e is None or ((t := latency(rec)) is not None and t <= slo.e2e)


def run_duration(records: Sequence[RequestRecord]) -> float:
    """First intended send -> last end (0 when nothing ended)."""
    ends = [r.end for r in records if r.end is not None]
    if not ends:
        return 0.0
    return max(ends) - min(r.intended_send for r in records)


def throughput(records: Sequence[RequestRecord], duration: float | None = None) -> dict:
    """Requests and tokens per second over the run, counting successful requests; tokens from usage."""
    duration = run_duration(records) if duration is None else duration
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.num_completion_tokens or 0 for r in ok)
    in_tokens = sum(r.num_prompt_tokens or 0 for r in ok)
    rate = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    return {
        "duration_s": duration,
        "requests_per_s": rate(len(ok)),
        "output_tokens_per_s": rate(out_tokens),
        "total_tokens_per_s": rate(in_tokens + out_tokens),
        "num_output_tokens": out_tokens,
        "num_prompt_tokens": in_tokens,
    }


def goodput(records: Sequence[RequestRecord], slos: dict[str, SLO], duration: float | None = None) -> dict:
    """Requests and output tokens per second that met their class's SLO, and compliance per class.

    A class without an SLO counts every successful request as good. Compliance is good / all requests of
    the class (failures included: a dropped request did not meet its objective)."""
    duration = run_duration(records) if duration is None else duration
    per_class: dict[str, dict] = {}
    good_reqs = good_tokens = 0
    for name in sorted({r.req_class for r in records}):
        recs = [r for r in records if r.req_class == name]
        slo = slos.get(name, SLO())
        good = [r for r in recs if meets_slo(r, slo)]
        good_reqs += len(good)
        good_tokens += sum(r.num_completion_tokens or 0 for r in good)
        per_class[name] = {
            "num_requests": len(recs),
            "num_good": len(good),
            "compliance": len(good) / len(recs),
        }
    rate = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    return {
        "goodput_requests_per_s": rate(good_reqs),
        "goodput_tokens_per_s": rate(good_tokens),
        "num_good": good_reqs,
        "per_class": per_class,
    }


# ---- stable window -----------------------------------------------------------------------------------


@dataclass
class Window:
    """The stable middle of a run: requests whose intended send lies in [start, end]."""

    records: list[RequestRecord]
    start: float
    end: float
    num_dropped_warmup: int
    num_dropped_cooldown: int

    def to_dict(self) -> dict:
        return {
            "start_s": self.start,
            "end_s": self.end,
            "num_kept": len(self.records),
            "num_dropped_warmup": self.num_dropped_warmup,
            "num_dropped_cooldown": self.num_dropped_cooldown,
        }


def stable_window(records: Sequence[RequestRecord], warmup_s: float = 0.0, cooldown_s: float = 0.0) -> Window:
    """Drop requests intended to start in the first `warmup_s` or the last `cooldown_s` of the arrival span.

    The span runs from the first to the last intended send: start-up (empty batches, cold caches) and
    draining (a shrinking batch) both distort what a steady load would see."""
    if warmup_s < 0 or cooldown_s < 0:
        raise ValueError("warm-up and cool-down must be >= 0 seconds")
    if not records:
        return Window([], 0.0, 0.0, 0, 0)
    first = min(r.intended_send for r in records)
    last = max(r.intended_send for r in records)
    start, end = first + warmup_s, last - cooldown_s
    kept = [r for r in records if start <= r.intended_send <= end]
    early = sum(r.intended_send < start for r in records)
    return Window(kept, start, end, early, len(records) - len(kept) - early)


# ---- a whole run -------------------------------------------------------------------------------------


def _ms(d: dict) -> dict:
    return {k: (v * 1000 if v is not None and k != "count" else v) for k, v in d.items()}


def summarize(records: Sequence[RequestRecord], duration: float | None = None) -> dict:
    """The per-run summary: counts by status, throughput, and TTFT / ITL / TPOT / latency / dispatch
    distributions (in ms) over successful requests; TTFT and latency from the intended send time."""
    ok = [r for r in records if r.ok]
    counts = {s: sum(r.status == s for r in records) for s in STATUSES}
    reported = [r for r in ok if r.num_cached_tokens is not None and r.num_prompt_tokens]
    cached = sum(r.num_cached_tokens for r in reported)
    return {
        "num_requests": len(records),
        "num_ok": counts["ok"],
        "num_errors": len(records) - counts["ok"],
        "status_counts": counts,
        "throughput": throughput(records, duration),
        "ttft_ms": _ms(distribution([ttft(r) for r in ok if ttft(r) is not None])),
        "ttft_from_send_ms": _ms(distribution([t for r in ok if (t := ttft(r, False)) is not None])),
        "itl_ms": _ms(distribution([g for r in ok for g in itls(r)])),
        "tpot_ms": _ms(distribution([t for r in ok if (t := tpot(r)) is not None])),
        "latency_ms": _ms(distribution([t for r in ok if (t := latency(r)) is not None])),
        "prefix_cache_hit_rate": cached / sum(r.num_prompt_tokens for r in reported) if reported else None,
        "dispatch_delay_ms": _ms(distribution([d for r in records if (d := dispatch_delay(r)) is not None])),
    }
