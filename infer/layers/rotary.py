"""Rotary position embeddings (neox style: the head is split in two halves, as in HF Llama).

Where infer/kernels serves the tensors (layer_ops.cpp), q and k are rotated in place in one pass (they
are views of the qkv projection's output, which nothing else reads): one call per layer instead of ~14
torch ops, an order of magnitude faster (docs/optimizations.md, "C++ layer ops"). The torch path below
is the reference it equals (float32 math either way).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from infer import kernels
from infer.layers.rope_config import RopeConfig


def inv_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if rope.freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float64)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        # Llama 3.1+: keep high frequencies, divide low ones by `factor`, blend the band between.
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, scaled)
    if rope.rope_type == "yarn":
        return _yarn(rope, inv_freq, head_dim)
    return inv_freq


def _yarn(rope: RopeConfig, inv_freq: torch.Tensor, head_dim: int) -> torch.Tensor:
    """YaRN (transformers' _compute_yarn_parameters): frequencies that turn more than beta_fast times over
    the original context are kept, fewer than beta_slow divided by `factor`, a linear ramp between
    (over the frequency index, its ends rounded outwards)."""

    def index(rotations: float) -> float:  # the frequency index that turns `rotations` times
        turns = rope.original_max_position_embeddings / (rotations * 2 * math.pi)
        return head_dim * math.log(turns) / (2 * math.log(rope.theta))

    low = max(math.floor(index(rope.beta_fast)), 0)
    high = min(math.ceil(index(rope.beta_slow)), head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
    kept = 1 - ramp.double()  # 1: the frequency as it is, 0: divided by factor
    return inv_freq / rope.factor * (1 - kept) + inv_freq * kept


def attention_factor(rope: RopeConfig) -> float:
    """What YaRN multiplies cos and sin by (1 otherwise)."""
    if rope.rope_type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    return 0.1 * math.log(rope.factor) + 1.0 if rope.factor > 1 else 1.0


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin for every position up to max_positions, looked up by `positions`."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int):
        super().__init__()
        self.rope, self.head_dim, self.max_positions = rope, head_dim, max_positions
        self.init_buffers()

    def init_buffers(self) -> None:
        """Also called by the loader: a model built on the meta device has no real buffers yet."""
        inv_freq = inv_frequencies(self.rope, self.head_dim).float()
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32), inv_freq)
        # [max_positions, head_dim // 2] each, float32 whatever the model dtype
        scale = attention_factor(self.rope)
        self.register_buffer("cos", freqs.cos() * scale, persistent=False)
        self.register_buffer("sin", freqs.sin() * scale, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim]
        ops = kernels.layer_ops(q)
        if (
            ops is not None
            and self.head_dim % 32 == 0
            and k.dtype == q.dtype
            and self.cos.dtype == torch.float32
        ):
            ops.rotary(positions, q, k, self.cos, self.sin)
            return q, k
        cos = self.cos[positions].unsqueeze(1)  # [num_tokens, 1, head_dim // 2]
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)
