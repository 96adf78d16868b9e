"""Which dtype is faster on this CPU? Times one prefill forward and one batched decode step.

    python benchmarks/bench_dtype.py --model llama-50m --load-format dummy
    python benchmarks/bench_dtype.py            # the embedded model
    python benchmarks/bench_dtype.py --model /path/to/SmolLM2-135M --batch 1 8 32

The answer decides what `--dtype auto` picks on CPU (see infer.models.loader.pick_dtype).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from infer.layers.attention_metadata import AttentionMetadata
from infer.models.loader import load_model
from infer.runner.kv_cache import allocate_kv_cache, auto_cache_dtype

BLOCK = 16


def timed(fn, repeats: int) -> float:
    fn()  # warm-up: first calls pay for allocation and kernel selection
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.inference_mode()
def measure(model, prefill_len: int, batch: int, context: int, repeats: int) -> tuple[float, float]:
    cfg, dtype = model.config, auto_cache_dtype(model)
    ids = torch.randint(0, cfg.vocab_size, (prefill_len,))
    meta = AttentionMetadata.prefill_only([prefill_len])
    prefill_s = timed(lambda: model.compute_logits(model(ids, torch.arange(prefill_len), meta)[-1:]), repeats)

    blocks_per_seq = -(-(context + 1) // BLOCK)
    kv = allocate_kv_cache(cfg, batch * blocks_per_seq, BLOCK, dtype)
    tables = torch.arange(batch * blocks_per_seq).view(batch, blocks_per_seq)
    slots = tables[:, context // BLOCK] * BLOCK + context % BLOCK
    meta = AttentionMetadata([1] * batch, [context + 1] * batch, slots, tables, kv)
    ids = torch.randint(0, cfg.vocab_size, (batch,))
    positions = torch.full((batch,), context)
    decode_s = timed(lambda: model.compute_logits(model(ids, positions, meta)), repeats)
    return prefill_s, decode_s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| dtype | prefill tok/s | " + " | ".join(f"decode b={b} tok/s" for b in args.batch) + " |")
    print("|---|---:|" + "---:|" * len(args.batch))
    # the first row: what `--dtype auto` picks for the checkpoint (on a CPU without bf16 arithmetic, a bf16
    # checkpoint's activations in float32 over its bf16 weights); the last: bf16 as torch runs it, without
    # the load-time prepacking (oneDNN's layout, on CPUs with bf16 hardware) or widening (avx2_linear)
    for label, dtype, prepack in (
        ("auto", "auto", True),
        ("float32", "float32", True),
        ("bfloat16", "bfloat16", True),
        ("bfloat16, prepack=False", "bfloat16", False),
    ):
        model, _, _ = load_model(args.model, dtype=dtype, load_format=args.load_format, prepack=prepack)
        cells = []
        for i, batch in enumerate(args.batch):
            prefill_s, decode_s = measure(model, args.prefill_len, batch, args.context, args.repeats)
            if i == 0:
                cells.append(f"{args.prefill_len / prefill_s:,.0f}")
            cells.append(f"{batch / decode_s:,.0f}")
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
