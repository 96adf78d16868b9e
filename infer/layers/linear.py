"""Linear layers whose weight concatenates several checkpoint tensors (q/k/v, gate/up).

One matmul instead of three saves kernel launches and Python overhead per layer, which on a small
model on CPU is a real share of the step.
"""

from __future__ import annotations

import torch
from torch import nn


class MergedLinear(nn.Linear):
    """nn.Linear whose output rows are the concatenation of `output_sizes` checkpoint shards."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool):
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)

    def load_shard(self, param_name: str, loaded: torch.Tensor, shard: int) -> None:
        """Copy checkpoint shard `shard` ("weight" or "bias") into its rows of the merged tensor."""
        offset = sum(self.output_sizes[:shard])
        target = getattr(self, param_name).data.narrow(0, offset, self.output_sizes[shard])
        if target.shape != loaded.shape:
            expected, got = tuple(target.shape), tuple(loaded.shape)
            raise ValueError(f"shard {shard} of {param_name}: expected {expected}, got {got}")
        target.copy_(loaded)
