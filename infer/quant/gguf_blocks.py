"""llama.cpp's quantized blocks read into `QuantizedWeight`s in groups of 32.

Blocks of 32 consecutive inputs of one output row (ggml-common.h, block_q8_0 / q4_0 / q4_1 / q5_0 /
q5_1), each read as it is, codes and scales unchanged:

    Q8_0  34 bytes: fp16 d, 32 int8 q                        weight = q * d               -> int8
    Q4_0  18 bytes: fp16 d, 16 bytes of nibbles              weight = (nibble - 8) * d    -> int4
    Q4_1  20 bytes: fp16 d, fp16 m, 16 bytes                 weight = nibble * d + m      -> int4, mins
    Q5_0  22 bytes: fp16 d, 4 bytes high bits, 16 bytes      weight = (q5 - 16) * d       -> int8
    Q5_1  24 bytes: fp16 d, fp16 m, 4 bytes, 16 bytes        weight = q5 * d + m          -> int8, mins

    nibbles: byte j holds element j of the block (low nibble) and element j + 16 (high nibble)
    Q5: bit j of the 4 little-endian bytes is the fifth bit (16) of element j

K-quants (super-blocks of 256: Q4_K, Q5_K, Q6_K) are read by infer.quant.gguf_kquants. The codes stay
codes: infer/quant/linear.py runs them on the int8 / int4 paths with a group size of 32 (Q6_K: its
6-bit codes in groups of 16), and `QuantizedWeight.dequantize()` equals llama.cpp's own dequantization
(gguf.quants) bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch

from infer.quant import gguf_kquants
from infer.quant.weights import QuantizedWeight

BLOCK = 32  # weights per block of the types here, and the group size of every weight read
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24}
# what each type runs as, for the start-up log and /server_info
LOADS_AS = {
    "Q8_0": "int8 in groups of 32",
    "Q4_0": "int4 in groups of 32",
    "Q4_1": "int4 in groups of 32",
    "Q5_0": "int8 in groups of 32 (5-bit codes, exact)",
    "Q5_1": "int8 in groups of 32 with mins (5-bit codes, exact)",
    **gguf_kquants.LOADS_AS,
}
TYPES = tuple(LOADS_AS)  # every block type read


def unpack_blocks(type_name: str, data: np.ndarray, shape: tuple[int, int]) -> QuantizedWeight:
    """The [out, in] weight held in `data` (the tensor's raw bytes, blocks in row-major order)."""
    if type_name in gguf_kquants.SUPER_BLOCK_BYTES:
        nbytes = gguf_kquants.SUPER_BLOCK_BYTES[type_name]
        raw = block_bytes(type_name, data, shape, gguf_kquants.SUPER_BLOCK, nbytes)
        return gguf_kquants.unpack_super_blocks(type_name, raw)
    if type_name not in BLOCK_BYTES:
        raise ValueError(f"{type_name} is not a block type infer reads (only {', '.join(TYPES)})")
    raw = block_bytes(type_name, data, shape, BLOCK, BLOCK_BYTES[type_name])  # [out, blocks, bytes]
    out_features, in_features = shape
    d = fp16(raw[..., 0:2])  # [out, blocks]
    if type_name == "Q8_0":
        q = raw[..., 2:].contiguous().view(torch.int8).reshape(out_features, in_features)
        return QuantizedWeight(q, d, None, 8, BLOCK)
    codes = nibbles(raw[..., -BLOCK // 2 :])  # [out, blocks, 32], 0..15
    if type_name in ("Q5_0", "Q5_1"):
        high = raw[..., -BLOCK // 2 - 4 : -BLOCK // 2]  # [out, blocks, 4]: bit j = fifth bit of element j
        codes = codes | (bits(high) << 4)
    codes = codes.to(torch.int8).view(out_features, in_features)
    if type_name == "Q4_0":
        return QuantizedWeight(codes - 8, d, None, 4, BLOCK)
    if type_name == "Q5_0":
        return QuantizedWeight(codes - 16, d, None, 8, BLOCK)
    mins = fp16(raw[..., 2:4])
    return QuantizedWeight(codes, d, None, 4 if type_name == "Q4_1" else 8, BLOCK, mins=mins)


def block_bytes(
    type_name: str, data: np.ndarray, shape: tuple[int, int], block: int, nbytes: int
) -> torch.Tensor:
    """The raw bytes of a [out, in] tensor as [out, in / block, nbytes] uint8, sizes checked."""
    out_features, in_features = shape
    if in_features % block:
        raise ValueError(f"{type_name}: {in_features} inputs are not whole blocks of {block}")
    blocks = in_features // block
    raw = torch.from_numpy(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    if raw.numel() != out_features * blocks * nbytes:
        shape_text = f"[{out_features}, {in_features}]"
        raise ValueError(f"{type_name}: {raw.numel()} bytes do not hold a {shape_text} weight")
    return raw.view(out_features, blocks, nbytes)


def fp16(pairs: torch.Tensor) -> torch.Tensor:
    """[..., 2] little-endian bytes of fp16 numbers -> float32 [...] (exact)."""
    return pairs.contiguous().view(torch.float16).squeeze(-1).float()


def nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32] uint8 codes: the 16 low nibbles, then the 16 high ones."""
    return torch.cat([packed & 0x0F, packed >> 4], -1)


def bits(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 8 n] uint8 0/1: bit j of byte i is element 8 i + j (little-endian)."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((packed[..., None] >> shifts) & 1).flatten(-2)
