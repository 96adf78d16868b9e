"""llama.cpp's Q8_0 / Q4_0 / Q4_1 blocks read into QuantizedWeight: the weight they stand for is the one
llama.cpp's own dequantizers (the gguf package's gguf.quants) give, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from infer import kernels
from infer.quant import linear as quant_linear
from infer.quant.embedding import QuantizedEmbedding
from infer.quant.gguf_blocks import unpack_blocks

TYPES = ["Q8_0", "Q4_0", "Q4_1"]


def _weights(out_features: int, in_features: int) -> np.ndarray:
    """Random weights with the blocks that test the edges: all zero, all negative (Q4_0's scale from the
    most negative value), tiny (fp16 subnormal scales), one outlier, a constant block."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((out_features, in_features)) * 0.05).astype(np.float32)
    w[0, :32] = 0
    w[1, :32] = -np.abs(w[1, :32])
    w[2, :32] *= 1e-6
    w[3, :32] = 0.001
    w[3, 5] = 4.0
    w[4, 32:64] = 0.25
    return w


@pytest.mark.parametrize("kind", TYPES)
def test_dequantized_weight_is_llama_cpps_bit_for_bit(kind):
    w = _weights(48, 128)
    data = quants.quantize(w, GGMLQuantizationType[kind])  # [rows, bytes]: the file's blocks
    weight = unpack_blocks(kind, data, (48, 128))
    ref = torch.from_numpy(quants.dequantize(data, GGMLQuantizationType[kind]))
    assert torch.equal(weight.dequantize(), ref)
    assert weight.group_size == 32 and weight.bits == (8 if kind == "Q8_0" else 4)
    assert (weight.mins is not None) == (kind == "Q4_1")
    # the codes stay codes: int8 in their range, never floats
    assert weight.q.dtype == torch.int8
    low, high = {"Q8_0": (-128, 127), "Q4_0": (-8, 7), "Q4_1": (0, 15)}[kind]
    assert low <= int(weight.q.min()) and int(weight.q.max()) <= high


@pytest.mark.parametrize("kind", TYPES)
def test_quantized_embedding_rows_are_the_dequantized_rows(kind):
    """The embedding keeps the codes (int4 two a byte) and gives each row bit for bit as dequantize()."""
    data = quants.quantize(_weights(48, 128), GGMLQuantizationType[kind])
    weight = unpack_blocks(kind, data, (48, 128))
    ids = torch.tensor([[0, 1, 2], [3, 4, 47]])
    embedding = QuantizedEmbedding(weight, torch.float32)
    assert torch.equal(embedding(ids), weight.dequantize()[ids])
    assert embedding.codes.numel() == 48 * 128 * weight.bits // 8
    bf16 = QuantizedEmbedding(weight, torch.bfloat16)(ids)
    assert torch.equal(bf16, weight.dequantize(torch.bfloat16)[ids])


def test_nibbles_hold_elements_j_and_j_plus_16():
    """One Q4_0 block written by hand: scale 1.0, byte j = code j (low nibble) | code j + 16 (high)."""
    codes = np.arange(32) % 16  # element i has code i % 16
    packed = (codes[:16] | (codes[16:] << 4)).astype(np.uint8)
    block = np.concatenate([np.array([1.0], dtype=np.float16).view(np.uint8), packed])  # 18 bytes
    weight = unpack_blocks("Q4_0", block[None], (1, 32))
    assert weight.dequantize()[0].tolist() == [float(c - 8) for c in codes]
    q4_1 = np.concatenate([np.array([0.5, -1.0], dtype=np.float16).view(np.uint8), packed])  # d, m
    assert unpack_blocks("Q4_1", q4_1[None], (1, 32)).dequantize()[0].tolist() == [
        c * 0.5 - 1.0 for c in codes
    ]


def test_rows_reorder_every_part_of_the_weight():
    """What the loader does to llama's permuted q/k rows: the codes, scales and mins move together."""
    data = quants.quantize(_weights(8, 64), GGMLQuantizationType.Q4_1)
    weight = unpack_blocks("Q4_1", data, (8, 64))
    order = torch.tensor([3, 0, 7, 1, 2, 6, 4, 5])
    assert torch.equal(weight.rows(order).dequantize(), weight.dequantize()[order])


def test_bad_blocks_are_refused():
    data = quants.quantize(_weights(8, 64)[:4], GGMLQuantizationType.Q8_0)
    with pytest.raises(ValueError, match=r"bytes do not hold a \[4, 96\] weight"):
        unpack_blocks("Q8_0", data, (4, 96))
    with pytest.raises(ValueError, match="not whole blocks of 32"):
        unpack_blocks("Q8_0", data, (4, 60))
    with pytest.raises(ValueError, match="IQ4_NL is not a block type"):
        unpack_blocks("IQ4_NL", data, (4, 64))


HAS_KERNEL = kernels.bf16_ops() is not None


@pytest.mark.skipif(not HAS_KERNEL, reason="the kernel needs AVX-512 BF16")
@pytest.mark.parametrize(
    ("kind", "bytes_per_block"), [("Q8_0", 32 + 2 + 2), ("Q4_0", 16 + 2), ("Q4_1", 16 + 4)]
)
def test_kernel_layers_hold_the_files_bytes_and_its_weights(kind, bytes_per_block, monkeypatch):
    """The kernel holds a block of 32 as the file does: its codes, a float16 scale (the file's d, exact),
    Q4_1's min (float16, exact), no offset for Q4_0 (code 8 is its zero) and Q8_0's code sum in int16
    (for int8 activations): 36 / 18 / 20 bytes where the file has 34 / 18 / 20. Its product is the
    file's dequantized weight's, on the bf16 decode and the int8-activation paths."""
    data = quants.quantize(_weights(64, 512), GGMLQuantizationType[kind])
    weight = unpack_blocks(kind, data, (64, 512))
    for int8_activations in (False, True):
        monkeypatch.setattr(quant_linear, "INT8_ACTIVATIONS", int8_activations)
        layer = quant_linear.QuantizedLinear(weight, None, torch.bfloat16, backend="infer")
        held = sum(b.nbytes for b in layer.buffers())
        assert held == 64 * 512 // 32 * bytes_per_block
        assert layer.scales.dtype == torch.float16 and (layer.offsets is None) == (kind != "Q4_1")
        x = torch.randn(7, 512, generator=torch.Generator().manual_seed(0)).bfloat16()
        ref = x.float() @ torch.from_numpy(quants.dequantize(data, GGMLQuantizationType[kind])).T
        for rows in (1, 7):
            err = (layer(x[:rows]).float() - ref[:rows]).abs().max() / ref[:rows].abs().max()
            assert err < 2e-2, (int8_activations, rows, err)
