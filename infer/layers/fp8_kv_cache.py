"""An fp8 KV cache (`--kv-cache-dtype fp8`, infer/runner/kv_cache.py) as the attention paths write and read
it: written with each value rounded to nearest and saturated to the format; read by the kernels as bf16
(bf16 queries, a head_dim of a multiple of 64, a build with "+fp8"), else converted to the queries' dtype
as the Python paths read it. A fresh prompt's own keys go through the same rounding, so that every path
attends over what the cache holds.
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in the cache's dtype; into fp8 rounded to nearest and saturated (NaN stays NaN), as the kernels'
    write_cache."""
    if dtype not in FP8_DTYPES:
        return x
    limit = torch.finfo(dtype).max
    return torch.clamp(x.float(), -limit, limit).to(dtype)


def as_cached(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of cache_dtype gives it back (in x's dtype): rounded where that is narrower."""
    return x if cache_dtype == x.dtype else to_cache_dtype(x, cache_dtype).to(x.dtype)
