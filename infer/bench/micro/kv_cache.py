"""KV cache: full recompute every step vs the paged KV cache, one request at a time.

    no_cache   use_kv_cache=False: each step runs the whole sequence so far through the model
    kv_cache   use_kv_cache=True: the prompt once, then one token per step against the cached keys/values

Expectation: the cache is faster in every case, and its advantage grows with the generated
length, so near_context_limit (8 + 56 = the toy's whole 64-token context) is not the weak case it was in
the reference (1.11x, its cache grew by torch.cat).
"""

from __future__ import annotations

import torch

from infer.bench.micro.harness import PROMPT_SEED, Context, RequestSpec, compare, drive, num_blocks_for, ratio
from infer.bench.micro.report import BenchResult, CaseResult, Verdict, mode_table, render_table

NAME = "kv-cache"
MODES = ("no_cache", "kv_cache")
# name: (prompt_len, generated tokens N); the reference's speedups for reference
CASES = {
    "small_smoke_test": (8, 16),
    "medium_generation": (16, 32),
    "longer_generation": (16, 48),
    "heavier_prompt": (32, 32),
    "near_context_limit": (8, 56),
}
SMALL_CASES = {
    "small_smoke_test": (8, 4),
    "medium_generation": (16, 6),
    "longer_generation": (16, 8),
    "heavier_prompt": (32, 6),
    "near_context_limit": (8, 56),
}
REFERENCE_SPEEDUP = {
    "small_smoke_test": 1.47,
    "medium_generation": 2.60,
    "longer_generation": 1.93,
    "heavier_prompt": 2.29,
    "near_context_limit": 1.11,
}
SWEEP_PROMPT_LEN = 8
SWEEP = (8, 16, 32, 48, 56)
SMALL_SWEEP = (8, 16)
REFERENCE_SWEEP_SPEEDUP = {8: 1.24, 16: 1.76, 32: 1.01, 48: 1.79, 56: 1.46}
COLUMNS = [
    ("tokens", "gen_tok", ""),
    ("wall_time_s", "wall_s", ".4f"),
    ("tokens_per_s", "tok_s", ".2f"),
    ("ttft_ms", "avg_ttft_ms", ".2f"),
]


def workload(ctx: Context, prompt_len: int, num_tokens: int) -> list[RequestSpec]:
    gen = torch.Generator().manual_seed(PROMPT_SEED)
    prompt = tuple(torch.randint(0, ctx.vocab_size, (prompt_len,), generator=gen).tolist())
    return [RequestSpec(prompt, num_tokens)]


def run_case(ctx: Context, name: str, prompt_len: int, num_tokens: int) -> CaseResult:
    specs = workload(ctx, prompt_len, num_tokens)
    knobs = {"prompt_len": prompt_len, "N": num_tokens}

    def mode(use_kv_cache: bool):
        return lambda: drive(
            ctx.engine(use_kv_cache=use_kv_cache, num_kv_blocks=num_blocks_for(specs, 16)), specs, serial=True
        )

    best, _ = compare(ctx, {"no_cache": mode(False), "kv_cache": mode(True)})
    base, kv = best["no_cache"], best["kv_cache"]
    ratios = {
        "speedup": ratio(kv["tok_s"], base["tok_s"]),
        "wall_time_reduction": 1 - ratio(kv["wall_s"], base["wall_s"]),
        "ttft_ratio": ratio(kv["avg_ttft_ms"], base["avg_ttft_ms"]),
    }
    ctx.print(f"\n=== {name} ===\n{knobs}")
    ctx.print(mode_table(best, COLUMNS))
    ctx.print(f"\nKV-cache throughput speedup: {ratios['speedup']:.2f}x")
    return CaseResult(name, knobs, best, ratios)


def summary_rows(cases: list[CaseResult], key: str) -> list[list[str]]:
    rows = []
    for c in cases:
        base, kv = c.modes["no_cache"], c.modes["kv_cache"]
        rows.append(
            [
                *(str(c.knobs[k]) for k in key),
                f"{base['tok_s']:.2f}",
                f"{kv['tok_s']:.2f}",
                f"{c.ratios['speedup']:.2f}x",
                f"{100 * c.ratios['wall_time_reduction']:.1f}%",
                f"{base['avg_ttft_ms']:.2f}",
                f"{kv['avg_ttft_ms']:.2f}",
                f"{c.ratios['ttft_ratio']:.2f}x",
            ]
        )
    return rows


RATIO_HEADERS = [
    "no_cache tok/s",
    "kv_cache tok/s",
    "speedup",
    "wall reduction",
    "no_cache ttft_ms",
    "kv_cache ttft_ms",
    "ttft ratio",
]


def verdicts(cases: list[CaseResult], sweep: list[CaseResult]) -> list[Verdict]:
    out = []
    weakest = min(cases, key=lambda c: c.ratios["speedup"])
    for c in cases:
        s = c.ratios["speedup"]
        text = (
            f"KV cache {s:.2f}x the no-cache tok/s (target > 1.00x; "
            f"reference: {REFERENCE_SPEEDUP[c.name]:.2f}x)"
        )
        passed = s > 1.0
        if c.name == "near_context_limit":
            passed = passed and c is not weakest
            text += f"; weakest case: {weakest.name} ({weakest.ratios['speedup']:.2f}x), target: not this one"
        out.append(Verdict(c.name, passed, text))
    speedups = [c.ratios["speedup"] for c in sweep]
    lengths = [c.knobs["N"] for c in sweep]
    grows = speedups[-1] > speedups[0] and all(
        b >= 0.95 * a for a, b in zip(speedups, speedups[1:], strict=False)
    )
    faster = all(s > 1.0 for s in speedups)
    listing = ", ".join(f"N={n}: {s:.2f}x" for n, s in zip(lengths, speedups, strict=True))
    out.append(
        Verdict(
            "generation_length_sweep",
            grows and faster,
            f"{listing} (target: every N > 1.00x, and the speedup grows with N: last > first, no step down "
            "by more than 5%)",
        )
    )
    return out


def run(ctx: Context) -> BenchResult:
    small = ctx.scale == "small"
    ctx.print("\n##### KV cache: no_cache (full recompute) vs kv_cache #####")
    cases = [run_case(ctx, name, p, n) for name, (p, n) in (SMALL_CASES if small else CASES).items()]
    ctx.print("\n=== Generation length sweep ===")
    sweep = [run_case(ctx, f"N={n}", SWEEP_PROMPT_LEN, n) for n in (SMALL_SWEEP if small else SWEEP)]
    ctx.print("\n=== KV cache summary ===")
    ctx.print(render_table(["case", "prompt_len", "N", *RATIO_HEADERS], _named(cases, ("prompt_len", "N"))))
    ctx.print()
    ctx.print(render_table(["N", *RATIO_HEADERS], summary_rows(sweep, ("N",))))
    result = verdicts(cases, sweep)
    return BenchResult(NAME, cases, result, {"sweep": [c.__dict__ for c in sweep]})


def _named(cases: list[CaseResult], key: tuple[str, ...]) -> list[list[str]]:
    return [[c.name, *row] for c, row in zip(cases, summary_rows(cases, key), strict=True)]
