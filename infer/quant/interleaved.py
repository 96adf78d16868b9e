"""The layout avx2_linear takes int8 and int4 codes in: output channels in blocks of 8, interleaved.

Within a block of 8 channels the codes run 4 inputs x 8 channels at a time, 32 bytes, channel i's 4 codes at
bytes 4i..4i+3: one 32-byte load then holds a dot product's terms for the 8 channels side by side, and x's 4
inputs broadcast to every lane (infer/kernels/avx2_linear.cpp). int4 codes (0..15) go two a byte: per block
of 32 inputs four such runs, run t holding inputs 4t..4t+3 in its low nibbles and 16 + 4t..16 + 4t + 3 in its
high ones. Scales and offsets: the 8 channels' values of a group side by side. Every tensor keeps its shape
([N, K] int8, [N, K / 2] uint8, [N, groups]); only the order of its elements changes, and channels 8b..8b+7
stay rows 8b..8b+7, so a slice of whole blocks of rows is a slice of channels.
"""

from __future__ import annotations

import torch

CHANNELS = 8  # output channels a block


def interleave_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [N, K] (int8; int4 as 0..15) -> the kernel's layout: int8 [N, K], or uint8 [N, K / 2]."""
    n, k = q.shape
    if bits != 4:  # a byte a code (6-bit codes too)
        return q.view(n // CHANNELS, CHANNELS, k // 4, 4).transpose(1, 2).contiguous().view(n, k)
    # [block of channels, channel, block of 32, half, run, input]
    q = q.to(torch.uint8).view(n // CHANNELS, CHANNELS, k // 32, 2, 4, 4)
    q = q.permute(0, 2, 3, 4, 1, 5)  # [block of channels, block of 32, half, run, channel, input]
    return (q[:, :, 0] | q[:, :, 1] << 4).contiguous().view(n, k // 2)


def deinterleave_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The kernel's layout of whole blocks of channels -> codes [N, K] (int8; int4 as 0..15, uint8)."""
    n = packed.shape[0]
    if bits != 4:  # a byte a code (6-bit codes too)
        k = packed.shape[1]
        return packed.view(n // CHANNELS, k // 4, CHANNELS, 4).transpose(1, 2).reshape(n, k)
    k = packed.shape[1] * 2
    runs = packed.view(n // CHANNELS, k // 32, 4, CHANNELS, 4)
    # [block of channels, block of 32, half, run, channel, input]
    halves = torch.stack([runs & 15, runs >> 4], 2)
    return halves.permute(0, 4, 1, 2, 3, 5).reshape(n, k)


def interleave_groups(t: torch.Tensor) -> torch.Tensor:
    """Per-group values [N, groups] -> each group's 8 channels side by side (same shape)."""
    n, groups = t.shape
    return t.view(n // CHANNELS, CHANNELS, groups).transpose(1, 2).contiguous().view(n, groups)


def deinterleave_groups(t: torch.Tensor) -> torch.Tensor:
    n, groups = t.shape
    return t.view(n // CHANNELS, groups, CHANNELS).transpose(1, 2).reshape(n, groups)
