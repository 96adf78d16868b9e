"""The three phases of `infer bench stress` against a server: storms of aborts, an overload, a soak.

Each returns a dict for the report: what it sent, the outcomes counted (stress_checks), the server's state at
the end, and `problems` (empty when the phase passes)."""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections import Counter
from pathlib import Path

import httpx

from infer.bench.client import RequestSpec, StreamingClient
from infer.bench.metrics import RequestRecord, distribution, latency, ttft
from infer.bench.prompts import PromptFactory
from infer.bench.stress_checks import (
    ABORT_KINDS,
    AbortPlan,
    LeakLimits,
    abort_outcome,
    abort_verdict,
    classify,
    overload_verdict,
    per_hour,
    plain_outcome,
    plan_aborts,
    soak_verdict,
)

SOAK_MIX = {"stream": 35, "json": 20, "chat": 20, "abort": 15, "invalid": 10}  # weights
MIB = 2**20
CMPL = "/v1/completions"


def _metric(text: str, name: str, **labels: str) -> float | None:
    """Sum of the samples of infer:NAME (or vllm:NAME) whose labels include `labels`; None when absent."""
    total, found = 0.0, False
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        base = head.split("{", 1)[0]
        if base not in (f"infer:{name}", f"vllm:{name}"):
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total, found = total + float(value), True
    return total if found else None


async def idle_state(http: httpx.AsyncClient, timeout: float) -> dict:
    """Poll /metrics until nothing runs, waits or holds a KV block (or `timeout`); then /health."""
    start = time.perf_counter()
    while True:
        text = (await http.get("/metrics")).text
        idle = {
            "running": _metric(text, "num_requests_running"),
            "waiting": _metric(text, "num_requests_waiting"),
            "kv_usage": _metric(text, "kv_cache_usage_perc"),
            "aborted_total": _metric(text, "request_success_total", finished_reason="abort"),
        }
        if idle["running"] == idle["waiting"] == idle["kv_usage"] == 0:
            break
        if time.perf_counter() - start > timeout:
            break
        await asyncio.sleep(0.1)
    idle["settle_s"] = time.perf_counter() - start
    idle["health"] = (await http.get("/health")).status_code
    return idle


def process_sample(pid: int) -> dict:
    """RSS (MiB) and open file descriptors of a process, from /proc; None values when it cannot be read."""
    rss = fds = None
    try:
        with open(f"/proc/{pid}/status") as f:
            line = next((ln for ln in f if ln.startswith("VmRSS:")), None)
        rss = int(line.split()[1]) * 1024 / MIB if line else None
        fds = len(list(Path(f"/proc/{pid}/fd").iterdir()))
    except OSError:
        pass
    return {"rss_mib": rss, "fds": fds}


async def leave_early(http: httpx.AsyncClient, body: dict, plan: AbortPlan, timeout: float) -> dict:
    """POST /v1/completions and walk away as `plan` says. The stage reached: "sent" (no status yet),
    "headers" (a status, no chunk), "decode" (chunks came), "finished" (the answer was complete first)."""
    seen = {"kind": plan.kind, "stage": "sent", "status": None, "num_chunks": 0, "error": None}

    async def go() -> None:
        async with http.stream("POST", CMPL, json=body) as resp:
            seen["status"], seen["stage"] = resp.status_code, "headers"
            if resp.status_code != 200:
                seen["error"] = (await resp.aread()).decode(errors="replace")[:300]
                return
            if plan.kind == "mid_prefill":
                return  # the engine accepted it; its first token is a prefill away
            async for line in resp.aiter_lines():
                if line == "data: [DONE]" or not body.get("stream"):
                    seen["stage"] = "finished"
                    return
                if line.startswith("data: {"):
                    seen["num_chunks"] += 1
                    seen["stage"] = "decode"
                    if seen["num_chunks"] >= plan.num_chunks > 0:
                        return

    task = asyncio.ensure_future(go())
    wait = plan.delay if plan.kind in ("before_first_byte", "non_streamed") else timeout
    done, _ = await asyncio.wait({task}, timeout=wait)
    if not done:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if plan.kind not in ("before_first_byte", "non_streamed"):
            seen["error"] = f"no answer within {timeout}s"
    elif task.exception() is not None:
        seen["error"] = f"{type(task.exception()).__name__}: {task.exception()}"
    return seen


