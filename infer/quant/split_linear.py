"""A fused projection (q/k/v, gate/up) whose parts are quantized in different schemes, run as one layer.

llama.cpp's Q4_K_M files hold some layers' attn_v (and ffn_down) in Q6_K beside Q4_K q and k. One
QuantizedLinear over all three would need one scheme: int8, the int4 codes of q and k a byte each (twice
their bytes, which every decode step reads). Here each run of parts that share a scheme keeps its own
QuantizedLinear (q and k as int4, two codes to a byte; v as int8), and the outputs are put side by side:
one more kernel call and a copy of the output row per layer, replayed in the decode graphs with the rest.
infer.quant.linear.fused_linear builds it.
"""

from __future__ import annotations

import torch
from torch import nn

BACKEND_ORDER = ("infer", "avx2", "torch", "dequant")  # fastest first, as QuantizedLinear picks them


class SplitQuantizedLinear(nn.Module):
    """y = [part_0(x), part_1(x), ...]: the fused layer's outputs in order, each part a QuantizedLinear."""

    def __init__(self, parts: list[nn.Module], output_sizes: list[int]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.output_sizes = list(output_sizes)  # the model splits the fused output by them
        self.bias = None

    @property
    def backend(self) -> str:
        """The slowest of the parts' paths (what the start-up log reports the layer as)."""
        return max((p.backend for p in self.parts), key=BACKEND_ORDER.index)

    @property
    def bits(self) -> int:
        return max(p.bits for p in self.parts)

    @property
    def group_size(self) -> int:
        return self.parts[0].group_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], -1)
