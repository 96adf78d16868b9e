"""avx2_linear (infer/kernels/avx2_linear.cpp): bf16 weights and int8 or int4 codes in groups widened to
float32 in registers, at the row counts of decode steps, on CPUs with AVX2 but no AVX-512 BF16."""

from __future__ import annotations

import pytest
import torch

from infer import kernels
from infer.layers.linear import pack_pairs
from infer.quant.interleaved import (
    deinterleave_codes,
    deinterleave_groups,
    interleave_codes,
    interleave_groups,
)

OPS = kernels.avx2_ops()
pytestmark = pytest.mark.skipif(OPS is None, reason="avx2_linear serves CPUs with AVX2 and no AVX-512 BF16")


def _check(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """float32 sums in another order than torch's, then one rounding to x's dtype."""
    assert y.dtype == dtype
    bound = ref.abs() * (2**-8 if dtype == torch.bfloat16 else 1e-5) + 1e-5 * ref.abs().max()
    assert ((y.float() - ref).abs() <= bound).all()


def _packed(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes in the kernel's layout, byte by byte as avx2_linear.cpp's comment states it: channels in blocks
    of 8; int8: runs of 4 inputs x 8 channels (channel i's 4 codes at bytes 4i..4i+3); int4 (0..15): per
    block of 32 inputs four runs, run t with inputs 4t.. in its low nibbles and 16 + 4t.. in its high ones."""
    n, k = q.shape
    out = torch.zeros(n * k // (8 // bits), dtype=torch.uint8)
    u = q.to(torch.uint8)
    for c in range(n):
        base = c // 8 * 8 * k // (8 // bits)
        for i in range(k):
            if bits == 8:
                out[base + i // 4 * 32 + c % 8 * 4 + i % 4] = u[c, i]
            else:
                j = i % 32
                at = base + i // 32 * 128 + j % 16 // 4 * 32 + c % 8 * 4 + j % 4
                out[at] |= u[c, i] << (4 if j >= 16 else 0)
    return out.view(torch.int8).view(n, k) if bits == 8 else out.view(n, k // 2)


def _groups(t: torch.Tensor) -> torch.Tensor:
    """Per-group scales or offsets [N, groups] with each group's 8 channels side by side."""
    n, groups = t.shape
    return t.view(n // 8, 8, groups).transpose(1, 2).contiguous().view(n, groups)


def _codes(bits: int, shape, gen) -> torch.Tensor:
    low, high = (-128, 128) if bits == 8 else (0, 16)
    return torch.randint(low, high, shape, generator=gen, dtype=torch.int8)


# one or two rows (two blocks a tile, and the block left over), row groups of up to 6 (8 rows: 4 + 4)
@pytest.mark.parametrize("out_features", [16, 48, 208])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 8, 13, 100])
def test_bf16_weights_are_the_float32_product(rows, out_features):
    gen = torch.Generator().manual_seed(rows * out_features)
    w = torch.randn(out_features, 96, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16()
    packed = pack_pairs(w)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(rows, 96, generator=gen).to(dtype)
        ref = x.float() @ w.float().T + bias.float()
        _check(OPS.avx2_linear(x, packed, None, None, bias.to(dtype)), ref, dtype)
        _check(OPS.avx2_linear(x, packed, None, None, None), ref - bias.float(), dtype)


def test_a_rows_bf16_outputs_do_not_depend_on_the_rows_beside_it():
    """Every (row, channel) sums its terms in input order whatever the tile: a decode step's row equals
    the same row inside a prompt's step, bit for bit (what batch-invariant outputs and speculative
    decoding's verification need)."""
    gen = torch.Generator().manual_seed(0)
    w = pack_pairs(torch.randn(64, 160, generator=gen).bfloat16())
    x = torch.randn(50, 160, generator=gen)
    whole = OPS.avx2_linear(x, w, None, None, None)
    for rows in (1, 2, 3, 7, 8, 13, 49):
        assert torch.equal(OPS.avx2_linear(x[:rows], w, None, None, None), whole[:rows])
    assert torch.equal(OPS.avx2_linear(x[20:21], w, None, None, None), whole[20:21])


def test_bf16_outputs_round_to_nearest_even_as_torch():
    """Channel c sums inputs 2c and 2c + 1; ties, overflow and NaN (a NaN weight in channel 5) round as
    torch rounds float32 to bf16."""
    w = torch.zeros(16, 32)
    for c in range(16):
        w[c, 2 * c] = w[c, 2 * c + 1] = 1
    w[5, 10] = float("nan")
    pairs = [(1, 2**-8), (1 + 2**-7, 2**-8), (-1, -(2**-8)), (2, 2**-7), (3e38, 3e38), (0, 1)]
    pairs += [(0.1 * c, 0.3 / c) for c in range(1, 11)]
    x = torch.tensor([v for pair in pairs for v in pair]).bfloat16()[None]
    y = OPS.avx2_linear(x, pack_pairs(w.bfloat16()), None, None, None)
    expected = (x.float() @ w.T).bfloat16()
    assert expected[0, 5].isnan() and expected[0, 4].isinf() and expected[0, 0] == 1
    assert torch.equal(y.isnan(), expected.isnan()) and torch.equal(y.nan_to_num(), expected.nan_to_num())


@pytest.mark.parametrize("bits, group", [(8, 16), (8, 32), (8, 96), (4, 32), (4, 64), (4, 192)])
@pytest.mark.parametrize("rows", [1, 3, 4, 7])
@pytest.mark.parametrize("with_offsets", [False, True])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
def test_codes_widened_to_float32_are_their_dequantized_product(rows, bits, group, with_offsets, scale_dtype):
    """Without int8 activations: the float32 product, up to the order of its sums."""
    gen = torch.Generator().manual_seed(rows * group + bits)
    out_features, in_features = 40, 192
    q = _codes(bits, (out_features, in_features), gen)
    groups = (out_features, in_features // group)
    scales = (torch.rand(groups, generator=gen) * 0.01).to(scale_dtype)
    offsets = (torch.randn(groups, generator=gen) * 0.1).to(scale_dtype) if with_offsets else None
    w = q.float().unflatten(1, (-1, group)) * scales[..., None].float()
    w = (w if offsets is None else w + offsets[..., None].float()).flatten(1)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(rows, in_features, generator=gen).to(dtype)
        held = (_groups(scales), None if offsets is None else _groups(offsets))
        _check(OPS.avx2_linear(x, _packed(q, bits), *held, None), x.float() @ w.T, dtype)


def test_bad_arguments_are_refused():
    x = torch.randn(2, 32).bfloat16()
    with pytest.raises(RuntimeError, match="have scales"):
        OPS.avx2_linear(x, torch.zeros(8, 32, dtype=torch.int8), None, None, None)
    with pytest.raises(RuntimeError, match="multiple of 16 channels"):
        OPS.avx2_linear(torch.randn(2, 24).bfloat16(), torch.zeros(8, 24).bfloat16(), None, None, None)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        OPS.avx2_linear(x, torch.zeros(8, 32, dtype=torch.int8), torch.ones(8, 4).half(), None, None)
    with pytest.raises(RuntimeError, match="int4: 32"):
        OPS.avx2_linear(x, torch.zeros(8, 16, dtype=torch.uint8), torch.ones(8, 2).half(), None, None)
    with pytest.raises(RuntimeError, match="multiple of 8 channels"):
        OPS.avx2_linear(x, torch.zeros(6, 32, dtype=torch.int8), torch.ones(6, 1).half(), None, None)
    with pytest.raises(RuntimeError, match=r"int4: \[N, K / 2\]"):
        OPS.avx2_linear(x, torch.zeros(8, 32, dtype=torch.uint8), torch.ones(8, 1).half(), None, None)
    with pytest.raises(RuntimeError, match="float16 or float32"):
        OPS.avx2_linear(x, torch.zeros(8, 32, dtype=torch.int8), torch.ones(8, 1).bfloat16(), None, None)
    with pytest.raises(RuntimeError, match=r"x \[M, K\]"):
        OPS.avx2_linear(torch.randn(2, 16).bfloat16(), torch.zeros(8, 32).bfloat16(), None, None, None)


def _w8a8_reference(x: torch.Tensor, w: torch.Tensor, group: int, scales, offsets) -> torch.Tensor:
    """x rounded to int8 per block of 32 inputs (x * (127 / max|x|), to nearest even) times the codes,
    exact, times the group's scale and the block's; plus each group's offset times its sum of the rounded x:
    the weights' dot product with the rounded x."""
    xf = x.float().unflatten(1, (-1, 32))
    top = xf.abs().amax(-1, keepdim=True)
    block_scale = top / 127
    xq = torch.round(xf * torch.where(top > 0, 127 / top, 0)).flatten(1)  # float32, as the kernel
    per_block = (xq.double().unflatten(1, (-1, 32)) * block_scale.double()).flatten(1)
    wd = w.double().unflatten(1, (-1, group)) * scales.double()[..., None]
    out = per_block @ wd.flatten(1).T
    if offsets is not None:
        sums = per_block.unflatten(1, (-1, group)).sum(-1)  # [rows, groups]
        out += sums @ offsets.double().T
    return out


@pytest.mark.parametrize("rows", [1, 2, 3, 6])
@pytest.mark.parametrize("bits, group", [(8, 16), (8, 32), (8, 64), (8, 192), (4, 32), (4, 64)])
@pytest.mark.parametrize("with_offsets", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_activations_round_x_per_block_of_32_and_sum_exactly(rows, bits, group, with_offsets, dtype):
    """x rounded per block of 32, the products summed exactly in int32, scaled per group and block; the
    offsets times the rounded x's sums. An x already on each block's int8 grid (codes times max / 127)
    loses nothing: the exact product, to the output's rounding."""
    gen = torch.Generator().manual_seed(rows + group + bits)
    out_features, in_features = 40, 192
    q = _codes(bits, (out_features, in_features), gen)
    packed = _packed(q, bits)
    groups = (out_features, in_features // group)
    scales = (torch.rand(groups, generator=gen) * 0.01).half()
    offsets = (torch.randn(groups, generator=gen) * 0.1).half() if with_offsets else None
    w = q.float().unflatten(1, (-1, group)) * scales[..., None].float()
    w = (w if offsets is None else w + offsets[..., None].float()).flatten(1)
    held = (_groups(scales), None if offsets is None else _groups(offsets))

    codes = torch.randint(-127, 128, (rows, in_features), generator=gen)
    codes.view(rows, -1, 32)[:, :, 0] = 127  # each block's max: its scale is 1 / 16, x = codes / 16
    codes[0, :32] = 0  # a block of zeros: scale 0
    on_grid = (codes.float() / 16).to(dtype)
    y = OPS.avx2_linear(on_grid, packed, *held, None, True).double()
    exact = (on_grid.float() @ w.T).double()
    rounding = 2**-8 if dtype == torch.bfloat16 else 1e-5
    assert ((y - exact).abs() <= exact.abs() * rounding + 1e-6 * exact.abs().max()).all()

    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    y = OPS.avx2_linear(x, packed, *held, None, True)
    float_path = OPS.avx2_linear(x, packed, *held, None)
    assert torch.equal(OPS.avx2_linear(x, packed, *held, None, False), float_path)
    ref = _w8a8_reference(x, q, group, scales, offsets)
    assert ((y.double() - ref).abs().amax(1) <= ref.abs().amax(1) * rounding).all()
    assert not torch.equal(y, float_path)


@pytest.mark.parametrize("bits", [8, 4])
def test_the_layout_round_trips_and_is_the_one_the_kernel_reads(bits):
    """infer.quant.interleaved packs codes byte for byte as the kernel's comment states (this file's
    _packed), and unpacks whole blocks of 8 channels back to their codes."""
    gen = torch.Generator().manual_seed(bits)
    q = _codes(bits, (16, 64), gen)
    packed = interleave_codes(q, bits)
    assert torch.equal(packed.view(torch.uint8), _packed(q, bits).view(torch.uint8))
    assert torch.equal(deinterleave_codes(packed, bits).to(torch.int8), q)
    assert torch.equal(deinterleave_codes(packed[8:], bits).to(torch.int8), q[8:])
    scales = torch.randn(16, 2, generator=gen)
    assert torch.equal(interleave_groups(scales), _groups(scales))
    assert torch.equal(deinterleave_groups(interleave_groups(scales)), scales)
