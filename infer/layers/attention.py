"""Attention over a packed batch, reading and writing a block-table KV cache: `attention()`, which every
model's attention layer calls with the step's AttentionMetadata (infer.layers.attention_metadata).

With a cache, the new keys/values are written to their slots first, and every sequence then attends
over its whole context read back through its block table, except one with no earlier context
(query_len == seq_len: a fresh prompt or first chunk), which reads its new keys directly. Without a cache
(a pooling model's forward, the no-cache benchmark mode) every sequence reads its own new keys: all of
them in one prefill-kernel call per layer, the step's rows taken as blocks of one token, else SDPA one
sequence at a time.

The metadata groups the sequences: decodes and short chunks (`batch_seqs`) take one batched call per
layer, the C++ decode kernel where it serves them, else the matmuls; the others (`loop_seqs`: prompts,
longer chunks) take the prefill kernel, all in one call per layer, else SDPA one sequence at a time.
Where the kernels serve: infer.layers.attention_kernels; the torch path, their reference:
infer.layers.attention_reference; an fp8 cache's rounding: infer.layers.fp8_kv_cache.

What each path costs and buys, per layer and per step, with the commands (`benchmarks/bench_attention.py
[--prefill]`): docs/optimizations.md, "C++ attention".
"""

from __future__ import annotations

import torch

from infer import kernels
from infer.layers.attention_kernels import (
    has_fp8,
    kernel_serves,
    narrower,
    prefill_kernel,
    prefill_kernel_for,
)
from infer.layers.attention_metadata import AttentionMetadata, put_rows, take_rows
from infer.layers.attention_reference import matmul_batched, sdpa_prefill
from infer.layers.fp8_kv_cache import FP8_DTYPES, to_cache_dtype


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, *args):
    """One layer's attention over the paged cache, its keys and values written first (the arguments of
    _attention). A step that may be interrupted (AttentionMetadata.interrupted) stops before it and
    after it: halfway through a layer's work, its projections and MLP on either side."""
    meta.check_interrupted()  # nothing of this layer is written yet
    out = _attention(q, k, v, meta, *args)
    meta.check_interrupted()  # this layer's keys and values are written; a rerun overwrites them
    return out


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
    layer_idx: int,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
    cache = meta.kv_caches[layer_idx] if meta.kv_caches is not None else None
    if cache is not None:
        key_cache, value_cache = cache
        write_cache(k, v, key_cache, value_cache, meta)
    if not meta.loop_seqs:  # one batched call covers every row
        return _batched(q, key_cache, value_cache, meta, scale, sliding_window)
    if cache is None:
        out = _kernel_own_keys(q, k, v, meta, scale, sliding_window)
        if out is not None:
            return out
    ops = prefill_kernel(q, cache)
    if ops is not None and not meta.batch_seqs:  # prompts and long chunks: one kernel call
        return _kernel_prefill(ops, q, key_cache, value_cache, meta, scale, sliding_window)
    if ops is None and len(meta.loop_seqs) == 1 and not meta.batch_seqs:  # all the rows are its own
        return sdpa_prefill(q, k, v, cache, meta, 0, scale, sliding_window)
    out = torch.empty_like(q)
    if meta.batch_seqs:
        put_rows(out, meta.batch_rows, _batched(q, key_cache, value_cache, meta, scale, sliding_window))
    if ops is not None:
        rows = meta.prefill_kernel_args()[0]
        put_rows(out, rows, _kernel_prefill(ops, q, key_cache, value_cache, meta, scale, sliding_window))
        return out
    for i in meta.loop_seqs:
        rows = slice(meta.query_starts[i], meta.query_starts[i] + meta.query_lens[i])
        out[rows] = sdpa_prefill(q[rows], k[rows], v[rows], cache, meta, i, scale, sliding_window)
    return out


