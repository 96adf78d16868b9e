"""The stress test's fairness phase: does one client's expensive requests slow everyone else's stream?

A bystander (a streamed greedy completion) runs alone, then beside one heavy client per kind, which keeps
--fairness-concurrency requests of that kind in flight, each at the server's allowed maximum, until the
bystander is done:

  prompt_logprobs    a prompt of half the context with prompt_logprobs 20 (an LM-head row and a top-20
                     per prompt token, and megabytes of JSON)
  long_prompt        the same prompt without them (a long prefill)
  grammars           a distinct JSON schema per request (a compilation each)
  compilations       the same, 100 in flight: a client flooding distinct grammars, which the server
                     compiles a few at a time and refuses past its queue (429); the bound
                     here is 3/4 of --fairness-bound (1.5x)
  logit_bias         a logit_bias over 1,024 tokens
  n                  n continuations of one prompt: 128, or the server's max_num_seqs if fewer
  stop_lists         128 stop strings of 512 characters
  tools              a chat request with 128 tools and tool_choice "required"

The bystander and the heavy client are two clients: a server launched for the fairness phase alone gets
two API keys, one each (a server with several keys shares its batch between clients, not requests);
against a running server, --heavy-api-key gives the heavy client its own. The heavy client runs in a
process of its own at niceness HEAVY_NICENESS: a hundred requests in flight keep a Python client busy
for more than half a core, which on the server's own machine takes cores from the server's step (and
the bystander's event loop from its stream) where a client elsewhere would not.

The verdict: the bystander's time to first token and inter-token p99 stay within --fairness-bound (2x)
of alone for every kind (1.5x beside the compilations). One run is one sample of a first token (it
lands anywhere in a step of the heavy client's) and of a p99 (the second-largest of 199 gaps): with
--fairness-repeat N, the bystander runs N times one after another alone, and N times beside each kind's
heavy client, and the medians are compared.
The heavy client's refusals (429) are counted, not failures: admission control doing its job.
docs/robustness.md has the table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import multiprocessing
import os
import statistics
import string
import time

import httpx

KINDS = (
    "prompt_logprobs", "long_prompt", "grammars", "compilations", "logit_bias", "n", "stop_lists", "tools"
)  # fmt: skip
# the kinds whose requests in flight are their own (not --fairness-concurrency), and their bound as a
# fraction of --fairness-bound (1.5x of the default 2x)
FLOODS = {"compilations": (100, 0.75)}
WORDS = "The quick brown fox jumps over the lazy dog. "
HEAVY_NICENESS = 19  # the heavy client's process (module docstring)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def bystander(http: httpx.AsyncClient, model: str, max_tokens: int) -> dict:
    """One streamed greedy completion: its TTFT and inter-token gaps, in ms."""
    body = {"model": model, "prompt": "In the beginning", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    start, times = time.perf_counter(), []
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter() - start)
    gaps = [1000 * (b - a) for a, b in zip(times, times[1:], strict=False)]
    return {"ttft_ms": 1000 * times[0], "itl_p99_ms": _percentile(gaps, 0.99), "total_ms": 1000 * times[-1]}


def heavy_request(kind: str, model: str, i: int, max_model_len: int, max_n: int = 128) -> tuple[str, dict]:
    """The route and body of the i-th request of a kind, at what the server allows."""
    half = max(16, max_model_len // 2)
    # ~4 characters a token, trimmed by the server (from the left); each sentence begins with the
    # request's own tag, so that no prefix cache serves it
    tag = "".join(string.ascii_lowercase[i // 26**k % 26] for k in range(5))
    long_prompt = ((tag + " " + WORDS) * (half // 11 + 1))[: half * 4]
    base = {"model": model, "temperature": 0}
    if kind in ("prompt_logprobs", "long_prompt"):
        extra = {"prompt_logprobs": 20} if kind == "prompt_logprobs" else {}
        return "/v1/completions", {**base, "prompt": long_prompt, "max_tokens": 1,
                                    "truncate_prompt_tokens": half, **extra}  # fmt: skip
    if kind in ("grammars", "compilations"):
        props = {f"{kind}_{i}_{k}": {"type": "string", "maxLength": 8} for k in range(40)}  # none cached
        schema = {"type": "object", "properties": props, "required": list(props)[:2]}
        return "/v1/completions", {**base, "prompt": "{", "max_tokens": 8,
                                    "structured_outputs": {"json": schema}}  # fmt: skip
    if kind == "logit_bias":
        bias = {str(t): 1.0 for t in range(100, 1124)}
        return "/v1/completions", {**base, "prompt": "Once", "max_tokens": 32, "logit_bias": bias}
    if kind == "n":
        return "/v1/completions", {**base, "prompt": "Once", "max_tokens": 8, "n": max_n, "temperature": 1.0}
    if kind == "stop_lists":
        stops = [f"{k:03d}" + "z" * 509 for k in range(128)]
        return "/v1/completions", {**base, "prompt": "Once", "max_tokens": 32, "stop": stops}
    if kind == "tools":
        tools = [{"type": "function", "function": {"name": f"tool_{k}", "description": "a tool " * 8,
                  "parameters": {"type": "object", "properties": {"x": {"type": "string", "maxLength": 8}}}}}
                 for k in range(128)]  # fmt: skip
        messages = [{"role": "user", "content": "Call a tool."}]
        body = {**base, "messages": messages, "tools": tools, "tool_choice": "required", "max_tokens": 32}
        return "/v1/chat/completions", body
    raise ValueError(f"unknown fairness kind {kind!r}")


async def heavy_client(
    http, kind: str, model: str, concurrency: int, bounds: tuple[int, int], stop, headers: dict
):
    """Keep `concurrency` requests of a kind in flight until `stop`; the statuses seen. A refused one
    waits as Retry-After says (1 s without it): a flood of refusals measures another thing. headers: its
    key, its own where the server has several."""
    statuses: dict[str, int] = {}
    counter = itertools.count(1000 * time.time_ns())  # distinct from every earlier run's requests

    async def worker() -> None:
        while not stop.is_set():
            route, body = heavy_request(kind, model, next(counter), *bounds)
            try:
                resp = await http.post(route, json=body, headers=headers)
                key = str(resp.status_code)
                if resp.status_code >= 400:
                    await asyncio.sleep(float(resp.headers.get("retry-after", 1)))
            except httpx.HTTPError as exc:
                key = type(exc).__name__
            statuses[key] = statuses.get(key, 0) + 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return statuses


def _yield_cpu() -> None:
    """This process HEAVY_NICENESS lower. Where the kernel groups processes by session (autogroup:
    /proc/sys/kernel/sched_autogroup_enabled), a niceness weighs only within the group, and a server in
    a session of its own would share the cores with this one's group half and half: so a session of its
    own, whose group gets the niceness too."""
    with contextlib.suppress(OSError):
        os.setsid()
        with open("/proc/self/autogroup", "w") as group:
            group.write(str(HEAVY_NICENESS))
    with contextlib.suppress(OSError):
        os.nice(HEAVY_NICENESS)


def _heavy_process(url: str, timeout: float, heavy: tuple, started, stop, results) -> None:
    """The heavy client's process: heavy_client with heavy's (kind, model, concurrency, bounds, headers)
    until `stop` is set; its statuses to `results`.
    `started` is set once its first requests are on their way."""
    _yield_cpu()

    async def main() -> dict:
        done = asyncio.Event()

        async def watch() -> None:
            await asyncio.sleep(0.05)  # its workers have sent their first requests
            started.set()
            while not stop.is_set():
                await asyncio.sleep(0.02)
            done.set()

        kind, model, concurrency, bounds, headers = heavy
        pool = httpx.Limits(max_connections=concurrency + 8)
        async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=pool) as http:
            watcher = asyncio.ensure_future(watch())
            statuses = await heavy_client(http, kind, model, concurrency, bounds, done, headers)
            await watcher
        return statuses

    results.put(asyncio.run(main()))


async def _beside(http, url, context, args, kind, model, concurrency, bounds, heavy_headers, repeat):
    """`repeat` bystander runs one after another beside a heavy client of `kind` in its own process:
    (their figures, the heavy client's statuses)."""
    begun, stop, results = context.Event(), context.Event(), context.Queue()
    heavy = (kind, model, concurrency, bounds, heavy_headers)
    process = context.Process(
        target=_heavy_process, args=(url, args.timeout, heavy, begun, stop, results), daemon=True
    )
    process.start()
    if not await asyncio.to_thread(begun.wait, args.timeout):
        process.kill()
        raise RuntimeError(f"fairness: the heavy client of {kind} did not start")
    await asyncio.sleep(args.fairness_lead)  # the heavy requests are in the engine first
    beside = [await bystander(http, model, args.fairness_tokens) for _ in range(repeat)]
    stop.set()
    statuses = await asyncio.to_thread(results.get, True, args.timeout + 60)
    await asyncio.to_thread(process.join, 10)
    return beside, statuses


async def run_fairness(
    url: str, model: str, args: argparse.Namespace, max_model_len: int | None, max_num_seqs: int | None
) -> dict:
    bounds = (max_model_len or 2048, min(128, max_num_seqs or 128))
    kinds = [k for k in args.fairness_kinds.split(",") if k] or list(KINDS)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    heavy_key = args.heavy_api_key or args.api_key
    heavy_headers = {"Authorization": f"Bearer {heavy_key}"} if heavy_key else {}
    repeat = max(1, args.fairness_repeat)
    context = multiprocessing.get_context("spawn")  # no copy of this process's event loop and threads
    started = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=args.timeout) as http:
        await bystander(http, model, 4)  # warm
        alone = [await bystander(http, model, args.fairness_tokens) for _ in range(max(2, repeat))]
        base = {key: statistics.median(run[key] for run in alone) for key in alone[0]}
        rows, problems, num_requests = {}, [], len(alone)
        for kind in kinds:
            concurrency, share = FLOODS.get(kind, (args.fairness_concurrency, 1.0))
            bound = share * args.fairness_bound
            runs, statuses = await _beside(http, url, context, args, kind, model, concurrency, bounds,
                                           heavy_headers, repeat)  # fmt: skip
            num_requests += len(runs) + sum(statuses.values())
            beside = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
            ratios = {k: beside[k] / base[k] for k in ("ttft_ms", "itl_p99_ms", "total_ms") if base[k]}
            rows[kind] = {"beside": beside, "runs": runs, "ratios": ratios, "heavy_statuses": statuses,
                          "bound": bound}  # fmt: skip
            bad = [k for k in ("ttft_ms", "itl_p99_ms") if ratios.get(k, 0) > bound]
            if bad:
                problems.append(f"{kind}: " + ", ".join(f"{k} {ratios[k]:.1f}x" for k in bad))
            if any(not s.isdigit() or s.startswith("5") for s in statuses):
                problems.append(f"{kind}: the heavy client saw {json.dumps(statuses)}")
    counts = {"bystander runs": len(alone) + len(kinds) * repeat}
    own_key = "its own" if args.heavy_api_key and args.heavy_api_key != args.api_key else "the bystander's"
    return {"num_requests": num_requests, "duration_s": time.perf_counter() - started, "counts": counts,
            "alone": base, "alone_runs": alone, "kinds": rows, "bound": args.fairness_bound,
            "problems": problems, "heavy_client_key": own_key}  # fmt: skip
