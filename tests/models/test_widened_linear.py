"""bf16 linears on a CPU without bf16 arithmetic: float32 matmuls above WIDEN_ROWS rows on weights widened a
slice at a time, avx2_linear (or torch's bf16 matmul) below (infer/layers/widened_linear.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from infer import kernels
from infer.layers import widened_linear
from infer.layers.linear import MergedLinear
from infer.layers.widened_linear import WIDEN_ROWS, WidenedLinear, widen_linears
from infer.models import loader
from infer.models.loader import load_model

from .test_loader import forward_logits


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, WIDEN_ROWS, WIDEN_ROWS + 1, 300])
def test_rows_above_the_threshold_are_float32_products_rounded_once(monkeypatch, rows, bias):
    monkeypatch.setattr(widened_linear, "WIDEN_SLICE_ELEMENTS", 64 * 48)  # several slices, one short
    torch.manual_seed(0)
    linear = nn.Linear(48, 200, bias=bias).to(torch.bfloat16).requires_grad_(False)
    layer = WidenedLinear(linear)
    assert widened_linear.slice_rows(48) == 64
    x = torch.randn(2, rows, 48).to(torch.bfloat16)
    got = layer(x)
    assert got.shape == (2, rows, 200) and got.dtype == torch.bfloat16
    if 2 * rows <= WIDEN_ROWS and kernels.avx2_ops() is None:
        assert torch.equal(got, F.linear(x, linear.weight, linear.bias))  # torch's bf16 path, as it was
    else:  # avx2_linear at few rows: float32 products too, widened in registers
        wide = F.linear(
            x.float(), linear.weight.float(), None if linear.bias is None else linear.bias.float()
        )
        torch.testing.assert_close(got.float(), wide, rtol=2**-8, atol=1e-6)  # one bf16 rounding


def test_widening_keeps_the_parameters_and_merged_projections_their_shards():
    model = nn.Sequential(MergedLinear(32, [16, 32], bias=False), nn.Linear(48, 8)).to(torch.bfloat16)
    model.requires_grad_(False)
    weights = [m.weight for m in model]
    model.append(nn.Linear(8, 4))  # float32: left as it is
    assert widen_linears(model) == 2
    assert isinstance(model[0], WidenedLinear) and model[0].output_sizes == [16, 32]
    assert [m.weight for m in model[:2]] == weights and type(model[2]) is nn.Linear


def test_a_bf16_model_on_a_cpu_without_bf16_arithmetic_widens_and_keeps_its_head_tied(monkeypatch):
    monkeypatch.setattr(loader, "can_prepack", lambda dtype: False)
    monkeypatch.setattr(loader, "widens", lambda dtype: dtype == torch.bfloat16)
    widened, _, _ = load_model(None, dtype="bfloat16")
    plain, _, _ = load_model(None, dtype="bfloat16", prepack=False)
    layers = [m for m in widened.modules() if isinstance(m, WidenedLinear)]
    assert layers and not any(type(m) is nn.Linear for m in widened.modules())
    if widened.config.tie_word_embeddings:
        assert widened.lm_head.weight is widened.input_embeddings().weight
    ids = list(range(1, 40))
    a, b = forward_logits(widened, ids), forward_logits(plain, ids)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9
    torch.testing.assert_close(a, b, rtol=0, atol=0.1 * b.abs().max().item())


@pytest.mark.parametrize("backend", ["torch", "dequant"])
def test_quantized_int8_layers_widen_wide_steps_too(monkeypatch, backend):
    """int8 per channel on torch's kernel, and a dequantized weight: above their thresholds the codes times
    their scales in float32, one rounding; at or below them the path they had."""
    from infer.quant import linear as quant_linear
    from infer.quant.linear import TORCH_WIDEN_ROWS, QuantizedLinear
    from infer.quant.weights import quantize

    monkeypatch.setattr(quant_linear, "widens", lambda dtype: dtype == torch.bfloat16)
    monkeypatch.setattr(widened_linear, "WIDEN_SLICE_ELEMENTS", 64 * 96)
    torch.manual_seed(0)
    weight = quantize(torch.randn(160, 96), 8)
    layer = QuantizedLinear(weight, None, torch.bfloat16, backend=backend)
    plain = QuantizedLinear(weight, None, torch.bfloat16, backend=backend)
    plain._widens = False
    threshold = TORCH_WIDEN_ROWS if backend == "torch" else WIDEN_ROWS
    for rows in (threshold, threshold + 1, 200):
        x = torch.randn(rows, 96).to(torch.bfloat16)
        got = layer(x)
        if rows <= threshold:
            assert torch.equal(got, plain(x))
        else:
            if backend == "torch":  # its scales are held in the model's dtype
                held = weight.q.float() * weight.scales.to(torch.bfloat16).float().view(-1, 1)
            else:
                held = weight.dequantize(torch.bfloat16).float()
            wide = F.linear(x.float(), held)
            torch.testing.assert_close(got.float(), wide, rtol=2**-8, atol=1e-5)