async def _serves(http: httpx.AsyncClient, model: str) -> bool:
    body = {"model": model, "prompt": "In the beginning", "max_tokens": 4, "ignore_eos": True}
    try:
        return plain_outcome(await http.post(CMPL, json=body), 4) == "ok"
    except httpx.HTTPError:
        return False


def _lengths(max_model_len: int | None) -> tuple[int, int, int]:
    """(long prompt, short prompt, max_tokens) in tokens, within the model's context."""
    max_len = max_model_len or 1024
    return max(1, min(400, max_len // 3)), max(1, min(32, max_len // 8)), max(1, min(128, max_len // 4))


def _http(url: str, api_key: str | None, timeout: float, connections: int) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=connections + 4, max_keepalive_connections=connections + 4)
    return httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout, limits=limits)


async def run_aborts(url: str, model: str, args: argparse.Namespace, max_model_len: int | None) -> dict:
    long, short, max_tokens = _lengths(max_model_len)
    factory = PromptFactory(args.seed)
    plans = plan_aborts(args.aborts, args.seed)
    cap = asyncio.Semaphore(args.abort_concurrency)

    async def one(http: httpx.AsyncClient, plan: AbortPlan) -> dict:
        prompt = factory.text(long if plan.kind == "mid_prefill" else short)
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
        body["stream"] = plan.kind != "non_streamed"
        async with cap:
            return await leave_early(http, body, plan, args.timeout)

    async with _http(url, args.api_key, args.timeout, args.abort_concurrency) as http:
        before = _metric((await http.get("/metrics")).text, "request_success_total", finished_reason="abort")
        start = time.perf_counter()
        seen = await asyncio.gather(*(one(http, p) for p in plans))
        duration = time.perf_counter() - start
        idle = await idle_state(http, args.settle_timeout)
        served = await _serves(http, model)
    counts = Counter(abort_outcome(s) for s in seen)
    engine_aborts = (
        None if before is None or idle["aborted_total"] is None else idle["aborted_total"] - before
    )
    return {
        "num_requests": len(seen),
        "duration_s": duration,
        "counts": dict(counts),
        "by_kind": {k: dict(Counter(abort_outcome(s) for s in seen if s["kind"] == k)) for k in ABORT_KINDS},
        "engine_aborts": engine_aborts,  # requests the engine had taken when their client left
        "idle": idle,
        "served_after": served,
        "errors": [s for s in seen if abort_outcome(s) in ("server_error", "lost", "rejected")][:20],
        "problems": abort_verdict(counts, idle, served),
    }


async def run_overload(url: str, model: str, args: argparse.Namespace, bound: int, max_model_len) -> dict:
    _, short, longest = _lengths(max_model_len)
    max_tokens = min(args.overload_max_tokens, longest)
    factory = PromptFactory(args.seed + 1)
    num_workers = args.overload_factor * bound
    records: list[tuple[RequestRecord, str]] = []
    async with StreamingClient(url, model, args.api_key, args.timeout) as client:
        deadline = client.now() + args.overload_seconds

        async def worker() -> None:
            while client.now() < deadline:
                spec = RequestSpec(factory.text(short), max_tokens, "overload")
                rec = await client.send(len(records), spec, client.now())
                records.append((rec, outcome := classify(rec, max_tokens)))
                if outcome == "refused":
                    await asyncio.sleep(args.retry_pause)

        await asyncio.gather(*(worker() for _ in range(num_workers)))
        duration = client.now()
    counts = Counter(outcome for _, outcome in records)
    ok = [rec for rec, outcome in records if outcome == "ok"]
    ms = lambda xs: {
        k: (v * 1000 if k != "count" and v is not None else v) for k, v in distribution(xs).items()
    }
    return {
        "num_workers": num_workers,
        "admission_bound": bound,
        "num_requests": len(records),
        "duration_s": duration,
        "counts": dict(counts),
        "admitted_per_s": len(ok) / duration if duration else None,
        "ttft_ms": ms([t for r in ok if (t := ttft(r)) is not None]),
        "latency_ms": ms([t for r in ok if (t := latency(r)) is not None]),
        "refusals": sorted({rec.error for rec, outcome in records if outcome == "refused"})[:3],
        "errors": [rec.to_dict() for rec, outcome in records if outcome not in ("ok", "refused")][:20],
        "problems": overload_verdict(counts),
    }


