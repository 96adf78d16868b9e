"""bf16 linears on a CPU without bf16 arithmetic: avx2_linear at every row count where the kernels are
built; else float32 matmuls above WIDEN_ROWS rows on weights widened a slice at a time, torch's bf16
matmul below (infer/layers/widened_linear.py)."""

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
from infer.models.loader import load_model, num_parameters

from .test_loader import forward_logits

KERNELS = kernels.avx2_ops() is not None


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, WIDEN_ROWS, WIDEN_ROWS + 1, 300])
@pytest.mark.parametrize("out_features", [200, 203])  # 203: the kernel's copy padded to 208 channels
def test_every_step_is_the_float32_product_rounded_once(monkeypatch, rows, bias, out_features):
    monkeypatch.setattr(widened_linear, "WIDEN_SLICE_ELEMENTS", 64 * 48)  # several slices, one short
    torch.manual_seed(0)
    linear = nn.Linear(48, out_features, bias=bias).to(torch.bfloat16).requires_grad_(False)
    layer = WidenedLinear(linear)
    x = torch.randn(2, rows, 48).to(torch.bfloat16)
    got = layer(x)
    assert got.shape == (2, rows, out_features) and got.dtype == torch.bfloat16
    if 2 * rows <= WIDEN_ROWS and not KERNELS:
        assert torch.equal(got, F.linear(x, linear.weight, linear.bias))  # torch's bf16 path, as it was
    else:  # float32 products: widened in registers (avx2_linear) or slice by slice
        wide = F.linear(
            x.float(), linear.weight.float(), None if linear.bias is None else linear.bias.float()
        )
        torch.testing.assert_close(got.float(), wide, rtol=2**-8, atol=1e-6)  # one bf16 rounding
    assert torch.equal(layer(x.float()), layer(x.float()))  # float32 x: float32 out, as the model's dtype
    assert layer(x.float()).dtype == torch.float32 or not KERNELS


def test_widening_keeps_merged_projections_their_shards_and_counts_the_weights():
    model = nn.Sequential(MergedLinear(32, [16, 32], bias=False), nn.Linear(48, 8)).to(torch.bfloat16)
    model.requires_grad_(False)
    params = num_parameters(model)
    model.append(nn.Linear(8, 4))  # float32: left as it is
    assert widen_linears(model) == 2
    assert isinstance(model[0], WidenedLinear) and model[0].output_sizes == [16, 32]
    assert isinstance(model[1], WidenedLinear) and type(model[2]) is nn.Linear
    assert num_parameters(model) == params + 8 * 4 + 4
    if KERNELS:  # the kernel's copy alone, padded to 16 channels
        assert not hasattr(model[1], "weight") and model[1].kernel_weight.shape == (16, 48)


def test_a_bf16_model_on_a_cpu_without_bf16_arithmetic_widens_and_keeps_its_embedding(monkeypatch):
    monkeypatch.setattr(loader, "can_prepack", lambda dtype: False)
    monkeypatch.setattr(loader, "widens", lambda dtype: dtype == torch.bfloat16)
    widened, _, _ = load_model(None, dtype="bfloat16")
    plain, _, _ = load_model(None, dtype="bfloat16", prepack=False)
    layers = [m for m in widened.modules() if isinstance(m, WidenedLinear)]
    assert layers and not any(type(m) is nn.Linear for m in widened.modules())
    assert num_parameters(widened) == num_parameters(plain)  # a tied head's copy is not counted twice
    assert torch.equal(widened.input_embeddings().weight, plain.input_embeddings().weight)
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


@pytest.mark.skipif(not KERNELS, reason="float32 activations over bf16 weights need avx2_linear")
def test_a_bf16_checkpoint_under_auto_runs_float32_activations_over_its_bf16_weights(monkeypatch):
    """`--dtype auto` on a CPU without bf16 arithmetic (loader.widens_activations): float32 everywhere but
    the linears, which keep the checkpoint's bf16 values; the KV cache `auto` stays bf16."""
    from infer.runner.kv_cache import auto_cache_dtype

    monkeypatch.setattr(loader, "can_prepack", lambda dtype: False)
    monkeypatch.setattr(loader, "widens", lambda dtype: dtype == torch.bfloat16)
    wide, cfg, _ = load_model(None, dtype="auto")
    bf16, _, _ = load_model(None, dtype="bfloat16", prepack=False)
    fp32, _, _ = load_model(None, dtype="float32", prepack=False)
    assert cfg.dtype == "bfloat16" and next(wide.parameters()).dtype == torch.float32
    assert auto_cache_dtype(wide) == torch.bfloat16 and auto_cache_dtype(fp32) == torch.float32
    layers = [m for m in wide.modules() if isinstance(m, WidenedLinear)]
    assert len(layers) == sum(isinstance(m, nn.Linear) for m in bf16.modules())  # the tied head too
    assert all(m.kernel_weight.dtype == torch.bfloat16 for m in layers)
    assert num_parameters(wide) == num_parameters(bf16)
    # the embedding holds the same values, widened; the activations follow the float32 model's
    assert torch.equal(wide.input_embeddings().weight, bf16.input_embeddings().weight.float())
    ids = list(range(1, 40))
    a, b, ref = forward_logits(wide, ids), forward_logits(bf16, ids), forward_logits(fp32, ids)
    assert a.dtype == torch.float32
    assert (a - ref).abs().max() < (b.float() - ref).abs().max()  # nearer the float32 reference
    assert (a.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