def write_cache(k, v, key_cache, value_cache, meta: AttentionMetadata) -> None:
    """The step's new keys and values into their slots, in the cache's dtype (the kernel rounds float32
    ones into a 16-bit cache itself)."""
    ops = kernels.layer_ops(k)
    fp8 = key_cache.dtype in FP8_DTYPES
    narrow = ops is not None and narrower(key_cache.dtype, k.dtype)
    if key_cache.dtype != k.dtype and not fp8 and not narrow:  # bf16 into float16, or no kernels
        k, v = k.to(key_cache.dtype), v.to(value_cache.dtype)
    same = k.dtype == v.dtype and key_cache.dtype == value_cache.dtype
    same = same and (fp8 or narrow or k.dtype == key_cache.dtype)
    dense = key_cache.is_contiguous() and value_cache.is_contiguous()
    dense = dense and key_cache.shape == value_cache.shape
    fast = ops is not None and same and dense and k.stride(-1) == v.stride(-1) == 1
    if fast and (not fp8 or has_fp8(ops)):
        ops.write_cache(k, v, key_cache, value_cache, meta.slot_mapping)  # both, one call
    else:  # [num_slots, num_kv_heads, head_dim], in the cache's dtype
        for rows, cache in ((k, key_cache), (v, value_cache)):
            rows = to_cache_dtype(rows, cache.dtype).to(cache.dtype)
            cache.view(-1, *rows.shape[1:])[meta.slot_mapping] = rows


def _batched(q, key_cache, value_cache, meta: AttentionMetadata, scale, sliding_window):
    """The batch's sequences at once: the C++ kernel where it serves them, else the matmuls. Returns the
    batch's real rows [num_batch_tokens, H, D] in their flat order."""
    ops = kernels.load()
    if ops is not None and kernel_serves(ops, meta, q, key_cache):
        # float32 queries over a 16-bit cache: read rounded to the cache's dtype, the output rounded to it
        return _kernel_batched(ops, q, key_cache, value_cache, meta, scale, sliding_window)
    return matmul_batched(q, key_cache, value_cache, meta, scale, sliding_window)


def _kernel_batched(ops, q, key_cache, value_cache, meta: AttentionMetadata, scale, sliding_window):
    """infer/kernels/paged_attention.cpp: every batched query over its context, read from the blocks in
    place (no gather, no padding, no mask), split across the threads."""
    q = q if meta.batch_rows is None else take_rows(q, meta.batch_rows)  # [num_batch_tokens, H, D]
    seq_lens, query_starts = meta.kernel_args()
    return ops.paged_attention(
        q, key_cache, value_cache, meta.batch_tables, seq_lens, query_starts, scale, sliding_window or 0
    )


def _kernel_own_keys(q, k, v, meta: AttentionMetadata, scale, sliding_window) -> torch.Tensor | None:
    """A forward without a cache (a pooling model's, a no-cache benchmark's): every sequence in one prefill
    kernel call, its keys and values read from the step's own rows as blocks of one token, where SDPA took
    a call per sequence per layer. None where the kernel does not serve."""
    if q.stride(-1) != 1:
        return None
    keys = k.contiguous().unsqueeze(1)  # [num_tokens, 1, num_kv_heads, head_dim]: blocks of one token
    ops = prefill_kernel_for(keys, q.dtype)
    if ops is None:
        return None
    tables, seq_lens, query_starts = meta.own_keys_args()
    values = v.contiguous().unsqueeze(1)
    return ops.prefill_attention(q, keys, values, tables, seq_lens, query_starts, scale, sliding_window or 0)


def _kernel_prefill(ops, q, key_cache, value_cache, meta: AttentionMetadata, scale, sliding_window):
    """infer/kernels/prefill_attention.cpp: the loop sequences' queries over their contexts, read from
    the blocks in place, causal tiles only, in one call. Returns their rows [n, H, D] in flat order."""
    rows, tables, seq_lens, query_starts = meta.prefill_kernel_args()
    q = q if rows is None else take_rows(q, rows)
    return ops.prefill_attention(
        q, key_cache, value_cache, tables, seq_lens, query_starts, scale, sliding_window or 0
    )
