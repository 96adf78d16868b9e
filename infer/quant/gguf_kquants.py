"""llama.cpp's K-quants (Q4_K, Q5_K, Q6_K) read into `QuantizedWeight`s: groups of 32, Q6_K's of 16.

A super-block covers 256 consecutive inputs of one output row (ggml-common.h, block_q4_K / q5_K / q6_K;
dequantize_row_q*_K in ggml-quants.c):

    Q4_K  144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit scales sc[8] and mins m[8], 128 bytes of
          nibbles. Sub-block j (32 inputs): weight = d * sc[j] * q - dmin * m[j], q in 0..15
    Q5_K  176 bytes: as Q4_K with 32 bytes of fifth bits before the nibbles, q in 0..31
    Q6_K  210 bytes: 128 bytes of low nibbles, 64 of 2-bit highs, int8 sc[16], fp16 d.
          Sub-block j (16 inputs): weight = d * sc[j] * (q - 32), q in 0..63

Q4_K and Q5_K are groups of 32 with a scale and a min, as our int4 / int8 paths run them: scale =
d * sc[j], min = -dmin * m[j] (float32, the products llama.cpp computes), the codes unchanged, so the
weights are llama.cpp's bit for bit. Q6_K stays as it is: 6-bit codes q - 32 in groups of 16, scale
d * sc[j] (exact in float32: an fp16 times an int8), and d kept beside them, so that the kernel
(infer/kernels/six_bit_linear.cpp) holds the int8 sc and one d per 256 inputs, as the file does.
"""

from __future__ import annotations

import torch

from infer.quant.weights import QuantizedWeight

SUPER_BLOCK = 256  # weights per super-block
GROUP = 32  # the group size Q4_K and Q5_K are read into
Q6_K_GROUP = 16  # Q6_K's sub-blocks, each with its own int8 scale
SUPER_BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
LOADS_AS = {
    "Q4_K": "int4 in groups of 32 with mins (the sub-blocks' scales and mins, exact)",
    "Q5_K": "int8 in groups of 32 with mins (5-bit codes, exact)",
    "Q6_K": "6-bit codes in groups of 16 (exact)",
}


def unpack_super_blocks(type_name: str, raw: torch.Tensor) -> QuantizedWeight:
    """The weight held in `raw`: uint8 [out, in / 256, bytes of a super-block]."""
    if type_name == "Q6_K":
        return _q6_k(raw)
    out_features, count, _ = raw.shape
    d, dmin = _fp16(raw[..., 0:2]), _fp16(raw[..., 2:4])  # [out, super-blocks]
    sc, m = scales_and_mins(raw[..., 4:16].contiguous())  # [out, super-blocks, 8]
    # byte l of the i-th 32: input l of sub-block 2i (low nibble) and of sub-block 2i + 1 (high)
    packed = raw[..., -128:].contiguous().view(out_features, count, 4, 1, 32)
    codes = torch.cat([packed & 0x0F, packed >> 4], 3).reshape(out_features, count, 8, 32)
    bits = 4
    if type_name == "Q5_K":
        # bit j of byte l: the fifth bit (16) of input l of sub-block j
        high = raw[..., 16:48].contiguous().view(out_features, count, 1, 32)
        codes = codes | (((high >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1) << 4)
        bits = 8
    scales = (d[..., None] * sc.float()).reshape(out_features, -1)  # [out, groups]
    mins = -(dmin[..., None] * m.float()).reshape(out_features, -1)
    q = codes.to(torch.int8).reshape(out_features, -1)
    return QuantizedWeight(q, scales, None, bits, GROUP, mins=mins)


def scales_and_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., 12] bytes -> the 6-bit scales and mins [..., 8] of Q4_K / Q5_K (get_scale_min_k4): bytes
    0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; bytes 8-11 the low 4 bits of scales 4-7
    (low nibble) and mins 4-7 (high nibble), whose top 2 bits are the top bits of bytes 0-3 / 4-7."""
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = torch.cat([a & 63, (c & 0x0F) | ((a >> 2) & 0x30)], -1)
    m = torch.cat([b & 63, (c >> 4) | ((b >> 2) & 0x30)], -1)
    return sc, m


def q6_k_codes(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q - 32 int8 [out, in], sc int8 [out, in / 16], d float32 [out, in / 256]) of Q6_K super-blocks:
    the weight is d * sc * (q - 32)."""
    out_features, count, _ = raw.shape
    # each half (128 inputs) has 64 bytes of low nibbles and 32 of 2-bit highs: input 32 k + l of the
    # half takes nibble k // 2 (low, high) of byte l + 32 (k % 2) and bits 2k..2k+1 of high byte l
    low = raw[..., 0:128].contiguous().view(out_features, count, 2, 2, 32)  # [out, sb, half, k % 2, l]
    high = raw[..., 128:192].contiguous().view(out_features, count, 2, 32)
    q = torch.empty(out_features, count, 2, 4, 32, dtype=torch.uint8)  # [out, sb, half, k, l]
    q[:, :, :, 0:2] = low & 0x0F
    q[:, :, :, 2:4] = low >> 4
    for k in range(4):
        q[:, :, :, k] |= ((high >> (2 * k)) & 3) << 4
    q = q.view(torch.int8).sub_(32)
    sc = raw[..., 192:208].contiguous().view(torch.int8)  # [out, sb, 16]: one per 16 inputs
    return q.view(out_features, -1), sc.view(out_features, -1), _fp16(raw[..., 208:210])


def _q6_k(raw: torch.Tensor) -> QuantizedWeight:
    q, sc, d = q6_k_codes(raw)
    scales = d.repeat_interleave(SUPER_BLOCK // Q6_K_GROUP, 1) * sc.float()  # [out, in / 16]
    return QuantizedWeight(q, scales, None, 6, Q6_K_GROUP, super_scales=d)


def _fp16(pairs: torch.Tensor) -> torch.Tensor:
    """[..., 2] little-endian bytes of fp16 numbers -> float32 [...] (exact)."""
    return pairs.contiguous().view(torch.float16).squeeze(-1).float()
