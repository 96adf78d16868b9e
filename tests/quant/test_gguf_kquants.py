"""llama.cpp's K-quants (and Q5_0 / Q5_1) read into QuantizedWeight, in groups of 32 (Q6_K: its 6-bit
codes in groups of 16): each is llama.cpp's own dequantization (the gguf package's gguf.quants) bit for
bit. Random bytes with finite fp16 scales are valid blocks
(every code, scale and min its bits can hold); `encode` makes blocks of weights that look trained."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from infer import kernels
from infer.quant import linear as quant_linear
from infer.quant.embedding import QuantizedEmbedding
from infer.quant.gguf_blocks import unpack_blocks
from infer.quant.gguf_kquants import scales_and_mins
from infer.quant.linear import QuantizedLinear, fused_linear
from infer.quant.split_linear import SplitQuantizedLinear
from tests.quant.kquant_blocks import encode, random_blocks

# bits, group, codes
EXACT = {
    "Q4_K": (4, 32, 0, 15),
    "Q5_K": (8, 32, 0, 31),
    "Q5_0": (8, 32, -16, 15),
    "Q5_1": (8, 32, 0, 31),
    "Q6_K": (6, 16, -32, 31),
}
HAS_KERNEL = kernels.bf16_ops() is not None
HAS_SIX_BIT = HAS_KERNEL and "+vnni" in kernels.bf16_ops().isa()


def _reference(kind: str, data: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(quants.dequantize(data, GGMLQuantizationType[kind]))


@pytest.mark.parametrize("kind", list(EXACT))
def test_exact_types_are_llama_cpps_weights_bit_for_bit(kind):
    data = random_blocks(kind, 48, 512)
    weight = unpack_blocks(kind, data, (48, 512))
    assert torch.equal(weight.dequantize(), _reference(kind, data))
    bits, group, low, high = EXACT[kind]
    assert (weight.bits, weight.group_size) == (bits, group)
    assert weight.q.dtype == torch.int8 and (int(weight.q.min()), int(weight.q.max())) == (low, high)
    assert (weight.mins is None) == (kind in ("Q5_0", "Q6_K"))


def test_q4_k_scales_and_mins_are_the_six_bit_fields():
    """One Q4_K super-block's 12 scale bytes written by hand: scales 0..7 = 1, 2, 62, 63, 5, 33, 48, 17
    and mins 0..7 = 63, 0, 7, 31, 40, 12, 63, 1 (ggml-quants.c's get_scale_min_k4)."""
    sc = [1, 2, 62, 63, 5, 33, 48, 17]
    m = [63, 0, 7, 31, 40, 12, 63, 1]
    packed = [sc[j] | (sc[j + 4] >> 4) << 6 for j in range(4)]
    packed += [m[j] | (m[j + 4] >> 4) << 6 for j in range(4)]
    packed += [(sc[j + 4] & 15) | (m[j + 4] & 15) << 4 for j in range(4)]
    got_sc, got_m = scales_and_mins(torch.tensor(packed, dtype=torch.uint8))
    assert got_sc.tolist() == sc and got_m.tolist() == m


def test_q6_k_packs_into_the_kernels_layout():
    """pack_six_bit's bytes read back by hand as six_bit_linear.cpp reads them: for 16 channels and 16
    inputs, quad i's low nibbles at byte 4c + j of 64 bytes (quads 0, 1 / 2, 3: low / high nibble), its
    top two bits at bits 2i of the last 64; the int8 scale multiples times d are the scales."""
    weight = unpack_blocks("Q6_K", random_blocks("Q6_K", 32, 512), (32, 512))
    codes, multiples, supers = quant_linear.pack_six_bit(weight)
    assert codes.shape == (2, 32 * 192) and codes.dtype == torch.uint8
    blocks = codes.view(2, 32, 192).long()
    back = torch.empty(32, 512, dtype=torch.long)
    for i in range(4):
        low = (blocks[:, :, 64 * (i // 2) : 64 * (i // 2) + 64] >> (4 * (i % 2))) & 15
        top = (blocks[:, :, 128:] >> (2 * i)) & 3
        quad = (low | top << 4).view(2, 32, 16, 4)  # [block, sub-block, channel, input]
        back.view(2, 16, 32, 4, 4)[:, :, :, i] = quad.permute(0, 2, 1, 3)
    assert torch.equal(back - 32, weight.q.long())
    assert torch.equal(multiples.t().float() * supers.t().repeat_interleave(16, 1), weight.scales)
    assert multiples.dtype == torch.int8 and supers.shape == (2, 32)


def test_q6_k_holds_the_files_bytes():
    """0.83 bytes a weight on the kernel path (the file: 210 / 256 = 0.82), where int8 groups took 1.25 (as
    avx2_linear holds them on an AVX2 CPU: a code a byte, a float32 scale a 16)."""
    weight = unpack_blocks("Q6_K", random_blocks("Q6_K", 64, 1024), (64, 1024))
    layer = QuantizedLinear(weight, None, torch.bfloat16)
    held = sum(b.nbytes for b in layer.buffers())
    if layer.backend == "infer":
        assert held == 64 * 1024 * 3 // 4 + 64 * 1024 // 16 + 64 * 4 * 4
    elif layer.backend == "avx2":
        assert held == 64 * 1024 + 64 * 1024 // 16 * 4
    else:
        assert layer.backend == "dequant" and not HAS_SIX_BIT


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_encoded_blocks_hold_the_weights(kind):
    """The test encoder writes the layout gguf.quants reads: its weights come back within each type's
    rounding (relative RMS error, measured 0.078 / 0.038 / 0.019 on Gaussian weights)."""
    w = np.random.default_rng(1).standard_normal((64, 512)).astype(np.float32) * 0.02
    ref = quants.dequantize(encode(kind, w), GGMLQuantizationType[kind])
    error = np.sqrt(((ref - w) ** 2).mean() / (w**2).mean())
    assert error < {"Q4_K": 0.1, "Q5_K": 0.05, "Q6_K": 0.025}[kind]


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K", "Q5_1"])
def test_quantized_embedding_rows_are_the_dequantized_rows(kind):
    data = random_blocks(kind, 40, 256)
    weight = unpack_blocks(kind, data, (40, 256))
    ids = torch.tensor([[0, 1, 2], [17, 38, 39]])
    assert torch.equal(QuantizedEmbedding(weight, torch.float32)(ids), weight.dequantize()[ids])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fused_layer_of_q4_k_beside_q6_k_keeps_each_types_codes(dtype, float_activations):
    """Q4_K_M files' q, k in Q4_K beside v in Q6_K: q and k stay int4 (two codes a byte), v 6-bit, and the
    layer's output is the dequantized fused weight's product, q, k, v in order."""
    q, k, v = (
        unpack_blocks(kind, random_blocks(kind, rows, 512, scale=1e-4, seed=rows), (rows, 512))
        for kind, rows in (("Q4_K", 64), ("Q4_K", 32), ("Q6_K", 32))
    )
    layer = fused_linear([q, k, v], None, dtype, [64, 32, 32])
    assert isinstance(layer, SplitQuantizedLinear) and layer.output_sizes == [64, 32, 32]
    int4, six = layer.parts
    assert (int4.bits, int4.out_features, six.bits, six.out_features) == (4, 96, 6, 32)
    if int4.backend == "infer":  # bf16 on our kernel (float32 dequantizes the 6-bit part)
        assert int4.qweight.nbytes == 96 * 512 // 2
    if six.backend == "infer":
        assert six.qweight.nbytes == 32 * 512 * 3 // 4
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0)).to(dtype)
    ref = x.float() @ torch.cat([w.dequantize() for w in (q, k, v)]).T
    err = (layer(x).float() - ref).abs().max() / ref.abs().max()
    assert err < (2e-2 if dtype == torch.bfloat16 else 1e-4)
    assert type(fused_linear([q, k], None, dtype)) is QuantizedLinear  # one scheme: one layer


@pytest.mark.parametrize("kind", ["Q5_K", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("int8_activations", [True, False])
def test_linear_layers_compute_the_dequantized_product(kind, int8_activations, monkeypatch):
    """int8 codes with mins (Q5_K, Q5_1) on every path, the kernel's offsets included."""
    monkeypatch.setattr(quant_linear, "INT8_ACTIVATIONS", int8_activations)
    weight = unpack_blocks(kind, random_blocks(kind, 48, 512, scale=1e-4), (48, 512))
    x = torch.randn(70, 512, generator=torch.Generator().manual_seed(0))
    for dtype in (torch.float32, torch.bfloat16):
        ref = x.to(dtype).float() @ weight.dequantize().T
        backends = ["dequant", *(["torch"] if kind == "Q4_K" else [])]
        backends += (
            ["infer"] if dtype == torch.bfloat16 and (HAS_SIX_BIT if kind == "Q6_K" else HAS_KERNEL) else []
        )
        for backend in backends:
            for rows in (1, 4, 5, 7, 70):  # six_bit_linear: tiles of 4 rows, a bf16 copy from 64
                layer = QuantizedLinear(weight, None, dtype, backend=backend)
                y = layer(x[:rows].to(dtype)).float()
                err = (y - ref[:rows]).abs().max() / ref[:rows].abs().max()
                assert err < (2e-2 if dtype == torch.bfloat16 else 1e-4), (backend, dtype, rows, err)


def test_bad_super_blocks_are_refused():
    data = random_blocks("Q4_K", 4, 512)
    with pytest.raises(ValueError, match=r"Q4_K: 1152 bytes do not hold a \[4, 768\] weight"):
        unpack_blocks("Q4_K", data, (4, 768))
    with pytest.raises(ValueError, match="Q6_K: 384 inputs are not whole blocks of 256"):
        unpack_blocks("Q6_K", data, (4, 384))
    with pytest.raises(ValueError, match="IQ4_XS is not a block type infer reads"):
        unpack_blocks("IQ4_XS", data, (4, 512))