async def run_soak(url: str, model: str, args: argparse.Namespace, pid: int | None, max_model_len) -> dict:
    rng, factory = random.Random(args.seed + 2), PromptFactory(args.seed + 2)
    long, short, max_tokens = _lengths(max_model_len)
    kinds, weights = list(SOAK_MIX), list(SOAK_MIX.values())
    by_kind = {k: Counter() for k in kinds}
    idle_before = process_sample(pid) if pid else None
    samples: list[dict] = []
    start = time.perf_counter()
    deadline = start + args.soak_seconds

    async def sampler() -> None:
        while pid:
            samples.append({"t": time.perf_counter() - start, **process_sample(pid)})
            left = deadline - time.perf_counter()
            if left <= 0:
                return
            await asyncio.sleep(min(args.sample_interval, left))

    async with StreamingClient(url, model, args.api_key, args.timeout) as client, \
            _http(url, args.api_key, args.timeout, args.soak_concurrency) as http:  # fmt: skip

        async def one(kind: str) -> str:
            prompt, num_tokens = factory.text(rng.randint(short, long)), rng.randint(1, max_tokens)
            body = {"model": model, "max_tokens": num_tokens, "ignore_eos": True}
            if kind == "stream":
                rec = await client.send(0, RequestSpec(prompt, num_tokens, "soak"), client.now())
                return classify(rec, num_tokens)
            if kind == "json":
                return plain_outcome(await http.post(CMPL, json=body | {"prompt": prompt}), num_tokens)
            if kind == "chat":
                chat = body | {"messages": [{"role": "user", "content": prompt}]}
                return plain_outcome(await http.post("/v1/chat/completions", json=chat), num_tokens)
            if kind == "invalid":  # beyond any context: a 400 with a message
                body = {"model": model, "prompt": prompt, "max_tokens": 10**9}
                return plain_outcome(await http.post(CMPL, json=body), None)
            plan = AbortPlan("mid_decode", num_chunks=rng.randint(1, 8))
            seen = await leave_early(http, body | {"prompt": prompt, "stream": True}, plan, args.timeout)
            outcome = abort_outcome(seen)
            return "ok" if outcome.startswith("left_") else outcome

        async def worker() -> None:
            while time.perf_counter() < deadline:
                kind = rng.choices(kinds, weights)[0]
                try:
                    outcome = await one(kind)
                except httpx.HTTPError:
                    outcome = "lost"
                by_kind[kind][outcome] += 1
                if outcome == "refused":
                    await asyncio.sleep(args.retry_pause)

        await asyncio.gather(sampler(), *(worker() for _ in range(args.soak_concurrency)))
        duration = time.perf_counter() - start
        idle = await idle_state(http, args.settle_timeout)
    await asyncio.sleep(1.0)  # for the server to close the clients' connections
    idle_after = process_sample(pid) if pid else None
    counts = sum(by_kind.values(), Counter())
    fds = [idle_before["fds"], idle_after["fds"]] if pid else [None, None]
    leak = {
        "rss_mib_per_hour": per_hour(samples, "rss_mib"),
        "rss_mib_per_hour_whole_run": per_hour(samples, "rss_mib", second_half=False),
        "fds_per_hour": per_hour(samples, "fds"),
        "rss_mib_first_last": [samples[0]["rss_mib"], samples[-1]["rss_mib"]] if samples else None,
        "fds_idle_before_after": fds if None not in fds else None,
        "fd_growth": fds[1] - fds[0] if None not in fds else None,
    }
    limits = LeakLimits(args.max_rss_growth, args.max_fd_growth, args.min_judge_seconds)
    note = None
    if not pid:
        note = "no --pid: RSS and descriptors not sampled"
    elif duration < limits.min_judge_seconds:
        note = f"leaks not judged: the run is shorter than {limits.min_judge_seconds:g} s"
    return {
        "duration_s": duration,
        "num_requests": sum(counts.values()),
        "counts": dict(counts),
        "by_kind": {k: dict(v) for k, v in by_kind.items()},
        "idle": idle,
        "leak": leak,
        "samples": samples,
        "note": note,
        "problems": soak_verdict(counts, idle, leak, duration, limits),
    }
