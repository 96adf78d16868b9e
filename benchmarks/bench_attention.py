"""Attention on CPU: the decode paths of infer.layers.attention (the C++ kernel over the paged cache, and
the matmul path it falls back to) against the SDPA call the matmuls replaced; and prefill (--prefill):
the prefill kernel (infer/kernels/prefill_attention.cpp) against SDPA, its fallback.

    python benchmarks/bench_attention.py                        # decode: both shapes, bf16 and fp32
    python benchmarks/bench_attention.py --dtype bfloat16 --batch 8 --context 1024
    python benchmarks/bench_attention.py --chunk 8 --batch 8     # decodes and one 8-token prompt chunk
                                             # (`split`: the chunk through the prefill kernel, as shipped)
    python benchmarks/bench_attention.py --model llama-50m      # a model's decode step (dummy weights)
    python benchmarks/bench_attention.py --prefill              # prefill: SDPA against the prefill kernel
    python benchmarks/bench_attention.py --prefill --model llama-50m --dtype bfloat16  # a model's prefill
    python benchmarks/bench_attention.py --kv-cache-dtype fp8 [--prefill]  # bf16 cache against fp8

The paths run alternately in one process, best of --rounds (a shared machine drifts by tens of percent
between runs: never compare numbers from two runs), each swapped in for `infer.layers.attention._batched`:
`old` is a copy of the SDPA call this repository used before (main at d259f98), `matmul` the gather and
two matmuls (`matmul_batched`, infer.layers.attention_reference), `kernel` the C++ kernel of
infer/kernels (`_kernel_batched`, always; in --model mode, the shipped dispatch `_batched`, which picks
it wherever it serves the step).

Decode rows time one layer's `attention(...)` call, its cache write included, with the metadata of
the step already built (once per forward, shared by every layer); `first layer` is a call that also
builds the metadata and its per-forward tensors, as the first layer of a forward does. Sequence i of
a batch has `context - i % 16` tokens, so the batch needs a padding mask, as in a real step. `err`
is the largest difference from the new path's call in float64. With --chunk, those paths take the chunk
along in the batched call (whatever MAX_PADDED_SCORES says), while `split` is the shipped dispatch: a
chunk of PREFILL_KERNEL_MIN_QUERY_LEN tokens or more through the prefill kernel, the decodes batched.
"""

from __future__ import annotations

import argparse
import time
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from infer import kernels
from infer.layers import attention as attention_module
from infer.layers import attention_kernels, attention_metadata
from infer.layers.attention import attention
from infer.layers.attention_metadata import AttentionMetadata, take_rows
from infer.runner.kv_cache import FORMATS

BLOCK = 16
SHAPES = {"llama-50m": (8, 4, 64), "Llama-3.2-1B": (32, 8, 64)}  # q heads, kv heads, head_dim


