"""K-quant super-blocks for tests, which the gguf package cannot quantize to (it dequantizes them only).

`random_blocks`: random bytes with finite fp16 d / dmin are valid blocks of every type (each code, scale
and min any value its bits hold), the test of an unpacker. `encode`: a plain round-to-nearest K-quant
encoder (sub-block scales from each sub-block's range, no search for better ones, unlike llama.cpp's
make_qkx2_quants), packed as ggml-quants.c's quantize_row_q*_K_ref writes the bytes: weights that look
like a trained model's, for the model tests and the perplexity measurement.
"""

from __future__ import annotations

import numpy as np

SUPER_BLOCK = 256
# type -> (bytes of a block, weights of a block, offsets of its fp16 numbers in the block)
LAYOUT = {
    "Q4_K": (144, 256, (0, 2)),
    "Q5_K": (176, 256, (0, 2)),
    "Q6_K": (210, 256, (208,)),
    "Q5_0": (22, 32, (0,)),
    "Q5_1": (24, 32, (0, 2)),
}


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0, scale: float = 1e-3) -> np.ndarray:
    """[rows, bytes] of random blocks, their fp16 d (and dmin / m) ~ N(0, scale), the rest random bytes."""
    nbytes, weights, floats = LAYOUT[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // weights, nbytes), dtype=np.uint8)
    for at in floats:
        values = (rng.standard_normal(raw.shape[:2]) * scale).astype(np.float16)
        raw[..., at : at + 2] = values[..., None].view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def encode(kind: str, w: np.ndarray) -> np.ndarray:
    """[rows, cols] float weights (cols a multiple of 256) -> [rows, bytes] of `kind` super-blocks."""
    rows, cols = w.shape
    x = w.astype(np.float32).reshape(rows, cols // SUPER_BLOCK, -1)  # [rows, super-blocks, 256]
    if kind == "Q6_K":
        return _q6_k(x).reshape(rows, -1)
    levels = 15 if kind == "Q4_K" else 31
    sub = x.reshape(*x.shape[:2], 8, 32)
    lo = np.minimum(sub.min(-1), 0)
    hi = sub.max(-1)
    d, sc = _six_bit((hi - lo) / levels)  # [.., 1], [.., 8]
    dmin, m = _six_bit(-lo)
    scale = d * sc
    safe = np.where(scale > 0, scale, 1)[..., None]
    q = np.where(scale[..., None] > 0, np.round((sub + (dmin * m)[..., None]) / safe), 0)
    q = np.clip(q, 0, levels).astype(np.uint8)  # [.., 8, 32]
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    scales = np.concatenate(
        [
            (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6),
            (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6),
            (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4),
        ],
        -1,
    )  # [.., 12]
    low = q & 0x0F
    nibbles = (low[..., 0::2, :] | (low[..., 1::2, :] << 4)).reshape(*x.shape[:2], 128)
    parts = [_f16_bytes(d[..., 0]), _f16_bytes(dmin[..., 0]), scales]
    if kind == "Q5_K":
        high = ((q >> 4) << np.arange(8, dtype=np.uint8)[:, None]).sum(-2, dtype=np.uint8)  # [.., 32]
        parts.append(high)
    return np.concatenate([*parts, nibbles], -1).reshape(len(w), -1)


def _six_bit(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """values >= 0 [.., 8] -> (fp16-exact super-scale [.., 1], integers 0..63 [.., 8]) with their product
    near the values."""
    top = values.max(-1, keepdims=True)
    d = (top / 63).astype(np.float16).astype(np.float32)
    ints = np.clip(np.round(values / np.where(d > 0, d, 1)), 0, 63)
    return d, np.where(d > 0, ints, 0)


def _q6_k(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(*x.shape[:2], 16, 16)
    scale = np.abs(sub).max(-1) / 31  # [.., 16]: q - 32 in -31..31
    d = (scale.max(-1, keepdims=True) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d > 0, d, 1)), -128, 127)
    step = d * sc
    q = np.where(step[..., None] > 0, np.round(sub / np.where(step > 0, step, 1)[..., None]), 0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(*x.shape[:2], 2, 4, 32)  # [.., half, k, l]
    low = q & 0x0F
    ql = (low[..., 0:2, :] | (low[..., 2:4, :] << 4)).reshape(*x.shape[:2], 128)
    qh = ((q >> 4) << np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]).sum(-2, dtype=np.uint8)
    scales = sc.astype(np.int8).view(np.uint8)
    return np.concatenate([ql, qh.reshape(*x.shape[:2], 64), scales, _f16_bytes(d[..., 0])], -1)


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)[..., None].view(np.uint8).reshape(*values.shape, 2)
