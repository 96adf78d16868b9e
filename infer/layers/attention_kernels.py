"""Where the C++ attention kernels of infer/kernels serve a layer's attention; infer.layers.attention calls
them there, and infer.layers.attention_reference elsewhere.

The batched call is the C++ kernel of infer/kernels (`paged_attention.cpp`, what vLLM's CPU backend has
as cpu_attention_with_kv_cache) wherever it serves the step (KERNEL_MAX_QUERY_LEN, KERNEL_DTYPES, a
head_dim that is a multiple of 16): every query over its context read in place through the block table
(no gathered copy, no padding, no mask), GQA (a kv head's group of query heads reads each key once),
sliding windows, an online float32 softmax, sequences spread over torch's OpenMP threads. It won at
every size measured (2-5x one layer's matmul path), so nothing dispatches by size.

Prefill: the prefill kernel (infer/kernels/prefill_attention.cpp: flash attention's forward over the
paged cache, tiles of 64 keys packed once per call, no tile past the diagonal; with AMX its two products
on the tiles; on a build without AVX-512 BF16, float_prefill_attention.cpp's float32 FMAs) serves
`loop_seqs` in PREFILL_KERNEL_DTYPES, for a head_dim that is a multiple of 16.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from infer import kernels
from infer.layers.fp8_kv_cache import FP8_DTYPES

if TYPE_CHECKING:
    from infer.layers.attention_metadata import AttentionMetadata

# The C++ kernel (infer/kernels) serves the batched call when its longest query is at most this long, in
# these dtypes; the matmuls otherwise (and wherever the kernel is off or could not be built). It won at
# every point measured, chunks of up to 128 tokens riding with decodes included; longer ones, rare in a
# batched call (attention_metadata.MAX_PADDED_SCORES), were not measured.
KERNEL_MAX_QUERY_LEN = 128
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# The prefill kernel (infer/kernels/prefill_attention.cpp) serves the sequences the batched call leaves
# out (loop_seqs: prompts, longer chunks), all of them in one call per layer, in these dtypes, on any
# AVX2 or AVX-512 build; SDPA one sequence at a time otherwise (see the module docstring). It won at
# every point measured, in each dtype.
PREFILL_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def prefill_kernel(q, cache):
    """The kernels' ops where the prefill kernel serves this layer's loop sequences, else None: SDPA."""
    if cache is None or q.stride(-1) != 1:
        return None
    return prefill_kernel_for(cache[0], q.dtype)


def narrower(cache_dtype: torch.dtype, q_dtype: torch.dtype) -> bool:
    """A float16 or bfloat16 cache (`--kv-cache-dtype`) under float32 queries: the batched kernel reads
    the queries rounded to the cache's dtype and rounds its output to it, and write_cache rounds the keys
    and values (llama.cpp's default cache, half the bytes a decode reads)."""
    return q_dtype == torch.float32 and cache_dtype in (torch.float16, torch.bfloat16)


def _reads(ops, q_dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernels take queries of q_dtype over a cache of cache_dtype: of its own dtype, or over
    an fp8 cache bf16 queries with a head_dim of a multiple of 64 on a "+fp8" build."""
    if cache_dtype not in FP8_DTYPES:
        return q_dtype == cache_dtype
    return q_dtype == torch.bfloat16 and head_dim % 64 == 0 and has_fp8(ops)


def kernels_read_fp8(q_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether this build's kernels read an fp8 cache under queries of q_dtype and this head_dim (else the
    Python path converts what it reads)."""
    ops = kernels.load()
    return ops is not None and _reads(ops, q_dtype, FP8_DTYPES[0], head_dim)


def prefill_kernel_for(key_cache: torch.Tensor, q_dtype: torch.dtype | None = None):
    """The kernels' ops where the prefill kernel serves queries of q_dtype (None: what the cache takes, bf16
    over fp8) over this cache (PREFILL_KERNEL_DTYPES or fp8, a head_dim that is a multiple of 16), else
    None. An AVX-512 BF16 build takes what `_reads` says; an AVX2 or AVX-512 one without BF16 runs
    float_prefill_attention.cpp, which takes the cache's dtype or float32 over a 16-bit cache."""
    fp8 = key_cache.dtype in FP8_DTYPES
    if (
        (key_cache.dtype not in PREFILL_KERNEL_DTYPES and not fp8)
        or key_cache.device.type != "cpu"
        or key_cache.shape[-1] % 16
    ):
        return None
    ops = kernels.load()
    if ops is None:
        return None
    q_dtype = q_dtype or (torch.bfloat16 if fp8 else key_cache.dtype)
    if not _avx512_bf16(ops):
        served = not fp8 and (q_dtype == key_cache.dtype or narrower(key_cache.dtype, q_dtype))
        return ops if served and _vector_isa(ops) else None
    return ops if _reads(ops, q_dtype, key_cache.dtype, key_cache.shape[-1]) else None


def decode_kernel_for(key_cache: torch.Tensor, q_dtype: torch.dtype | None = None):
    """The kernels' ops where the batched (decode) kernel reads queries of q_dtype (None: what the cache
    takes, bf16 over fp8) over this cache on any build (kernel_serves, less the step's query lengths),
    else None."""
    ops = kernels.load()
    if ops is None or key_cache.device.type != "cpu" or key_cache.shape[-1] % 16:
        return None
    q_dtype = q_dtype or (torch.bfloat16 if key_cache.dtype in FP8_DTYPES else key_cache.dtype)
    q_dtype = key_cache.dtype if narrower(key_cache.dtype, q_dtype) else q_dtype
    return (
        ops
        if q_dtype in KERNEL_DTYPES and _reads(ops, q_dtype, key_cache.dtype, key_cache.shape[-1])
        else None
    )


@functools.cache
def _avx512_bf16(ops) -> bool:
    return "+bf16" in ops.isa()


@functools.cache
def _vector_isa(ops) -> bool:
    """An AVX2 or AVX-512 build: float_prefill_attention.cpp is in it."""
    return ops.isa() != "scalar"


@functools.cache
def has_fp8(ops) -> bool:
    return "+fp8" in ops.isa()


def kernel_serves(ops, meta: AttentionMetadata, q, key_cache) -> bool:
    return (
        meta.max_query_len <= KERNEL_MAX_QUERY_LEN
        and q.dtype in KERNEL_DTYPES
        and (_reads(ops, q.dtype, key_cache.dtype, key_cache.shape[-1]) or narrower(key_cache.dtype, q.dtype))
        and q.device.type == "cpu"
        and q.shape[-1] % 16 == 0
        and q.stride(-1) == 1
    )
