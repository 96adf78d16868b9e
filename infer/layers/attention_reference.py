"""Attention in torch alone: the path wherever the C++ kernels do not serve (no compiler, a failed build,
INFER_NO_KERNELS=1, another CPU), and the reference the kernels' tests hold them to.

Without the kernel, the batched call is two matmuls in the cache's dtype around a float32 softmax
(`matmul_batched`, `_matmuls`): torch's CPU flash-attention in SDPA is slow in bfloat16 for short
queries, while the same memory-bound work as two bf16 matmuls is not. Besides the matmuls:
- GQA without repeating K/V: q is viewed [n, kv_heads, group * max_q, D], one matrix per kv head.
- One index_select per K and V, on the flat cache view [num_slots * kv_heads, D], reads only the keys
  some query sees (a sliding window's layers gather the window) in the matmuls' [n, kv_heads, span, D]
  order, into scratch buffers that every layer of a forward reuses, GATHER_CHUNK_BYTES of sequences
  at a time: a fresh buffer per layer page-faults for longer than the gather takes once it is large.
- One stream over consecutive blocks is read in place, a strided view, in float32; small bf16 work
  is converted to float32 (UPCAST_MAX_KEY_ELEMENTS): a bf16 matmul costs ~20 us however small.
bf16 scores are rounded once before the float32 softmax: float32 stays exact (tests/models).

Without the prefill kernel, `sdpa_prefill` serves the loop sequences, one SDPA call per sequence (also
without a cache).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from infer.layers.attention_metadata import AttentionMetadata, take_rows
from infer.layers.fp8_kv_cache import as_cached

# The batched path gathers the K and V it reads in chunks of sequences of at most this many bytes, into
# scratch buffers that every layer of a forward reuses. 8 MB was the best of 1-32 MB here, 20-40% faster
# than one chunk at 32 x 1024 and beyond, and it bounds the scratch memory.
GATHER_CHUNK_BYTES = 8 << 20

# Below this many key elements (per chunk), bfloat16 keys and values are converted and the matmuls run
# in float32: a bfloat16 matmul on this CPU costs ~20 us however small, a float32 one ~5 us. The best
# of 16K-1M in whole llama-50m decode steps (one stream up to 1024 tokens: up to 0.5 ms a step).
UPCAST_MAX_KEY_ELEMENTS = 1 << 18


def sdpa_prefill(q, k, v, cache, meta: AttentionMetadata, i: int, scale, sliding_window):
    """Seq i on its own through SDPA (where the prefill kernel does not serve the layer): its q, k, v rows
    [query_len, H(_kv), D] attend over its context."""
    seq_len = meta.seq_lens[i]
    if cache is None or meta.query_lens[i] == seq_len:  # no context before this step: its own keys suffice
        keys, values = k, v
        if cache is not None:
            keys, values = as_cached(k, cache[0].dtype), as_cached(v, cache[1].dtype)
    else:
        blocks = meta.prefill_blocks(i)
        keys = cache[0].index_select(0, blocks).flatten(0, 1)[:seq_len]  # [seq_len, num_kv_heads, head_dim]
        values = cache[1].index_select(0, blocks).flatten(0, 1)[:seq_len]
        keys, values = keys.to(q.dtype), values.to(q.dtype)  # from fp8; no copy otherwise
    return _attend(q, keys, values, scale, meta.prefill_mask(i, sliding_window, q.dtype))


def matmul_batched(q, key_cache, value_cache, meta: AttentionMetadata, scale, sliding_window):
    """The batch's n sequences at once, each query padded to max_q rows, over their gathered keys.
    Returns the batch's real rows [num_batch_tokens, H, D] in their flat order.

    GQA without repeating K/V: the query heads of one kv head (h = kv_head * group + g, as SDPA's
    enable_gqa) and the padded queries of a sequence are the rows of one matrix per kv head."""
    q = q if meta.q_rows is None else take_rows(q, meta.q_rows)  # [n * max_q, H, D]
    if meta.decode_span is not None:
        small = meta.decode_span[1] * key_cache.shape[2] * key_cache.shape[3] <= UPCAST_MAX_KEY_ELEMENTS
        if key_cache.element_size() >= 4 or small:
            return _stream(q, key_cache, value_cache, meta.decode_span, scale, sliding_window)
    n, max_q = len(meta.batch_seqs), meta.max_query_len
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    if max_q == 1:
        q = q.view(n, num_kv_heads, group, head_dim)
    else:
        q = q.view(n, max_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)  # [n, H_kv, g, max_q, D]
        q = q.reshape(n, num_kv_heads, group * max_q, head_dim)
    rows, mask = meta.batch_keys(num_kv_heads, sliding_window)  # [n, H_kv * span], [n, 1, 1, max_q, span]
    # sequences per chunk: the gathered keys and values of one chunk take at most GATHER_CHUNK_BYTES (an
    # fp8 cache's, once converted to q's dtype)
    size = max(key_cache.element_size(), q.element_size())
    chunk = max(1, GATHER_CHUNK_BYTES // (2 * rows.shape[1] * head_dim * size))
    buffers = meta.scratch(min(n, chunk) * rows.shape[1], head_dim, key_cache.dtype)
    caches = key_cache.view(-1, head_dim), value_cache.view(-1, head_dim)  # [num_slots * H_kv, D]
    if n <= chunk:
        out = _gathered(q, caches, rows.view(-1), mask, buffers, scale)  # [n, H_kv, group * max_q, D]
    else:
        out = q.new_empty(q.shape)
        for start in range(0, n, chunk):
            seqs = slice(start, start + chunk)
            part = mask if mask is None else mask[seqs]
            out[seqs] = _gathered(q[seqs], caches, rows[seqs].flatten(), part, buffers, scale)
    if max_q == 1:
        return out.view(n, num_heads, head_dim)
    out = out.view(n, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)  # [n, max_q, H_kv, g, D]
    out = out.reshape(n * max_q, num_heads, head_dim)  # [n * max_q, H, D]
    return out if meta.out_rows is None else out.index_select(0, meta.out_rows)


def _stream(q, key_cache, value_cache, decode_span, scale, sliding_window):
    """One stream decoding over consecutive blocks, in float32 (or wider): the matmuls read its keys in
    place, a strided view of the cache, as fast as SDPA did and faster than a gather would be. A short
    bfloat16 context is converted first (see UPCAST_MAX_KEY_ELEMENTS); a longer one takes _gathered,
    since a bfloat16 matmul is 2-3x slower on the strided layout than a gather and a matmul."""
    dtype = q.dtype
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = key_cache.shape[2]
    first_slot, seq_len = decode_span
    if sliding_window is not None and seq_len > sliding_window:
        first_slot, seq_len = first_slot + seq_len - sliding_window, sliding_window
    keys, values = (  # [H_kv, seq_len, D]
        c.view(-1, num_kv_heads, head_dim)[first_slot : first_slot + seq_len].transpose(0, 1)
        for c in (key_cache, value_cache)
    )
    q, keys, values = (_widen(x) for x in (q.view(num_kv_heads, -1, head_dim), keys, values))
    scores = torch.matmul(q, keys.transpose(1, 2)).mul_(scale)  # [H_kv, group, seq_len]
    out = torch.matmul(torch.softmax(scores, dim=-1), values)  # [H_kv, group, D]
    return out.view(1, num_heads, head_dim).to(dtype)


def _widen(x: torch.Tensor) -> torch.Tensor:
    """bfloat16 or float16 to float32; float32 and float64 as they are."""
    return x.float() if x.element_size() < 4 else x


def _gathered(q, caches, rows, mask, buffers, scale):
    """m sequences' queries q [m, H_kv, group * max_q, D] over their keys and values, gathered by rows
    [m * H_kv * span] from the flat caches [num_slots * H_kv, D] into the scratch buffers."""
    shape = (q.shape[0], q.shape[1], -1, q.shape[3])  # [m, H_kv, span, D]
    keys, values = (
        torch.index_select(cache, 0, rows, out=buf[: len(rows)]).view(shape).to(q.dtype)  # from fp8
        for cache, buf in zip(caches, buffers, strict=True)
    )
    return _matmuls(q, keys, values, mask, scale)


def _matmuls(q, keys, values, mask, scale):
    """q [m, H_kv, group * max_q, D] over keys, values [m, H_kv, span, D]: two matmuls in q's dtype
    (the cache's, or what an fp8 cache's became) around a float32 softmax (see the module docstring for
    why not SDPA). mask: None, or [m, 1, 1, max_q, span] float32, 0 or -inf."""
    if keys.element_size() < 4 and keys.numel() <= UPCAST_MAX_KEY_ELEMENTS:
        return _matmuls(q.float(), keys.float(), values.float(), mask, scale).to(q.dtype)
    m, num_kv_heads, num_queries, _ = q.shape
    scores = torch.matmul(q, keys.transpose(2, 3))  # [m, H_kv, group * max_q, span] in the cache's dtype
    if mask is None:
        scores = _widen(scores).mul_(scale)
    else:  # float32 out: the add converts bfloat16 scores on the fly
        max_q, span = mask.shape[3:]
        scores = torch.add(mask, scores.view(m, num_kv_heads, -1, max_q, span), alpha=scale)
    probs = torch.softmax(scores, dim=-1).to(values.dtype).view(m, num_kv_heads, num_queries, -1)
    return torch.matmul(probs, values)


def _attend(q, k, v, scale, mask):
    """One sequence: q [query_len, H, D] attends over k, v [seq_len, H_kv, D] under mask (None: causal)."""
    # [1, heads, len, head_dim]: 4-D inputs get the CPU flash kernel; 3-D ones fall back to the math path,
    # 2-3x slower for short sequences (15 vs 47 us for a causal 8-token prompt with 4 heads of 8)
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    if mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, scale=scale, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)  # [query_len, heads, head_dim]
