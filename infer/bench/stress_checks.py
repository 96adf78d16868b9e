"""The judgements of `infer bench stress`, as pure functions: outcomes of single requests, slopes of
sampled series, verdicts of the phases, and the abort plans. No I/O, no clock (tested on synthetic data)."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import httpx

from infer.bench.metrics import RequestRecord

ABORT_KINDS = ("before_first_byte", "mid_prefill", "mid_decode", "non_streamed")


def fit_slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of y over t (units of y per unit of t); None for fewer than 2 distinct times."""
    if len(points) < 2:
        return None
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var_t = sum((t - mean_t) ** 2 for t, _ in points)
    if var_t == 0:
        return None
    return sum((t - mean_t) * (y - mean_y) for t, y in points) / var_t


def per_hour(samples: list[dict], key: str, second_half: bool = True) -> float | None:
    """The slope of samples[key] over samples["t"] (seconds), per hour; over the second half by default."""
    chosen = samples[len(samples) // 2 :] if second_half else samples
    slope = fit_slope([(s["t"], s[key]) for s in chosen if s.get(key) is not None])
    return None if slope is None else slope * 3600


def classify(rec: RequestRecord, max_tokens: int) -> str:
    """One streamed request of the overload or the soak: ok (complete, usage exact), refused (429/503 with a
    message), rejected (another 4xx), server_error (5xx), wrong (complete but usage off), lost (no answer:
    a timeout, a dropped connection, a stream cut short or failing inside a 200)."""
    status = rec.http_status
    if rec.ok:
        return "ok" if rec.num_completion_tokens == max_tokens else "wrong"
    if status in (429, 503):
        return "refused" if rec.error else "lost"
    if status is not None and status >= 500:
        return "server_error"
    if status is not None and 400 <= status < 500:
        return "rejected"
    return "lost"


def idle_problems(idle: dict) -> list[str]:
    """What keeps a server from being idle: requests running or waiting, KV blocks held, /health not 200."""
    problems = []
    for key in ("running", "waiting"):
        if idle.get(key) != 0:
            problems.append(f"{idle.get(key)} requests {key} at the end")
    if idle.get("kv_usage") != 0:
        problems.append(f"KV cache usage {idle.get('kv_usage')} at the end (blocks still held)")
    if idle.get("health") != 200:
        problems.append(f"/health answered {idle.get('health')}")
    return problems


def abort_verdict(counts: Counter, idle: dict, served_after: bool) -> list[str]:
    problems = idle_problems(idle)
    for key in ("server_error", "lost", "rejected"):
        if counts[key]:
            problems.append(f"{counts[key]} {key.replace('_', ' ')}")
    if not served_after:
        problems.append("a plain request was not served afterwards")
    return problems


def overload_verdict(counts: Counter) -> list[str]:
    problems = [f"{counts[k]} {k.replace('_', ' ')}" for k in ("lost", "server_error", "wrong", "rejected")
                if counts[k]]  # fmt: skip
    if not counts["ok"]:
        problems.append("no request was admitted")
    if not counts["refused"]:
        problems.append("nothing was refused: the load never passed the admission bound")
    return problems


@dataclass(frozen=True)
class LeakLimits:
    rss_mib_per_hour: float = 64.0  # RSS growth over the second half of the soak
    fd_growth: int = 4  # open descriptors at idle, after the soak minus before
    min_judge_seconds: float = 300.0  # shorter runs report slopes but judge no leak


def soak_verdict(counts: Counter, idle: dict, leak: dict, duration: float, limits: LeakLimits) -> list[str]:
    problems = idle_problems(idle)
    if errors := sum(counts[k] for k in ("server_error", "lost", "wrong", "unexpected")):
        problems.append(f"{errors} errors")
    if duration < limits.min_judge_seconds:
        return problems
    rss = leak.get("rss_mib_per_hour")
    if rss is not None and rss > limits.rss_mib_per_hour:
        problems.append(f"RSS grows {rss:.1f} MiB/hour (limit {limits.rss_mib_per_hour:g})")
    fds = leak.get("fd_growth")
    if fds is not None and fds > limits.fd_growth:
        problems.append(f"{fds} more open descriptors at idle than before (limit {limits.fd_growth})")
    return problems


@dataclass(frozen=True)
class AbortPlan:
    kind: str  # one of ABORT_KINDS
    delay: float = 0.0  # before_first_byte / non_streamed: seconds before the client leaves
    num_chunks: int = 0  # mid_decode: chunks read before leaving


def plan_aborts(num: int, seed: int) -> list[AbortPlan]:
    """`num` abort plans, the kinds in turn (so every kind is represented), the points drawn at random."""
    rng = random.Random(seed)
    plans = []
    for i in range(num):
        kind = ABORT_KINDS[i % len(ABORT_KINDS)]
        if kind == "before_first_byte":
            plans.append(AbortPlan(kind, delay=rng.uniform(0.0, 0.005)))
        elif kind == "non_streamed":
            plans.append(AbortPlan(kind, delay=rng.uniform(0.01, 0.3)))
        elif kind == "mid_decode":
            plans.append(AbortPlan(kind, num_chunks=rng.randint(1, 8)))
        else:
            plans.append(AbortPlan(kind))
    return plans


def abort_outcome(seen: dict) -> str:
    """refused / server_error / rejected / lost (no answer, or the connection failed before the client
    left), else where the client left: left_sent, left_headers, left_decode, left_finished."""
    status = seen["status"]
    if status in (429, 503):
        return "refused"
    if status is not None and status >= 500:
        return "server_error"
    if status is not None and status >= 400:
        return "rejected"
    if seen["error"] is not None:
        return "lost"
    return "left_" + seen["stage"]


def plain_outcome(resp: httpx.Response, max_tokens: int | None) -> str:
    """A non-streamed answer: ok (usage exact, or the 400 asked for when max_tokens is None), refused
    (429/503 with a message), wrong, server_error, unexpected (another status), lost (a refusal without a
    reason)."""
    try:
        body = resp.json()
    except ValueError:
        body = {}
    error = body.get("error") if isinstance(body, dict) else None
    has_reason = isinstance(error, dict) and bool(error.get("message"))
    if resp.status_code in (429, 503):
        return "refused" if has_reason else "lost"
    if max_tokens is None:  # a request meant to be refused as invalid
        return "ok" if resp.status_code == 400 and has_reason else "unexpected"
    if resp.status_code == 200:
        return "ok" if body.get("usage", {}).get("completion_tokens") == max_tokens else "wrong"
    return "server_error" if resp.status_code >= 500 else "unexpected"