def sdpa_batched(q, key_cache, value_cache, meta: AttentionMetadata, scale, sliding_window):
    """The batched path before the matmul one: one SDPA call over the gathered, padded contexts (a view
    of the cache for one stream over consecutive blocks). Its per-forward tensors are kept on meta."""
    n, max_q = len(meta.batch_seqs), meta.max_query_len
    block_size = key_cache.shape[1]
    q = q if meta.q_rows is None else take_rows(q, meta.q_rows)  # [n * max_q, H, D]
    if n == 1 and max_q == 1:
        seq_len, ids = meta.batch_seq_lens[0], meta.batch_tables[0].tolist()
        if ids == list(range(ids[0], ids[0] + len(ids))):
            start = ids[0] * block_size
            keys, values = (c.flatten(0, 1)[start : start + seq_len] for c in (key_cache, value_cache))
        else:
            keys, values = (
                c.index_select(0, meta.batch_tables[0]).flatten(0, 1)[:seq_len]
                for c in (key_cache, value_cache)
            )
        if sliding_window is not None and seq_len > sliding_window:
            keys, values = keys[-sliding_window:], values[-sliding_window:]
        keys, values = (x.permute(1, 0, 2).unsqueeze(0) for x in (keys, values))  # [1, H_kv, seq_len, D]
        out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, scale=scale, enable_gqa=True)
        return out.squeeze(2)
    masks = meta.__dict__.setdefault("_sdpa_masks", {})
    if sliding_window not in masks:
        k_pos = torch.arange(meta.batch_tables.shape[1] * block_size)  # [padded_len]
        seq_lens = torch.tensor(meta.batch_seq_lens).unsqueeze(1)  # [n, 1]
        query_lens = torch.tensor(meta.batch_query_lens).unsqueeze(1)
        q_pos = (seq_lens - query_lens + torch.minimum(torch.arange(max_q), query_lens - 1)).unsqueeze(2)
        allowed = k_pos <= q_pos  # [n, max_q, padded_len]
        if sliding_window is not None:
            allowed &= q_pos - k_pos < sliding_window
        blocked = ~allowed.unsqueeze(1)
        masks[sliding_window] = torch.zeros(blocked.shape, dtype=key_cache.dtype).masked_fill_(
            blocked, float("-inf")
        )
    shape = (n, -1, *key_cache.shape[2:])  # [n, padded_len, H_kv, head_dim]
    keys = key_cache.index_select(0, meta.batch_tables.flatten()).view(shape)
    values = value_cache.index_select(0, meta.batch_tables.flatten()).view(shape)
    out = F.scaled_dot_product_attention(
        q.view(n, max_q, *q.shape[1:]).transpose(1, 2),  # [n, H, max_q, D]
        keys.transpose(1, 2),  # [n, H_kv, padded_len, D]
        values.transpose(1, 2),
        attn_mask=masks[sliding_window],
        scale=scale,
        enable_gqa=True,
    )
    out = out.transpose(1, 2).reshape(n * max_q, *q.shape[1:])  # [n * max_q, H, D]
    return out if meta.out_rows is None else out.index_select(0, meta.out_rows)


def kernel_batched(q, key_cache, value_cache, meta: AttentionMetadata, scale, sliding_window):
    """The C++ kernel whatever the step (the dispatch may fall back to the matmuls)."""
    ops = kernels.load()
    if ops is None:
        raise SystemExit("the C++ kernels are off (INFER_NO_KERNELS) or could not be built: see the log")
    return attention_module._kernel_batched(ops, q, key_cache, value_cache, meta, scale, sliding_window)


SHIPPED = attention_module._batched
IMPLS = {"old": sdpa_batched, "matmul": attention_module.matmul_batched, "kernel": kernel_batched}
MODEL_IMPLS = {"old": sdpa_batched, "matmul": attention_module.matmul_batched, "kernel": SHIPPED}


@contextmanager
def batched_impl(fn):
    attention_module._batched = fn
    try:
        yield
    finally:
        attention_module._batched = SHIPPED


def interleaved(fns: dict, rounds: int, seconds: float = 0.02) -> dict[str, float]:
    """Best seconds per call of each fn, alternating them round by round."""
    reps = {}
    for name, fn in fns.items():  # warm-up (first calls pick kernels), then calls per round for ~`seconds`
        fn()
        start = time.perf_counter()
        fn()
        reps[name] = max(1, int(seconds / max(time.perf_counter() - start, 1e-6)))
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(reps[name]):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / reps[name])
    return best


