"""Engine performance on this machine, in-process (no HTTP): docs/engine.md and docs/optimizations.md.

    python benchmarks/bench_engine.py --model llama-50m --load-format dummy
    python benchmarks/bench_engine.py                       # the embedded model

1. overhead: scheduler + bookkeeping time per step as a fraction of the forward, at batch 1, 8, 32,
   and end-to-end output tokens/s for that many 128-token prompts (--prompt-len) generating 64 tokens
   each; step_ms is the median decode step (the steps that carry no prefill). --pool-order reversed
   starts from a KV pool whose free queue holds each request-sized run of blocks reversed, as a server's
   pool that has cycled does (a request's blocks are freed tail first); random, shuffled; churned, as
   a server's after 300 requests of mixed lengths (churn_pool).
2. context: decode tokens/s of one stream as its context grows (a growth copy would show as a slope).
3. prefix: throughput with prefix caching on vs off when nothing is shared (its pure cost), and TTFT
   with a shared 1024-token prefix (its benefit).
4. memory: KV pool allocated once at start-up, its size in tokens and bytes.

--trace FILE records the engine trace (infer.engine.trace) in the overhead section, written per batch size
to FILE-batch{N}.json; its cost shows in step_ms (the whole step() call, trace recording included), which
is what to compare with a run without it.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

import torch

from infer.config import EngineConfig
from infer.engine.llm_engine import LLMEngine
from infer.sampling_params import SamplingParams


def engine(args, **overrides) -> LLMEngine:
    cfg = dict(
        model=args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        kv_cache_memory_gb=1.0,
        prepack_weights=not args.no_prepack,
        enforce_eager=args.enforce_eager,
        kv_cache_dtype=args.kv_cache_dtype,
        block_size=args.block_size,
    )
    eng = LLMEngine(EngineConfig(**{**cfg, **overrides}))
    if args.graphs_in_python and eng.runner.graphs is not None:
        eng.runner.graphs.interpret = False
    return eng


def random_prompt(gen: torch.Generator, n: int, vocab: int) -> list[int]:
    return torch.randint(10, min(vocab, 30000), (n,), generator=gen).tolist()


def run_all(eng: LLMEngine) -> list:
    """(stats, timing, wall seconds of the whole step() call) per step."""
    steps = []
    while eng.has_unfinished():
        start = time.perf_counter()
        eng.step()
        steps.append((eng.last_stats, eng.last_timing, time.perf_counter() - start))
    return steps


def reorder_pool(eng: LLMEngine, order: str, run: int) -> None:
    """The free queue of a fresh pool (blocks in id order) re-ordered: "reversed" runs of `run` blocks,
    "random", or "churned" (churn_pool); "fresh" leaves it."""
    if order == "fresh":
        return
    if order == "churned":
        return churn_pool(eng.scheduler.kv_cache_manager.pool, eng.cache_config.block_size)
    queue = eng.scheduler.kv_cache_manager.pool.free_queue
    blocks = [queue.popleft() for _ in range(len(queue))]
    if order == "reversed":
        blocks = [b for i in range(0, len(blocks), run) for b in reversed(blocks[i : i + run])]
    else:
        random.Random(0).shuffle(blocks)
    for block in blocks:
        queue.append(block)


def churn_pool(pool, block_size: int, requests: int = 300, live: int = 32) -> None:
    """The pool as a server's after `requests` requests of continuous traffic (prompts of 100-1,800 tokens,
    16-200 output tokens, `live` at a time, each taking its prompt's blocks at once and a block per
    block_size tokens as it decodes, freed tail first as the cache manager frees them): the block
    allocator's own calls, without the model. An engine's tables after the same traffic
    (300 requests through LLMEngine, llama-50m shape) held runs of 2.6 consecutive blocks on average at
    16-token blocks (1.8 at 64, 1.6 at 128), as a sequence's after this."""
    rng = random.Random(0)
    running: list[list] = []  # [blocks, tokens still to decode]

    def start():
        prompt = rng.randint(100, 1800)
        running.append([pool.allocate(-(-prompt // block_size)), rng.randint(16, 200), prompt])

    for _ in range(live):
        start()
    finished = 0
    while finished < requests:
        for seq in running:  # one decode step of each: a new block where the last one is full
            seq[1] -= 1
            seq[2] += 1
            if seq[2] % block_size == 1:
                seq[0] += pool.allocate(1)
        for seq in [s for s in running if s[1] <= 0]:
            running.remove(seq)
            pool.free(reversed(seq[0]))
            finished += 1
            start()
    for blocks, _, _ in running:
        pool.free(reversed(blocks))


def overhead(args) -> list[dict]:
    rows = []
    for batch in (1, 8, 32):
        trace = None
        if args.trace:
            trace = str(Path(args.trace).with_name(f"{Path(args.trace).stem}-batch{batch}.json"))
        eng = engine(args, max_num_seqs=32, max_num_batched_tokens=max(512, 32 * 128), trace_path=trace)
        reorder_pool(eng, args.pool_order, run=-(-(args.prompt_len + 64) // eng.cache_config.block_size))
        gen = torch.Generator().manual_seed(batch)
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        for _ in range(batch):
            eng.add_request(random_prompt(gen, args.prompt_len, eng.model_config.vocab_size), params)
        start = time.perf_counter()
        steps = run_all(eng)
        e2e = batch * 64 / (time.perf_counter() - start)
        eng.close()  # writes the trace, if any (after the timing)
        decode = [t for s, t, _ in steps if s.num_prefill_tokens == 0]
        step_s = statistics.median(w for s, _, w in steps if s.num_prefill_tokens == 0)
        fwd = statistics.median(t.forward_s for t in decode)
        book = statistics.median(t.bookkeeping_s for t in decode)
        sched = statistics.median(t.schedule_s + t.update_s + t.detokenize_s for t in decode)
        rows.append(
            dict(
                batch=batch,
                forward_ms=fwd * 1e3,
                scheduler_ms=sched * 1e3,
                bookkeeping_ms=book * 1e3,
                bookkeeping_frac=book / fwd,
                step_ms=step_s * 1e3,
                decode_tok_s=batch / (fwd + book),
                end_to_end_tok_s=e2e,  # --prompt-len prompts, 64 output tokens each, prefill included
            )
        )
    return rows


def context(args) -> list[dict]:
    eng = engine(args)
    limit = min(eng.max_model_len, args.max_context)
    gen = torch.Generator().manual_seed(0)
    eng.add_request(
        random_prompt(gen, 16, eng.model_config.vocab_size),
        SamplingParams(temperature=0, max_tokens=limit - 16, ignore_eos=True),
    )
    times, pos = [], 16
    for stats, timing, _ in run_all(eng):
        if stats.num_decode_tokens:
            times.append((pos, timing.forward_s + timing.bookkeeping_s))
        pos += stats.num_prefill_tokens + stats.num_decode_tokens
    rows, width = [], limit // 8
    for lo in range(0, limit, width):
        bucket = [t for p, t in times if lo <= p < lo + width]
        if bucket:
            rows.append(dict(context=f"{lo}-{lo + width}", decode_tok_s=1 / statistics.median(bucket)))
    return rows


def prefix(args) -> dict:
    gen = torch.Generator().manual_seed(1)
    vocab_probe = engine(args, num_kv_blocks=64)
    vocab, max_len = vocab_probe.model_config.vocab_size, vocab_probe.max_model_len
    del vocab_probe
    prompts = [random_prompt(gen, 256, vocab) for _ in range(16)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    out: dict = {}
    for enable in (False, True) * 5:  # interleaved: the best of five per setting (the machine drifts)
        eng = engine(args, enable_prefix_caching=enable, max_num_seqs=16)
        start = time.perf_counter()
        for p in prompts:
            eng.add_request(p, params)
        run_all(eng)
        tok_s = 16 * 32 / (time.perf_counter() - start)
        key = f"no_reuse_tok_s_cache_{'on' if enable else 'off'}"
        out[key] = max(out.get(key, 0), tok_s)
    out["no_reuse_ratio"] = out["no_reuse_tok_s_cache_on"] / out["no_reuse_tok_s_cache_off"]

    shared_len = min(1024, max_len - 64)
    shared = random_prompt(gen, shared_len, vocab)
    for enable in (False, True):
        eng = engine(args, enable_prefix_caching=enable)
        ttfts = []
        for i in range(6):
            req = eng.add_request(shared + random_prompt(gen, 16, vocab), SamplingParams(max_tokens=1))
            run_all(eng)
            if i:  # the first request fills the cache
                ttfts.append(req.first_token_time - req.arrival_time)
        out[f"shared_{shared_len}_ttft_ms_cache_{'on' if enable else 'off'}"] = statistics.median(ttfts) * 1e3
    on, off = (out[f"shared_{shared_len}_ttft_ms_cache_{s}"] for s in ("on", "off"))
    out["shared_prefix_ttft_speedup"] = off / on
    return out


def memory(args) -> dict:
    eng = engine(args)
    return dict(
        kv_capacity_tokens=eng.kv_capacity_tokens,
        kv_bytes=eng.runner.kv_cache_bytes,
        kv_bytes_per_token=eng.kv_bytes_per_token,
        num_blocks=eng.cache_config.num_blocks,
        block_size=eng.cache_config.block_size,
    )


def table(rows: list[dict]) -> str:
    keys = list(rows[0])
    fmt = lambda v: (
        f"{v:,.3f}" if isinstance(v, float) and v < 10 else (f"{v:,.1f}" if isinstance(v, float) else str(v))
    )
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens in the overhead section")
    p.add_argument("--pool-order", choices=("fresh", "reversed", "random", "churned"), default="fresh")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument(
        "--kv-cache-dtype", default="auto", help="auto, float16, bfloat16, fp8, fp8_e4m3, fp8_e5m2"
    )
    p.add_argument("--no-prepack", action="store_true", help="plain F.linear: what prepacking buys")
    p.add_argument("--enforce-eager", action="store_true", help="no decode graphs: what replaying them buys")
    p.add_argument(
        "--graphs-in-python",
        action="store_true",
        help="decode graphs replayed as Python: what TorchScript buys",
    )
    p.add_argument("--trace", default=None, metavar="FILE", help="record the engine trace (overhead only)")
    p.add_argument("--only", nargs="+", default=["overhead", "context", "prefix", "memory"])
    p.add_argument("--json", default=None)
    args = p.parse_args()
    print(
        f"model={args.model or 'embedded'} dtype={args.dtype} kv_cache_dtype={args.kv_cache_dtype} "
        f"torch {torch.__version__} threads={torch.get_num_threads()} "
        f"{platform.processor() or platform.machine()}"
    )
    results = {}
    for name in args.only:
        result = globals()[name](args)
        results[name] = result
        print(f"\n## {name}\n")
        print(table(result) if isinstance(result, list) else table([result]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
