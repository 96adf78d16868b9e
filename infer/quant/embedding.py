"""A token embedding kept as int8 / int4 codes in groups, its rows dequantized as they are looked up.

Replaces the model's embedding where a GGUF file holds `token_embd` in Q8_0 / Q4_0 / Q4_1: a step reads
one row per token, so dequantizing those rows costs nothing next to the linears, while the table takes
about 1.1 (int8) or 0.6 (int4, two codes a byte) bytes a weight instead of bf16's 2. Each row equals
that row of `QuantizedWeight.dequantize()`, in the model's dtype. Single rank only (the loader refuses
tensor parallelism for quantized files).
"""

from __future__ import annotations

import torch
from torch import nn

from infer.quant.weights import QuantizedWeight


class QuantizedEmbedding(nn.Module):
    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype):
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.bits, self.group_size, self.dtype = weight.bits, weight.group_size, dtype
        # int4: codes shifted to 0..15 (by 8 when signed) and packed, element 2j low nibble, 2j + 1 high
        self.shift = 8 if weight.bits == 4 and weight.zeros is None and weight.mins is None else 0
        codes = weight.q
        if weight.bits == 4:
            unsigned = (codes + self.shift).to(torch.uint8)
            codes = unsigned[:, 0::2] | (unsigned[:, 1::2] << 4)  # [vocab, hidden / 2]
        self.register_buffer("codes", codes.contiguous(), persistent=False)
        self.register_buffer("scales", weight.scales, persistent=False)  # [vocab, groups]
        self.register_buffer("zeros", weight.zeros, persistent=False)
        self.register_buffer("mins", weight.mins, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)  # [num_tokens]
        rows = self.codes[ids]  # [num_tokens, hidden] int8, or [num_tokens, hidden / 2] packed
        if self.bits == 4:
            rows = torch.stack([rows & 0x0F, rows >> 4], -1).view(len(ids), -1).to(torch.int8) - self.shift
        # as QuantizedWeight.dequantize computes it, so that the rows are its rows bit for bit
        codes = rows.float().view(len(ids), -1, self.group_size)  # [num_tokens, groups, group_size]
        if self.zeros is not None:
            codes = codes - self.zeros[ids][..., None]
        weight = codes * self.scales[ids][..., None]
        if self.mins is not None:
            weight = weight + self.mins[ids][..., None]
        return weight.view(*input_ids.shape, self.embedding_dim).to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int{self.bits}, group {self.group_size}"