def decode_step(
    batch: int, context: int, heads: tuple[int, int, int], dtype: torch.dtype, chunk: int = 0, seed: int = 0
):
    """A decode step's q, k, v for one layer, a filled cache over consecutive blocks, and a factory of
    its metadata. chunk > 0: the batch's last sequence is a prompt's chunk of that many tokens instead."""
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [context - i % BLOCK for i in range(batch)]
    query_lens = [1] * (batch - 1) + [max(1, chunk)]
    blocks_per_seq = -(-context // BLOCK)
    shape = (batch * blocks_per_seq, BLOCK, num_kv_heads, head_dim)
    cache = tuple(torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    tables = torch.arange(batch * blocks_per_seq).view(batch, blocks_per_seq)
    pos = torch.tensor([p for s, n in zip(seq_lens, query_lens, strict=True) for p in range(s - n, s)])
    seqs = torch.tensor([i for i, n in enumerate(query_lens) for _ in range(n)])
    slots = tables[seqs, pos // BLOCK] * BLOCK + pos % BLOCK
    num_tokens = len(pos)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))

    def meta(caches=(cache,)):
        return AttentionMetadata(query_lens, seq_lens, slots, tables, list(caches))

    return q, k, v, cache, meta


def decode_table(args) -> None:
    split = " | split ms | kernel / split | err split" if args.chunk else ""
    print(
        "| shape | dtype | batch x context | old (SDPA) ms | matmul ms | kernel ms | matmul / kernel"
        f" | first layer old / matmul / kernel ms | err old / matmul / kernel{split} |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|" + "---:|" * (3 if args.chunk else 0))
    for shape_name in args.shape:
        heads = SHAPES[shape_name]
        for dtype_name in args.dtype:
            for batch in args.batch:
                for context in args.context:
                    row = decode_row(
                        heads, getattr(torch, dtype_name), batch, context, args.chunk, args.rounds
                    )
                    step = f"{batch} x {context}" + (f", last a {args.chunk}-chunk" if args.chunk else "")
                    print(f"| {shape_name} | {dtype_name} | {step} | " + " | ".join(row) + " |", flush=True)


def decode_row(heads, dtype, batch, context, chunk, rounds) -> list[str]:
    if chunk > context - BLOCK:
        raise SystemExit(f"a chunk of {chunk} needs a context of at least {chunk + BLOCK}")
    q, k, v, cache, make_meta = decode_step(batch, context, heads, dtype, chunk)
    scale = heads[2] ** -0.5
    with riding_chunks():
        metas = {name: make_meta() for name in IMPLS}

    def call(name, meta):
        with batched_impl(IMPLS[name]):
            return attention(q, k, v, meta, 0, scale)

    fns = {name: (lambda n=name: call(n, metas[n])) for name in IMPLS}

    def first(name):  # a forward's first layer also builds the step's per-forward tensors (masks, ...)
        with riding_chunks():
            meta = make_meta()
        return call(name, meta)

    fns.update({f"first_{name}": (lambda n=name: first(n)) for name in IMPLS})
    # the shipped dispatch: a chunk of PREFILL_KERNEL_MIN_QUERY_LEN tokens or more through the prefill
    # kernel, apart from the decodes (where it serves: else as `kernel`)
    split_meta = make_meta()
    fns["split"] = lambda: attention(q, k, v, split_meta, 0, scale)
    t = interleaved(fns, rounds)
    ref = attention(
        q.double(), k.double(), v.double(), make_meta([tuple(c.double() for c in cache)]), 0, scale
    )
    err = {n: (call(n, metas[n]).double() - ref).abs().max().item() for n in IMPLS}
    err["split"] = (fns["split"]().double() - ref).abs().max().item()
    cells = [
        f"{t['old'] * 1e3:.3f}",
        f"{t['matmul'] * 1e3:.3f}",
        f"{t['kernel'] * 1e3:.3f}",
        f"{t['matmul'] / t['kernel']:.2f}x",
        " / ".join(f"{t[f'first_{n}'] * 1e3:.3f}" for n in IMPLS),
        " / ".join(f"{err[n]:.1e}" for n in IMPLS),
    ]
    if chunk:
        cells += [f"{t['split'] * 1e3:.3f}", f"{t['kernel'] / t['split']:.2f}x", f"{err['split']:.1e}"]
    return cells


@contextmanager
def riding_chunks():
    """Metadata built within lets the step's chunk ride with the decodes, however long: not through the
    prefill kernel, and whatever the padding (MAX_PADDED_SCORES)."""
    saved = attention_metadata.PREFILL_KERNEL_MIN_QUERY_LEN, attention_metadata.MAX_PADDED_SCORES
    attention_metadata.PREFILL_KERNEL_MIN_QUERY_LEN = attention_metadata.MAX_PADDED_SCORES = 1 << 40
    try:
        yield
    finally:
        attention_metadata.PREFILL_KERNEL_MIN_QUERY_LEN, attention_metadata.MAX_PADDED_SCORES = saved


@torch.inference_mode()
def model_table(args) -> None:
    from infer.models.loader import load_model

    print(f"{args.model}, dummy weights: one decode step (forward + logits), ms")
    print("| dtype | batch x context | old (SDPA) | matmul | kernel | matmul / kernel |")
    print("|---|---|---:|---:|---:|---:|")
    for dtype_name in args.dtype:
        model, cfg, _ = load_model(args.model, dtype=dtype_name, load_format="dummy")
        for batch in args.batch:
            for context in args.context:
                t = interleaved(model_step(model, cfg, batch, context), args.rounds, seconds=0.1)
                cells = " | ".join(f"{t[n] * 1e3:.2f}" for n in MODEL_IMPLS)
                cells += f" | {t['matmul'] / t['kernel']:.2f}x"
                print(f"| {dtype_name} | {batch} x {context} | {cells} |", flush=True)


def model_step(model, cfg, batch: int, context: int) -> dict:
    """The model's decode step over a cache of `batch` sequences, one per path of MODEL_IMPLS."""
    from infer.runner.kv_cache import allocate_kv_cache

    seq_lens = [context - i % BLOCK for i in range(batch)]
    blocks_per_seq = -(-context // BLOCK)
    kv = allocate_kv_cache(cfg, batch * blocks_per_seq, BLOCK, next(model.parameters()).dtype)
    tables = torch.arange(batch * blocks_per_seq).view(batch, blocks_per_seq)
    pos = torch.tensor(seq_lens) - 1
    slots = tables[torch.arange(batch), pos // BLOCK] * BLOCK + pos % BLOCK
    ids = torch.randint(0, cfg.vocab_size, (batch,))

    def step(name):
        meta = AttentionMetadata([1] * batch, seq_lens, slots, tables, kv)
        with batched_impl(MODEL_IMPLS[name]):
            return model.compute_logits(model(ids, pos, meta))

    return {name: (lambda n=name: step(n)) for name in MODEL_IMPLS}


@torch.inference_mode()
def model_prefill_table(args) -> None:
    from infer.models.loader import load_model

    print(f"{args.model}, dummy weights: one prefill forward of fresh prompts (+ their last logits), ms")
    print("| dtype | batch x prompt | SDPA | kernel | SDPA / kernel |")
    print("|---|---|---:|---:|---:|")
    for dtype_name in args.dtype:
        model, cfg, _ = load_model(args.model, dtype=dtype_name, load_format="dummy")
        for case in args.prompt:
            batch, length = map(int, case.split("x")) if "x" in case else (1, int(case))
            t = interleaved(model_prefill(model, cfg, batch, length), args.rounds, seconds=0.1)
            cells = f"{t['sdpa'] * 1e3:.2f} | {t['kernel'] * 1e3:.2f} | {t['sdpa'] / t['kernel']:.2f}x"
            print(f"| {dtype_name} | {batch} x {length} | {cells} |", flush=True)


def model_prefill(model, cfg, batch: int, length: int) -> dict:
    """The model's prefill of `batch` fresh prompts of `length` tokens into a cache: attention through SDPA
    (the prefill kernel switched off) and through the prefill kernel."""
    from infer.runner.kv_cache import allocate_kv_cache

    blocks_per_seq = -(-length // BLOCK)
    kv = allocate_kv_cache(cfg, batch * blocks_per_seq, BLOCK, next(model.parameters()).dtype)
    tables = torch.arange(batch * blocks_per_seq).view(batch, blocks_per_seq)
    pos = torch.arange(length).repeat(batch)
    seqs = torch.arange(batch).repeat_interleave(length)
    slots = tables[seqs, pos // BLOCK] * BLOCK + pos % BLOCK
    ids = torch.randint(0, cfg.vocab_size, (batch * length,))
    last = torch.arange(length - 1, batch * length, length)

    def forward():
        meta = AttentionMetadata([length] * batch, [length] * batch, slots, tables, kv)
        return model.compute_logits(model(ids, pos, meta)[last])

    def sdpa():
        saved = attention_kernels.prefill_kernel_for
        attention_kernels.prefill_kernel_for = lambda key_cache, q_dtype=None: None
        try:
            return forward()
        finally:
            attention_kernels.prefill_kernel_for = saved

    return {"sdpa": sdpa, "kernel": forward}


@contextmanager
def kernels_off():
    saved = kernels.load
    kernels.load = lambda: None
    try:
        yield
    finally:
        kernels.load = saved


def prefill_table(args) -> None:
    print("Prefill attention: one layer's attention(...) call for `batch` prompts of `prompt` tokens, ms.")
    print(
        "`fresh`: prompts with no earlier context; `chunk`: their second half over the first, in the cache."
    )
    print("SDPA: one call per sequence (the fallback); kernel: prefill_attention.cpp, one call; paged: the")
    print("decode kernel (paged_attention.cpp) over the same queries, every query against every key. Each")
    print("with the cache write of attention(...).")
    print("| shape | dtype | batch x prompt | kind | SDPA | kernel | SDPA / kernel | paged | err kernel |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|")
    for shape_name in args.shape:
        for dtype_name in args.dtype:
            for case in args.prompt:
                batch, length = map(int, case.split("x")) if "x" in case else (1, int(case))
                for kind in ("fresh", "chunk"):
                    row = prefill_row(
                        SHAPES[shape_name],
                        getattr(torch, dtype_name),
                        batch,
                        length,
                        kind == "chunk",
                        args.rounds,
                    )
                    print(
                        f"| {shape_name} | {dtype_name} | {batch} x {length} | {kind} | {row} |", flush=True
                    )


def prefill_step(batch: int, length: int, heads, dtype, chunk: bool, seed: int = 0):
    """q, k, v of `batch` prompts of `length` tokens (chunk: of their second half), a cache over consecutive
    blocks holding the rest, and a factory of the step's metadata."""
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(seed)
    query_len = length // 2 if chunk else length
    blocks_per_seq = -(-length // BLOCK)
    shape = (batch * blocks_per_seq, BLOCK, num_kv_heads, head_dim)
    cache = tuple(torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    tables = torch.arange(batch * blocks_per_seq).view(batch, blocks_per_seq)
    pos = torch.arange(length - query_len, length).repeat(batch)
    seqs = torch.arange(batch).repeat_interleave(query_len)
    slots = tables[seqs, pos // BLOCK] * BLOCK + pos % BLOCK
    q = torch.randn(batch * query_len, num_heads, head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(batch * query_len, num_kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))

    def meta(caches=(cache,)):
        return AttentionMetadata([query_len] * batch, [length] * batch, slots, tables, list(caches))

    return q, k, v, cache, meta


def prefill_row(heads, dtype, batch, length, chunk, rounds) -> str:
    ops = kernels.load()
    q, k, v, cache, make_meta = prefill_step(batch, length, heads, dtype, chunk)
    if ops is None or attention_kernels.prefill_kernel_for(cache[0]) is None:
        raise SystemExit("the prefill kernel does not serve this machine or dtype (see infer/kernels)")
    scale = heads[2] ** -0.5
    with kernels_off():
        sdpa_meta = make_meta()
    kernel_meta = make_meta()

    def sdpa():
        with kernels_off():
            return attention(q, k, v, sdpa_meta, 0, scale)

    query_len = q.shape[0] // batch
    seq_lens = torch.full((batch,), length, dtype=torch.int32)
    starts = torch.arange(0, batch * query_len + 1, query_len, dtype=torch.int32)

    def paged():  # the cache write of attention(...), then the decode kernel
        for c, x in zip(cache, (k, v), strict=True):
            c.view(-1, *x.shape[1:])[kernel_meta.slot_mapping] = x
        return ops.paged_attention(q, *cache, kernel_meta.block_tables, seq_lens, starts, scale, 0)

    fns = {"sdpa": sdpa, "kernel": lambda: attention(q, k, v, kernel_meta, 0, scale), "paged": paged}
    t = interleaved(fns, rounds, seconds=0.05)
    ref = attention(
        q.double(), k.double(), v.double(), make_meta([tuple(c.double() for c in cache)]), 0, scale
    )
    err = (fns["kernel"]().double() - ref).abs().max().item()
    ms = {n: f"{t[n] * 1e3:.3f}" for n in fns}
    return f"{ms['sdpa']} | {ms['kernel']} | {t['sdpa'] / t['kernel']:.1f}x | {ms['paged']} | {err:.1e}"


def fp8_table(args) -> None:
    """--kv-cache-dtype: the shipped attention(...) call over a bf16 cache and over an fp8 one holding the
    same values (the fp8 codes and their bf16), per layer, FP8_LAYERS layers' caches in turn (as a
    forward reads them: a cache that one layer's call alone would leave in L3 is not), alternated."""
    fp8 = FORMATS[args.kv_cache_dtype]
    print(f"One layer's attention(...) call, its cache write included, ms: a bf16 cache against {fp8}.")
    print("max diff: the outputs' largest difference, from the step's own keys and values rounded to fp8.")
    print("| shape | step | bf16 cache | fp8 cache | bf16 / fp8 | max diff |")
    print("|---|---|---:|---:|---:|---:|")
    for shape_name in args.shape:
        if args.prefill:
            cases = [("prefill", *map(int, c.split("x"))) for c in args.prompt]
        else:
            cases = [("decode", b, c) for b in args.batch for c in args.context]
        for kind, batch, length in cases:
            row = fp8_row(SHAPES[shape_name], kind, batch, length, fp8, args.rounds)
            print(f"| {shape_name} | {kind} {batch} x {length} | {row} |", flush=True)


FP8_LAYERS = 8


def fp8_row(heads, kind: str, batch: int, length: int, fp8: torch.dtype, rounds: int) -> str:
    if kind == "decode":
        q, k, v, cache, make_meta = decode_step(batch, length, heads, torch.bfloat16)
    else:
        q, k, v, cache, make_meta = prefill_step(batch, length, heads, torch.bfloat16, chunk=False)
    codes = [tuple(c.to(fp8) for c in cache) for _ in range(FP8_LAYERS)]
    caches = {"bf16": [tuple(c.to(torch.bfloat16) for c in layer) for layer in codes], "fp8": codes}
    metas = {name: make_meta(layers) for name, layers in caches.items()}
    scale = heads[2] ** -0.5

    def forward(name):
        return [attention(q, k, v, metas[name], i, scale) for i in range(FP8_LAYERS)]

    t = interleaved({name: (lambda n=name: forward(n)) for name in caches}, rounds, seconds=0.1)
    diff = (forward("bf16")[0].float() - forward("fp8")[0].float()).abs().max().item()
    ms = {n: t[n] / FP8_LAYERS * 1e3 for n in t}
    return f"{ms['bf16']:.3f} | {ms['fp8']:.3f} | {ms['bf16'] / ms['fp8']:.2f}x | {diff:.1e}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, nargs="+", default=[128, 512, 1024, 2048])
    p.add_argument(
        "--prompt",
        nargs="+",
        default=["1x128", "4x128", "1x512", "1x1024", "1x2048", "16x32"],
        help="--prefill: batch x prompt tokens (or prompt tokens: one)",
    )
    p.add_argument("--chunk", type=int, default=0, help="decode rows: one sequence is a chunk of this many")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--model", help="time a whole decode step of this model (a preset name or path)")
    p.add_argument("--prefill", action="store_true", help="time prefill attention: SDPA against the kernel")
    p.add_argument(
        "--kv-cache-dtype", help="fp8, fp8_e4m3 or fp8_e5m2: bf16 cache against fp8 (decode, or --prefill)"
    )
    args = p.parse_args()
    threads = torch.get_num_threads()
    ops = kernels.load()
    isa = ops.isa() if ops is not None else "off"
    print(f"torch {torch.__version__}, {threads} threads, kernel: {isa}, best of {args.rounds} rounds")
    torch.set_grad_enabled(False)
    if args.kv_cache_dtype:
        fp8_table(args)
    elif args.model and args.prefill:
        model_prefill_table(args)
    elif args.model:
        model_table(args)
    elif args.prefill:
        prefill_table(args)
    else:
        decode_table(args)


if __name__ == "__main__":
    main()
