"""The small-batch bf16 linear (infer/kernels/small_linear.cpp) against float32 math, and which steps
PrepackedLinear sends to it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from infer import kernels
from infer.layers import linear
from infer.layers.linear import PrepackedLinear, can_prepack, pack_pairs

from .test_kernels import _ops


def bf16_ops():
    ops = _ops()
    if "+bf16" not in ops.isa() or not can_prepack(torch.bfloat16):
        pytest.skip(f"the small-batch kernel needs AVX-512 BF16; this CPU's build is {ops.isa()}")
    return ops


def reference(x, weight, bias):
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float())


SHAPES = [(16, 2), (48, 64), (80, 512), (64, 64), (1024, 512), (512, 1376)]


def assert_within_a_bf16_unit(got, expected, unit=2**-8):
    torch.testing.assert_close(got.float(), expected, rtol=unit, atol=unit * expected.abs().max().item())


@pytest.mark.parametrize("out_features, in_features", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_every_row_count_matches_float32(out_features, in_features, bias):
    """1-4 rows (tiles of 4 blocks), 5-8 (tiles of 2), more (chunks of 8 rows and a remainder); tiles
    with 1-4 blocks (48 = 3 blocks, 80 = one tile and 1 block). Built with AMX, 2+ rows of weights whose
    sizes divide by 32 (64 x 64, 1024 x 512, 512 x 1376) run on tiles: passes of 32 rows, the last one
    partial (its own tile shapes), one or two 16-row halves."""
    ops = bf16_ops()
    gen = torch.Generator().manual_seed(out_features + in_features)
    weight = (torch.randn(out_features, in_features, generator=gen) / in_features**0.5).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    packed = pack_pairs(weight)
    for rows in (*range(1, 10), 16, 17, 21, 32, 33, 48, 70, 128):
        x = torch.randn(rows, in_features, generator=gen).bfloat16()
        got = ops.small_linear(x, packed, b)
        expected = reference(x, weight, b)
        # float32 sums, one rounding to bf16 at the end: within one bf16 unit of the exact result
        assert_within_a_bf16_unit(got, expected)
    empty = torch.empty(0, in_features, dtype=torch.bfloat16)
    assert ops.small_linear(empty, packed, b).shape == (0, out_features)


def test_refuses_what_it_cannot_compute():
    ops = bf16_ops()
    weight = pack_pairs(torch.randn(32, 64).bfloat16())
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ops.small_linear(torch.randn(1, 64).bfloat16(), torch.randn(40, 64).bfloat16(), None)
    with pytest.raises(RuntimeError, match="bf16"):
        ops.small_linear(torch.randn(1, 64), weight, None)


@pytest.mark.parametrize("bias", [False, True])
def test_onednn_linear_is_torchs_prepacked_call(bias):
    """The op that makes oneDNN's linear recordable by TorchScript gives torch's own call's values."""
    ops = _ops()
    if not can_prepack(torch.bfloat16):
        pytest.skip("oneDNN has no bf16 here")
    layer = torch.nn.Linear(512, 1000, bias=bias).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), 1)
    for rows in (1, 7, 64):
        x = torch.randn(rows, 512).bfloat16()
        expected = torch.ops.mkldnn._linear_pointwise(x, packed, layer.bias, "none", [], "")
        assert torch.equal(ops.onednn_linear(x, packed, layer.bias), expected)


