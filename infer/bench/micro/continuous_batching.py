"""Continuous batching: one request at a time vs all of them batched.

    single_request_sequential   max_num_seqs=1, each request added when the previous one finished
                                (so its TTFT and latency start when it is served, as in the reference)
    continuous_batching         every request arrives at step 0; max_num_seqs = the case's max_batch_size,
                                requests join and leave the running batch every step

Expectation: every case completes all its requests (the reference completed 5/8 to 9/32), and
throughput rises with the batch size.
"""

from __future__ import annotations

import torch

from infer.bench.micro.harness import (
    PROMPT_SEED,
    Context,
    RequestSpec,
    compare,
    drive,
    num_blocks_for,
    random_prompts,
    ratio,
)
from infer.bench.micro.report import BenchResult, CaseResult, Verdict, mode_table, render_table

NAME = "continuous-batching"
# name: (num_requests, prompt_len, max_new_tokens, max_batch_size), all arriving at step 0
CASES = {
    "small_smoke_test": (8, 8, 16, 4),
    "more_requests_small_batch": (16, 8, 24, 4),
    "more_requests_larger_batch": (16, 8, 24, 8),
    "longer_generations": (16, 8, 48, 8),
    "heavier_prompt": (16, 16, 32, 8),
    "stress_batch_capacity": (32, 8, 32, 8),
}
SMALL_CASES = {
    "small_smoke_test": (4, 8, 4, 2),
    "more_requests_small_batch": (6, 8, 4, 2),
    "more_requests_larger_batch": (6, 8, 4, 4),
    "longer_generations": (6, 8, 8, 4),
    "heavier_prompt": (6, 16, 4, 4),
    "stress_batch_capacity": (10, 8, 4, 4),
}
REFERENCE_SPEEDUP = {
    "small_smoke_test": 1.93,
    "more_requests_small_batch": 1.79,
    "more_requests_larger_batch": 3.53,
    "longer_generations": 3.61,
    "heavier_prompt": 1.77,
    "stress_batch_capacity": 2.72,
}
SWEEP = (32, 8, 32, (1, 2, 4, 8, 16))  # num_requests, prompt_len, max_new_tokens, batch sizes
SMALL_SWEEP = (8, 8, 4, (1, 2, 4))
COLUMNS = [
    ("reqs", "reqs", ""),
    ("done", "done", ""),
    ("tokens", "gen_tok", ""),
    ("wall_s", "wall_s", ".4f"),
    ("tok/s", "tok_s", ".2f"),
    ("avg_ttft_ms", "avg_ttft_ms", ".2f"),
    ("p95_ttft_ms", "p95_ttft_ms", ".2f"),
    ("avg_lat_ms", "avg_lat_ms", ".2f"),
    ("p95_lat_ms", "p95_lat_ms", ".2f"),
    ("avg_batch", "avg_batch", ".2f"),
    ("max_batch", "max_batch", ""),
    ("forward_s", "forward_s", ".4f"),
]


def workload(ctx: Context, num_requests: int, prompt_len: int, max_new_tokens: int) -> list[RequestSpec]:
    gen = torch.Generator().manual_seed(PROMPT_SEED)
    return [
        RequestSpec(p, max_new_tokens) for p in random_prompts(gen, num_requests, prompt_len, ctx.vocab_size)
    ]


def run_case(
    ctx: Context, name: str, num_requests: int, prompt_len: int, max_new: int, batch: int
) -> CaseResult:
    specs = workload(ctx, num_requests, prompt_len, max_new)
    knobs = {"num_requests": num_requests, "prompt_len": prompt_len, "max_new_tokens": max_new}
    knobs |= {"max_batch_size": batch, "arrival_gap": 0}
    blocks = num_blocks_for(specs, 16)
    best, _ = compare(
        ctx,
        {
            "single_request_sequential": lambda: drive(
                ctx.engine(max_num_seqs=1, num_kv_blocks=blocks), specs, True
            ),
            "continuous_batching": lambda: drive(ctx.engine(max_num_seqs=batch, num_kv_blocks=blocks), specs),
        },
    )
    seq, cont = best["single_request_sequential"], best["continuous_batching"]
    ratios = {
        "speedup": ratio(cont["tok_s"], seq["tok_s"]),
        "latency_ratio": ratio(cont["avg_lat_ms"], seq["avg_lat_ms"]),
        "ttft_ratio": ratio(cont["avg_ttft_ms"], seq["avg_ttft_ms"]),
    }
    ctx.print(f"\n=== {name} ===\n{knobs}")
    ctx.print(mode_table(best, COLUMNS))
    ctx.print(f"\nContinuous batching throughput speedup: {ratios['speedup']:.2f}x")
    ctx.print(f"Average latency ratio: {ratios['latency_ratio']:.2f}x")
    ctx.print(f"Average TTFT ratio: {ratios['ttft_ratio']:.2f}x")
    return CaseResult(name, knobs, best, ratios)


