"""Prefix caching: every prompt prefilled in full vs reusing cached prefix blocks.

    no_prefix_cache   enable_prefix_caching=False
    prefix_cache      enable_prefix_caching=True: full blocks are hashed (chained) and reused

block_size = the reference's prefix_block_size, num_kv_blocks = its max_cache_blocks (the whole KV pool, so
eviction_pressure's 8 blocks cannot keep 6 groups' prefixes). Requests run one after another, as in
the reference. hit_rate counts block lookups as the reference does: a request looks up its full prompt
blocks in order until the first miss.

Expectation: prefill savings equal to the reference's (112, 552 and 320 cached tokens), wall-clock
throughput and TTFT better with the cache wherever it hits (reference: 0.94x and 2.4-3.5x worse), and
throughput no worse than 0.98x where it cannot hit (low_reuse_control, eviction_pressure).
"""

from __future__ import annotations

import torch

from infer.bench.micro.harness import PROMPT_SEED, Context, RequestSpec, Run, compare, drive, ratio
from infer.bench.micro.report import BenchResult, CaseResult, Verdict, mode_table, render_table

NAME = "prefix-caching"
KNOBS = (
    "workload_name",
    "num_requests",
    "shared_prefix_len",
    "unique_suffix_len",
    "max_new_tokens",
    "num_groups",
    "prefix_block_size",
    "max_cache_blocks",
)
# low_reuse: shared_prefix_len = 0 and unique_suffix_len = the reference's prompt_len
CASES = {
    "shared_prefix_basic": ("shared_prefix", 8, 16, 8, 6, 1, 4, 64),
    "high_reuse_many_requests": ("shared_prefix", 24, 24, 4, 4, 1, 4, 64),
    "multi_prefix_groups": ("shared_prefix", 24, 16, 8, 4, 4, 4, 64),
    "low_reuse_control": ("low_reuse", 8, 0, 24, 6, 1, 4, 64),
    "eviction_pressure": ("shared_prefix", 24, 16, 8, 4, 6, 4, 8),
}
SMALL_CASES = {
    "shared_prefix_basic": ("shared_prefix", 4, 8, 4, 2, 1, 4, 64),
    "high_reuse_many_requests": ("shared_prefix", 6, 12, 4, 2, 1, 4, 64),
    "multi_prefix_groups": ("shared_prefix", 6, 8, 4, 2, 2, 4, 64),
    "low_reuse_control": ("low_reuse", 4, 0, 12, 2, 1, 4, 64),
    "eviction_pressure": ("shared_prefix", 6, 8, 4, 2, 3, 4, 5),
}
# reference: (cached tokens, throughput ratio, TTFT ratio)
REFERENCE = {
    "shared_prefix_basic": (112, 0.95, 2.85),
    "high_reuse_many_requests": (552, 0.94, 3.49),
    "multi_prefix_groups": (320, 0.94, 2.39),
    "low_reuse_control": (0, 0.88, 0.97),
    "eviction_pressure": (0, 0.85, 0.98),
}
NO_HIT_MIN_THROUGHPUT_RATIO = 0.98
COLUMNS = [
    ("reqs", "reqs", ""),
    ("prompt_tok", "prompt_tok", ""),
    ("actual_prefill", "prefill_computed", ""),
    ("cached_tok", "cached_tok", ""),
    ("gen_tok", "gen_tok", ""),
    ("wall_s", "wall_s", ".4f"),
    ("gen_tok/s", "tok_s", ".2f"),
    ("prefill_tok/s", "prefill_tok_s", ".2f"),
    ("avg_ttft_ms", "avg_ttft_ms", ".2f"),
    ("p95_ttft_ms", "p95_ttft_ms", ".2f"),
    ("avg_lat_ms", "avg_lat_ms", ".2f"),
    ("hit_rate", "hit_rate", "%"),
    ("blocks", "blocks", ""),
    ("evict", "evictions", ""),
    ("forward_s", "forward_s", ".4f"),
]


def workload(knobs: dict, vocab_size: int) -> list[RequestSpec]:
    """The reference's workloads: group i % num_groups prefix + a unique suffix, or unique prompts."""
    gen = torch.Generator().manual_seed(PROMPT_SEED)
    k = knobs

    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab_size, (n,), generator=gen).tolist()

    if k["workload_name"] == "low_reuse":
        prompts = [tokens(k["unique_suffix_len"]) for _ in range(k["num_requests"])]
    else:
        prefixes = [tokens(k["shared_prefix_len"]) for _ in range(k["num_groups"])]
        prompts = [
            prefixes[i % k["num_groups"]] + tokens(k["unique_suffix_len"]) for i in range(k["num_requests"])
        ]
    return [
        RequestSpec(tuple(p), k["max_new_tokens"], i, group=f"g{i % k['num_groups']}")
        for i, p in enumerate(prompts)
    ]