def test_prepacked_linear_routes_small_weights_and_small_steps(monkeypatch):
    """Steps of up to SMALL_ROWS rows of a small weight go to the kernel, larger ones to oneDNN; a weight
    over SMALL_WEIGHT_BYTES keeps the kernel's copy alone (every step goes to it), except where AMX tiles
    cannot take its sizes. Both paths agree with float32 math."""
    ops = bf16_ops()
    layer = torch.nn.Linear(512, 1024, bias=True).bfloat16()
    small = PrepackedLinear(layer)
    assert small._ops is ops and torch.equal(small.kernel_weight, pack_pairs(layer.weight.detach()))
    calls = []

    class Counting:
        def small_linear(self, x, weight, bias):
            calls.append(x.shape[0])
            return ops.small_linear(x, weight, bias)

    small._ops = Counting()
    x = torch.randn(linear.SMALL_ROWS + 8, 512).bfloat16()
    for rows in (1, linear.SMALL_ROWS, linear.SMALL_ROWS + 1, linear.SMALL_ROWS + 8):
        expected = reference(x[:rows], layer.weight, layer.bias)
        got = small(x[:rows])
        assert_within_a_bf16_unit(got, expected, 2**-7)  # oneDNN's rows too
    assert calls == [1, linear.SMALL_ROWS]

    monkeypatch.setattr(linear, "SMALL_WEIGHT_BYTES", layer.weight.nbytes - 1)
    large = PrepackedLinear(layer)
    assert large.packed_weight is None and torch.equal(large.kernel_weight, pack_pairs(layer.weight.detach()))
    calls.clear()
    large._ops = Counting()
    rows = linear.SMALL_ROWS + 8
    assert_within_a_bf16_unit(large(x[:rows]), reference(x[:rows], layer.weight, layer.bias))
    assert calls == [rows]
    odd = torch.nn.Linear(512, 1040, bias=False).bfloat16()  # 1040 channels: not a multiple of 32
    assert (PrepackedLinear(odd)._ops is None) == kernels.cpu_has_amx()


@pytest.mark.parametrize("bias", [False, True])
def test_gate_up_with_silu_in_the_epilogue_equals_the_two_ops(bias):
    """small_linear_silu over a gate_up weight interleaved in 16-channel groups: the same bits as
    silu_and_mul(small_linear(...)) of the plain weight, on every path (vdpbf16ps up to 6 rows, tiles
    beyond, partial passes of 32 rows, several row blocks)."""
    ops = bf16_ops()
    gen = torch.Generator().manual_seed(7)
    out_features, in_features = 2 * 96, 512
    weight = (torch.randn(out_features, in_features, generator=gen) / in_features**0.5).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    plain, fused = pack_pairs(weight), pack_pairs(linear.interleave_gate_up(weight))
    fused_bias = None if b is None else linear.interleave_gate_up(b)
    for rows in (1, 2, 6, 7, 16, 33, 70, 1100):
        x = (torch.randn(rows, in_features, generator=gen) * 3).bfloat16()
        expected = ops.silu_and_mul(ops.small_linear(x, plain, b))
        assert torch.equal(ops.small_linear_silu(x, fused, fused_bias), expected), rows
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.small_linear_silu(torch.randn(1, 512).bfloat16(), pack_pairs(weight[:48]), None)


def test_gated_prepacked_linear_fuses_silu_only_on_amx():
    """A gate_up projection followed by SiLU (prepack_linears names it) keeps one interleaved kernel copy
    on AMX: silu_and_mul(x) equals the unfused layer's gated product, and forward() still returns
    gate | up in checkpoint order. Without AMX it is an ordinary PrepackedLinear."""
    bf16_ops()
    layer = torch.nn.Linear(256, 2 * 192, bias=True).bfloat16()
    plain, gated = PrepackedLinear(layer), PrepackedLinear(layer, gated=True)
    x = torch.randn(40, 256).bfloat16()
    if not kernels.cpu_has_amx():
        assert not gated.fused_silu
        return
    assert gated.fused_silu and gated.packed_weight is None and not plain.fused_silu
    torch.testing.assert_close(gated(x), plain(x), rtol=0, atol=0)
    expected = _ops().silu_and_mul(plain(x))
    assert torch.equal(gated.silu_and_mul(x), expected)
    assert torch.equal(gated.silu_and_mul(x[:3]), _ops().silu_and_mul(plain(x[:3])))


