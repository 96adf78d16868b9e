"""KV cache tensors: one key and one value pool per layer, preallocated once."""

from __future__ import annotations

import torch

from infer.kernels import hugepages
from infer.layers.parallel import SINGLE, TensorParallel
from infer.models.config import ModelConfig


def allocate_kv_cache(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, tp: TensorParallel = SINGLE
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Under tensor parallelism, the pools of this rank's KV heads only."""
    shape = (num_blocks, block_size, tp.kv_heads(cfg.num_kv_heads), cfg.head_dim)
    return [(hugepages.zeros(shape, dtype), hugepages.zeros(shape, dtype)) for _ in range(cfg.num_layers)]


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, tp: TensorParallel = SINGLE) -> int:
    """Per rank, under tensor parallelism."""
    return 2 * cfg.num_layers * tp.kv_heads(cfg.num_kv_heads) * cfg.head_dim * dtype.itemsize
