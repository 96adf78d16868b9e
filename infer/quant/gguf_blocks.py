"""llama.cpp's quantized blocks read into `QuantizedWeight`s in groups of 32, as the file holds them.

Each block covers 32 consecutive inputs of one output row (ggml-common.h, block_q8_0 / q4_0 / q4_1):

    Q8_0  34 bytes: fp16 d, 32 int8 q                weight = q * d             -> int8, symmetric
    Q4_0  18 bytes: fp16 d, 16 bytes of nibbles       weight = (nibble - 8) * d  -> int4, symmetric
    Q4_1  20 bytes: fp16 d, fp16 m, 16 bytes          weight = nibble * d + m    -> int4 with mins

    nibbles: byte j holds element j of the block (low nibble) and element j + 16 (high nibble)

The codes stay codes: infer/quant/linear.py runs them on the int8 / int4 paths with a group size of 32,
and `QuantizedWeight.dequantize()` equals llama.cpp's own dequantization (gguf.quants) bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch

from infer.quant.weights import QuantizedWeight

BLOCK = 32  # weights per block, every type here
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
BITS = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4}


def unpack_blocks(type_name: str, data: np.ndarray, shape: tuple[int, int]) -> QuantizedWeight:
    """The [out, in] weight held in `data` (the tensor's raw bytes, blocks in row-major order)."""
    out_features, in_features = shape
    if type_name not in BLOCK_BYTES:
        raise ValueError(f"{type_name} is not a block type infer reads (only {', '.join(BLOCK_BYTES)})")
    if in_features % BLOCK:
        raise ValueError(f"{type_name}: {in_features} inputs are not whole blocks of {BLOCK}")
    blocks = in_features // BLOCK
    raw = torch.from_numpy(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    if raw.numel() != out_features * blocks * BLOCK_BYTES[type_name]:
        shape_text = f"[{out_features}, {in_features}]"
        raise ValueError(f"{type_name}: {raw.numel()} bytes do not hold a {shape_text} weight")
    raw = raw.view(out_features, blocks, BLOCK_BYTES[type_name])  # [out, blocks, bytes of a block]
    d = _fp16(raw[..., 0:2])  # [out, blocks]
    if type_name == "Q8_0":
        q = raw[..., 2:].contiguous().view(torch.int8).reshape(out_features, in_features)
        return QuantizedWeight(q, d, None, 8, BLOCK)
    nibbles = raw[..., -BLOCK // 2 :]  # [out, blocks, 16]
    codes = torch.cat([nibbles & 0x0F, nibbles >> 4], -1).to(torch.int8)  # [out, blocks, 32]: 0-15, 16-31
    codes = codes.view(out_features, in_features)
    if type_name == "Q4_0":
        return QuantizedWeight(codes - 8, d, None, 4, BLOCK)
    return QuantizedWeight(codes, d, None, 4, BLOCK, mins=_fp16(raw[..., 2:4]))


def _fp16(pairs: torch.Tensor) -> torch.Tensor:
    """[..., 2] little-endian bytes of fp16 numbers -> float32 [...] (exact)."""
    return pairs.contiguous().view(torch.float16).squeeze(-1).float()


def block_type(weight: QuantizedWeight) -> str:
    """The block type whose layout `weight` has (the inverse of unpack_blocks' choice)."""
    if weight.bits == 8:
        return "Q8_0"
    return "Q4_1" if weight.mins is not None else "Q4_0"
