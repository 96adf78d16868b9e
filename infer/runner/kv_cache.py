"""KV cache tensors: one key and one value pool per layer, preallocated once.

Their dtype is the model's; `--kv-cache-dtype float16` (or bfloat16) under a float32 model stores keys and
values in 16 bits, as llama.cpp's default cache does (infer.layers.attention rounds them as they are written,
and the decode kernel's queries with them: half the bytes a decode step reads); with `--kv-cache-dtype fp8`
(fp8_e4m3, or fp8_e5m2) torch's float8 of one byte per element, as vLLM's flag: no scale (vLLM's default
without calibration, 1.0), each key and value rounded to the nearest fp8 value and saturated at the format's
largest (448 for e4m3, 57344 for e5m2) as it is written. The attention kernels read the codes as bf16, exactly
(infer/kernels/fp8.h); without them the Python path converts what it reads (infer/layers/fp8_kv_cache.py).
e4m3 keeps 3 mantissa bits (a relative error of at most 1/16), e5m2 2 bits with a wider range.
"""

from __future__ import annotations

import logging

import torch

from infer import kernels
from infer.kernels import hugepages
from infer.layers.attention_kernels import kernels_read_fp8
from infer.layers.fp8_kv_cache import FP8_DTYPES
from infer.layers.parallel import SINGLE, TensorParallel
from infer.models.config import ModelConfig

logger = logging.getLogger("infer.runner")

FORMATS = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's torch dtype for `--kv-cache-dtype name` (config.KV_CACHE_DTYPES)."""
    return model_dtype if name == "auto" else FORMATS[name]


def auto_cache_dtype(model: torch.nn.Module) -> torch.dtype:
    """What `auto` means for `model`: its activations' dtype, or 16 bits where the loader chose float32
    activations for a bf16 checkpoint or a quantized GGUF file (infer.models.loader.auto_kv_cache_dtype)."""
    return getattr(model, "auto_kv_cache_dtype", None) or next(model.parameters()).dtype


def warn_unserved_fp8(cache_dtype: torch.dtype, model_dtype: torch.dtype, head_dim: int) -> None:
    """A log line where an fp8 cache will not be read by the kernels (they take bf16 queries and a
    head_dim of a multiple of 64, on an AVX-512 BF16 + VBMI build): it works, through the slower Python
    path."""
    if cache_dtype in FP8_DTYPES and not kernels_read_fp8(model_dtype, head_dim):
        ops = kernels.load()
        logger.warning(
            "fp8 KV cache with a %s model of head_dim %d: the attention kernels read fp8 with bfloat16 "
            "queries and a head_dim of a multiple of 64, on a CPU with AVX-512 BF16 and VBMI (kernels: %s); "
            "this model attends through the slower Python path",
            str(model_dtype).removeprefix("torch."),
            head_dim,
            ops.isa() if ops is not None else "not built",
        )


def allocate_kv_cache(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, tp: TensorParallel = SINGLE
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeros, untouched until a block is written (hugepages.zeros): memory is taken as the pool fills.
    Under tensor parallelism, the pools of this rank's KV heads only."""
    shape = (num_blocks, block_size, tp.kv_heads(cfg.num_kv_heads), cfg.head_dim)
    return [(hugepages.zeros(shape, dtype), hugepages.zeros(shape, dtype)) for _ in range(cfg.num_layers)]


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, tp: TensorParallel = SINGLE) -> int:
    """Per rank, under tensor parallelism."""
    return 2 * cfg.num_layers * tp.kv_heads(cfg.num_kv_heads) * cfg.head_dim * dtype.itemsize
