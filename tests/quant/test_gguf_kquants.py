"""llama.cpp's K-quants (and Q5_0 / Q5_1) read into QuantizedWeight in groups of 32: Q4_K, Q5_K, Q5_0
and Q5_1 are llama.cpp's own dequantization (the gguf package's gguf.quants) bit for bit; Q6_K is
requantized to int8 within half a step of it. Random bytes with finite fp16 scales are valid blocks
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

EXACT = {"Q4_K": (4, 0, 15), "Q5_K": (8, 0, 31), "Q5_0": (8, -16, 15), "Q5_1": (8, 0, 31)}  # bits, codes
HAS_KERNEL = kernels.bf16_ops() is not None


def _reference(kind: str, data: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(quants.dequantize(data, GGMLQuantizationType[kind]))


@pytest.mark.parametrize("kind", list(EXACT))
def test_exact_types_are_llama_cpps_weights_bit_for_bit(kind):
    data = random_blocks(kind, 48, 512)
    weight = unpack_blocks(kind, data, (48, 512))
    assert torch.equal(weight.dequantize(), _reference(kind, data))
    bits, low, high = EXACT[kind]
    assert (weight.bits, weight.group_size) == (bits, 32)
    assert weight.q.dtype == torch.int8 and (int(weight.q.min()), int(weight.q.max())) == (low, high)
    assert (weight.mins is None) == (kind == "Q5_0")


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


def test_q6_k_is_within_half_a_step_of_llama_cpps_weights():
    data = random_blocks("Q6_K", 48, 512)
    weight = unpack_blocks("Q6_K", data, (48, 512))
    ref = _reference("Q6_K", data)
    step = weight.scales.abs().repeat_interleave(32, 1)
    err = (weight.dequantize() - ref).abs()
    assert (err <= step * (0.5 + 1e-4)).all()  # float32 rounding of the scale: 127 codes x 2^-24
    assert (weight.bits, weight.group_size, weight.mins) == (8, 32, None)
    assert int(weight.q.abs().max()) <= 127
    # random sub-block scales seldom share a factor: most groups are requantized, some kept exact
    exact = (err.view(48, -1, 32).amax(-1) == 0).float().mean()
    assert 0 < exact < 0.5


def test_q6_k_groups_whose_scales_share_a_factor_stay_exact():
    """Sub-block scales 4 and -6 (common factor 2): the codes 2 q and -3 q fit int8, scale 2 d."""
    data = random_blocks("Q6_K", 16, 256).reshape(16, 210)
    scales = np.full(16, 4, dtype=np.int8)
    scales[1::2] = -6
    data[:, 192:208] = scales.view(np.uint8)
    weight = unpack_blocks("Q6_K", data, (16, 256))
    assert torch.equal(weight.dequantize(), _reference("Q6_K", data))
    d = torch.from_numpy(data[:, 208:210].copy().view(np.float16).astype(np.float32))
    assert torch.equal(weight.scales, (d * 2).expand(16, 8))


def test_q6_k_requantization_error_on_trained_looking_weights():
    """The cost on weights of a trained model's spread: the int8 requantization adds a fraction of what
    Q6_K's own rounding costs, in quadrature (docs/quantization.md, GGUF)."""
    w = torch.from_numpy(np.random.default_rng(0).standard_normal((256, 1024)).astype(np.float32) * 0.02)
    data = encode("Q6_K", w.numpy())
    ref = _reference("Q6_K", data)
    ours = unpack_blocks("Q6_K", data, w.shape).dequantize()

    def rms(x):
        return float(x.pow(2).mean().sqrt() / w.pow(2).mean().sqrt())

    # measured, of the weights' RMS: Q6_K's own rounding 0.0193, the requantization 0.0052, both 0.0200
    assert rms(ours - ref) < 0.35 * rms(ref - w)
    assert rms(ours - w) < 1.05 * rms(ref - w)


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
def test_a_fused_layer_of_q4_k_beside_q6_k_keeps_each_types_codes(dtype):
    """Q4_K_M files' q, k in Q4_K beside v in Q6_K: q and k stay int4 (two codes a byte), v int8, and the
    layer's output is the dequantized fused weight's product, q, k, v in order."""
    q, k, v = (
        unpack_blocks(kind, random_blocks(kind, rows, 512, scale=1e-4, seed=rows), (rows, 512))
        for kind, rows in (("Q4_K", 64), ("Q4_K", 32), ("Q6_K", 32))
    )
    layer = fused_linear([q, k, v], None, dtype, [64, 32, 32])
    assert isinstance(layer, SplitQuantizedLinear) and layer.output_sizes == [64, 32, 32]
    int4, int8 = layer.parts
    assert (int4.bits, int4.out_features, int8.bits, int8.out_features) == (4, 96, 8, 32)
    if int4.backend == "infer":  # bf16 on our kernel (float32 dequantizes the int8 part)
        assert int4.qweight.nbytes == 96 * 512 // 2 and int8.qweight.nbytes == 32 * 512
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
    x = torch.randn(7, 512, generator=torch.Generator().manual_seed(0))
    for dtype in (torch.float32, torch.bfloat16):
        ref = x.to(dtype).float() @ weight.dequantize().T
        backends = ["dequant", *(["torch"] if kind == "Q4_K" else [])]
        backends += ["infer"] if dtype == torch.bfloat16 and HAS_KERNEL else []
        for backend in backends:
            for rows in (1, 7):
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