def cache_counts(run: Run, block_size: int) -> dict:
    """The reference's block lookups and hits (lookups stop at the first miss), and the cached blocks left."""
    lookups = hits = 0
    for req in run.requests:
        num_hit = req.num_cached_tokens // block_size
        hits += num_hit
        lookups += num_hit + (num_hit < req.num_prompt_tokens // block_size)
    return {"lookups": lookups, "hits": hits}


def run_case(ctx: Context, name: str, values: tuple) -> CaseResult:
    knobs = dict(zip(KNOBS, values, strict=True))
    specs = workload(knobs, ctx.vocab_size)
    bs = knobs["prefix_block_size"]
    caching = {"no_prefix_cache": False, "prefix_cache": True}

    def mode(name: str):
        def go() -> Run:
            eng = ctx.engine(
                block_size=bs, num_kv_blocks=knobs["max_cache_blocks"], enable_prefix_caching=caching[name]
            )
            run = drive(eng, specs, serial=True)
            run.extra = cache_counts(run, bs) if caching[name] else {"lookups": 0, "hits": 0}
            run.extra["blocks"] = eng.scheduler.kv_cache_manager.num_cached_blocks
            return run

        return go

    best, _ = compare(ctx, {name: mode(name) for name in caching})
    for m in best.values():
        m["hit_rate"] = ratio(m["hits"], m["lookups"]) if m["lookups"] else 0.0
    base, cached = best["no_prefix_cache"], best["prefix_cache"]
    ratios = {
        "throughput_ratio": ratio(cached["tok_s"], base["tok_s"]),
        "ttft_ratio": ratio(cached["avg_ttft_ms"], base["avg_ttft_ms"]),
        "prefill_reduction": 1 - ratio(cached["prefill_computed"], cached["prompt_tok"]),
        "hit_rate": cached["hit_rate"],
    }
    ctx.print(f"\n=== {name} ===\n{knobs}")
    ctx.print(mode_table(best, COLUMNS))
    ctx.print(f"\nPrefix-cache generated-token throughput ratio: {ratios['throughput_ratio']:.2f}x")
    ctx.print(f"Actual prefill-token reduction: {100 * ratios['prefill_reduction']:.1f}%")
    ctx.print(f"Average TTFT ratio: {ratios['ttft_ratio']:.2f}x")
    return CaseResult(name, knobs, best, ratios)


def summary(cases: list[CaseResult]) -> str:
    headers = ["case", "requests", "prompt_tok", "cached_tok", "actual_prefill", "prefill reduction"]
    headers += [
        "hit rate",
        "no-cache tok/s",
        "cache tok/s",
        "tput ratio",
        "no-cache ttft_ms",
        "cache ttft_ms",
    ]
    headers += ["ttft ratio", "evictions"]
    rows = []
    for c in cases:
        base, cached, r = c.modes["no_prefix_cache"], c.modes["prefix_cache"], c.ratios
        rows.append(
            [
                c.name,
                str(cached["reqs"]),
                str(cached["prompt_tok"]),
                str(cached["cached_tok"]),
                str(cached["prefill_computed"]),
                f"{100 * r['prefill_reduction']:.1f}%",
                f"{100 * r['hit_rate']:.1f}%",
                f"{base['tok_s']:.2f}",
                f"{cached['tok_s']:.2f}",
                f"{r['throughput_ratio']:.2f}x",
                f"{base['avg_ttft_ms']:.2f}",
                f"{cached['avg_ttft_ms']:.2f}",
                f"{r['ttft_ratio']:.2f}x",
                str(cached["evictions"]),
            ]
        )
    return render_table(headers, rows)


def verdicts(cases: list[CaseResult], small: bool) -> list[Verdict]:
    out = []
    for c in cases:
        r, cached = c.ratios, c.modes["prefix_cache"]["cached_tok"]
        ref_cached, ref_tput, ref_ttft = REFERENCE[c.name]
        saved = f"cached {cached} tokens (reference: {ref_cached})"
        same_savings = small or cached == ref_cached
        if ref_cached:
            passed = same_savings and r["throughput_ratio"] > 1.0 and r["ttft_ratio"] < 1.0
            text = (
                f"{saved}, throughput {r['throughput_ratio']:.2f}x (target > 1.00x; reference: "
                f"{ref_tput:.2f}x), TTFT {r['ttft_ratio']:.2f}x (target < 1.00x; reference: {ref_ttft:.2f}x)"
            )
        else:
            passed = same_savings and cached == 0 and r["throughput_ratio"] >= NO_HIT_MIN_THROUGHPUT_RATIO
            text = (
                f"{saved}, cannot hit: throughput {r['throughput_ratio']:.2f}x (target >= "
                f"{NO_HIT_MIN_THROUGHPUT_RATIO:.2f}x; reference: {ref_tput:.2f}x), "
                f"TTFT {r['ttft_ratio']:.2f}x, "
                f"{c.modes['prefix_cache']['evictions']} evictions"
            )
        out.append(Verdict(c.name, passed, text))
    return out


def run(ctx: Context) -> BenchResult:
    small = ctx.scale == "small"
    ctx.print("\n##### Prefix caching: no_prefix_cache vs prefix_cache #####")
    cases = [run_case(ctx, name, values) for name, values in (SMALL_CASES if small else CASES).items()]
    ctx.print("\n=== Prefix caching summary ===")
    ctx.print(summary(cases))
    return BenchResult(NAME, cases, verdicts(cases, small), {})