def test_prepack_linears_fuses_the_gate_up_of_silu_mlps():
    bf16_ops()

    class MLP(torch.nn.Module):
        def __init__(self, act):
            super().__init__()
            self.act = act
            self.gate_up_proj = torch.nn.Linear(64, 128, bias=False).bfloat16()
            self.down_proj = torch.nn.Linear(64, 64, bias=False).bfloat16()

    silu, gelu = MLP(F.silu), MLP(F.gelu)
    assert linear.prepack_linears(silu) == linear.prepack_linears(gelu) == 2
    assert silu.gate_up_proj.fused_silu == kernels.cpu_has_amx()
    assert not gelu.gate_up_proj.fused_silu and not silu.down_proj.fused_silu


@pytest.mark.parametrize("name", ["gelu", "gelu_new", "relu", "silu"])
def test_linear_act_applies_the_activation_in_onednns_epilogue(name, monkeypatch):
    """linear_act over a PrepackedLinear: beyond SMALL_ROWS rows oneDNN applies GELU (erf or tanh) and ReLU
    as a post-op of its GEMM (one call, no separate activation pass) and the values are those of the
    activation of the float32 product, to a bf16 unit; up to SMALL_ROWS rows, and for an activation
    oneDNN has no post-op for, act(linear(x)) as before."""
    from infer.layers.activations import ACTIVATIONS

    bf16_ops()
    act = ACTIVATIONS[name]
    gen = torch.Generator().manual_seed(3)
    layer = torch.nn.Linear(384, 1536, bias=True).bfloat16()
    dense = PrepackedLinear(layer)
    calls = []
    pointwise = torch.ops.mkldnn._linear_pointwise

    class CountingMkldnn:
        @staticmethod
        def _linear_pointwise(x, weight, bias, attr, scalars, algorithm):
            calls.append(attr)
            return pointwise(x, weight, bias, attr, scalars, algorithm)

    monkeypatch.setattr(torch.ops, "mkldnn", CountingMkldnn, raising=False)
    fusable = name != "silu"
    for rows in (linear.SMALL_ROWS, linear.SMALL_ROWS + 1, 600):
        calls.clear()
        x = torch.randn(rows, 384, generator=gen).bfloat16()
        expected = act(reference(x, layer.weight, layer.bias))
        got = linear.linear_act(dense, act, x)
        assert got.shape == (rows, 1536) and got.dtype == torch.bfloat16
        assert_within_a_bf16_unit(got, expected, 2**-7)
        fused = fusable and rows > linear.SMALL_ROWS
        assert calls == ([{"gelu_new": "gelu"}.get(name, name)] if fused else []), (rows, calls)


def test_linear_add_adds_the_residual_in_onednns_epilogue(monkeypatch):
    """linear_add over a PrepackedLinear: beyond SMALL_ROWS rows oneDNN adds the residual as a binary
    post-op of its GEMM (the residual left as it was), to a bf16 unit of the float32 sum; up to
    SMALL_ROWS rows, linear(x) + residual as before."""
    bf16_ops()
    gen = torch.Generator().manual_seed(4)
    layer = torch.nn.Linear(1536, 384, bias=True).bfloat16()
    dense = PrepackedLinear(layer)
    calls = []
    pointwise = torch.ops.mkldnn._linear_pointwise

    class CountingMkldnn:
        class _linear_pointwise:  # noqa: N801 (torch's name)
            @staticmethod
            def binary(x, other, weight, bias, attr):
                calls.append(attr)
                return pointwise.binary(x, other, weight, bias, attr)

    monkeypatch.setattr(torch.ops, "mkldnn", CountingMkldnn, raising=False)
    for rows in (linear.SMALL_ROWS, linear.SMALL_ROWS + 1, 600):
        calls.clear()
        x = torch.randn(rows, 1536, generator=gen).bfloat16()
        residual = torch.randn(rows, 384, generator=gen).bfloat16()
        kept = residual.clone()
        expected = reference(x, layer.weight, layer.bias) + residual.float()
        got = linear.linear_add(dense, x, residual)
        assert got.shape == (rows, 384) and got.dtype == torch.bfloat16 and torch.equal(residual, kept)
        assert_within_a_bf16_unit(got, expected, 2**-7)
        assert calls == (["add"] if rows > linear.SMALL_ROWS else []), (rows, calls)
