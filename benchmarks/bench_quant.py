"""bf16 vs int8 vs int4 weights, in-process: decode speed by batch, prefill speed, memory, perplexity.

    python benchmarks/bench_quant.py --model Llama-3.2-1B --load-format dummy
    python benchmarks/bench_quant.py --model llama-50m --load-format dummy
    python benchmarks/bench_quant.py --perplexity-only        # the embedded model on held-out text

One engine per method, built once; the rounds alternate the methods so that drift on a shared machine
hits each alike. Decode: `batch` requests with 128-token prompts (`--prompt-len`) run to 64 output
tokens each, after their prefill; the figure is decode tokens/s over the decode steps only. Prefill: one
512-token prompt (`--prefill-len`), time to its first token, at the server's default step budget.
Perplexity: Genesis 38, which the embedded model never trained on (infer/assets/embedded/README.md), in
windows of 512 tokens.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from infer.config import EngineConfig
from infer.engine.llm_engine import LLMEngine
from infer.eval.perplexity import decode_nll, held_out_text, perplexity
from infer.sampling_params import SamplingParams


def decode_tok_s(eng: LLMEngine, batch: int, seed: int, prompt_len: int = 128) -> float:
    gen = torch.Generator().manual_seed(seed)
    vocab = min(eng.model_config.vocab_size, 30000)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for _ in range(batch):
        eng.add_request(torch.randint(10, vocab, (prompt_len,), generator=gen).tolist(), params)
    decode_s = decode_tokens = 0
    while eng.has_unfinished():
        start = time.perf_counter()
        eng.step()
        elapsed = time.perf_counter() - start
        stats = eng.last_stats
        if stats.num_prefill_tokens == 0:
            decode_s += elapsed
            decode_tokens += stats.num_decode_tokens
    return decode_tokens / decode_s


def prefill_ms(eng: LLMEngine, seed: int, prompt_len: int = 512) -> float:
    gen = torch.Generator().manual_seed(10_000 + seed)  # not the decode prompts' seed: no prefix-cache hit
    prompt = torch.randint(10, min(eng.model_config.vocab_size, 30000), (prompt_len,), generator=gen).tolist()
    eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
    start = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--methods", nargs="+", default=["none", "int8", "int4"])
    p.add_argument("--batches", nargs="*", type=int, default=[1, 8, 32], help="none: prefill only")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt of the decode runs")
    p.add_argument("--prefill-len", type=int, default=512, help="tokens of the prefill run's prompt")
    p.add_argument("--perplexity-only", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    print(
        f"model={args.model or 'embedded'} torch {torch.__version__} threads={torch.get_num_threads()} "
        f"{platform.processor() or platform.machine()}"
    )
    engines = {}
    for method in args.methods:
        engines[method] = LLMEngine(
            EngineConfig(
                model=args.model,
                load_format=args.load_format,
                quantization=method,
                kv_cache_memory_gb=1.0,
            )
        )
    results = {
        m: {"weight_mib": e.quantization["weight_mib"], "backends": e.quantization["backends"]}
        for m, e in engines.items()
    }
    if args.load_format != "dummy":
        ids = engines[args.methods[0]].tokenizer.encode(held_out_text())
        for method, eng in engines.items():
            results[method]["perplexity"] = round(perplexity(eng.runner.model, ids), 3)
            longest = eng.runner.model.config.max_position_embeddings  # decode_nll: one sequence
            results[method]["decode_nll"] = round(decode_nll(eng.runner.model, ids[:longest]), 4)
        results["perplexity_tokens"] = len(ids)
    if not args.perplexity_only:
        samples = {m: {b: [] for b in args.batches} | {"prefill": []} for m in args.methods}
        for r in range(args.rounds):
            for method, eng in engines.items():
                for b in args.batches:
                    samples[method][b].append(decode_tok_s(eng, b, seed=r, prompt_len=args.prompt_len))
                samples[method]["prefill"].append(prefill_ms(eng, seed=r, prompt_len=args.prefill_len))
        for method in args.methods:
            for b in args.batches:
                results[method][f"decode_tok_s_b{b}"] = round(statistics.median(samples[method][b]), 1)
            prefill = round(statistics.median(samples[method]["prefill"]), 1)
            results[method][f"prefill_{args.prefill_len}_ms"] = prefill
    print(json.dumps(results, indent=1))
    if not args.perplexity_only:
        base = results[args.methods[0]]
        prefill_key = f"prefill_{args.prefill_len}_ms"
        print(
            "\n| "
            + " | ".join(["method", "weights MiB", *(f"decode b={b} tok/s" for b in args.batches)])
            + f" | prefill {args.prefill_len} ms |"
            + (" perplexity |" if "perplexity" in base else "")
        )
        print("|---" * (3 + len(args.batches) + ("perplexity" in base)) + "|")
        for method in args.methods:
            r = results[method]
            cells = [
                f"{r[f'decode_tok_s_b{b}']} ({r[f'decode_tok_s_b{b}'] / base[f'decode_tok_s_b{b}']:.2f}x)"
                for b in args.batches
            ]
            ppl = [f"{r['perplexity']}"] if "perplexity" in r else []
            print("| " + " | ".join([method, str(r["weight_mib"]), *cells, str(r[prefill_key]), *ppl]) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