def summary(cases: list[CaseResult]) -> str:
    headers = ["case", "requests", "max_batch", "seq tok/s", "batched tok/s", "speedup", "avg lat ratio"]
    headers += ["avg ttft ratio", "seq completion", "batched completion"]
    rows = []
    for c in cases:
        seq, cont = c.modes["single_request_sequential"], c.modes["continuous_batching"]
        rows.append(
            [
                c.name,
                str(c.knobs["num_requests"]),
                str(c.knobs["max_batch_size"]),
                f"{seq['tok_s']:.2f}",
                f"{cont['tok_s']:.2f}",
                f"{c.ratios['speedup']:.2f}x",
                f"{c.ratios['latency_ratio']:.2f}x",
                f"{c.ratios['ttft_ratio']:.2f}x",
                f"{seq['done']}/{seq['reqs']}",
                f"{cont['done']}/{cont['reqs']}",
            ]
        )
    return render_table(headers, rows)


def verdicts(cases: list[CaseResult], sweep: list[CaseResult]) -> list[Verdict]:
    out = []
    for c in cases:
        seq, cont = c.modes["single_request_sequential"], c.modes["continuous_batching"]
        complete = seq["done"] == seq["reqs"] and cont["done"] == cont["reqs"]
        s = c.ratios["speedup"]
        text = (
            f"completion {cont['done']}/{cont['reqs']} batched, {seq['done']}/{seq['reqs']} sequential "
            f"(target N/N; reference: {_REFERENCE_COMPLETION[c.name]}); speedup {s:.2f}x (target > 1.00x; "
            f"reference: {REFERENCE_SPEEDUP[c.name]:.2f}x)"
        )
        out.append(Verdict(c.name, complete and s > 1.0, text))
    by_name = {c.name: c for c in cases}
    smaller, larger = by_name["more_requests_small_batch"], by_name["more_requests_larger_batch"]
    small = smaller.modes["continuous_batching"]["tok_s"]
    large = larger.modes["continuous_batching"]["tok_s"]
    rates = [c.modes["continuous_batching"]["tok_s"] for c in sweep]
    sizes = [c.knobs["max_batch_size"] for c in sweep]
    grows = rates[-1] > rates[0] and all(b >= 0.95 * a for a, b in zip(rates, rates[1:], strict=False))
    listing = ", ".join(f"{b}: {r:.0f}" for b, r in zip(sizes, rates, strict=True))
    out.append(
        Verdict(
            "throughput_rises_with_batch_size",
            large > small and grows,
            f"{larger.knobs['num_requests']} requests at batch {smaller.knobs['max_batch_size']} -> "
            f"{larger.knobs['max_batch_size']}: {small:.0f} -> {large:.0f} tok/s; sweep (batch: tok/s) "
            f"{listing} (target: the larger batch faster, and the sweep rises: last > first, no step down "
            "by more than 5%)",
        )
    )
    return out


_REFERENCE_COMPLETION = {
    "small_smoke_test": "5/8",
    "more_requests_small_batch": "5/16",
    "more_requests_larger_batch": "9/16",
    "longer_generations": "9/16",
    "heavier_prompt": "9/16",
    "stress_batch_capacity": "9/32",
}


def run(ctx: Context) -> BenchResult:
    small = ctx.scale == "small"
    ctx.print("\n##### Continuous batching: single_request_sequential vs continuous_batching #####")
    cases = [run_case(ctx, name, *knobs) for name, knobs in (SMALL_CASES if small else CASES).items()]
    num_requests, prompt_len, max_new, sizes = SMALL_SWEEP if small else SWEEP
    ctx.print("\n=== Batch size sweep ===")
    sweep = [run_case(ctx, f"max_batch_size={b}", num_requests, prompt_len, max_new, b) for b in sizes]
    ctx.print("\n=== Continuous batching summary ===")
    ctx.print(summary(cases))
    ctx.print()
    ctx.print(summary(sweep))
    return BenchResult(NAME, cases, verdicts(cases, sweep), {"sweep": [c.__dict__ for c in sweep]})
