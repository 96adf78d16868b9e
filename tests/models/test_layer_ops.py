"""The C++ layer ops (infer/kernels/layer_ops.cpp: RMSNorm, its fused residual add, rotary in place,
SiLU-and-multiply, the KV cache write, the greedy argmax) against the torch reference of the layers they
replace, and a bf16 model through both paths."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from infer import kernels
from infer.layers.attention_metadata import AttentionMetadata
from infer.layers.norms import RMSNorm
from infer.layers.rotary import RotaryEmbedding, _rotate
from infer.models.loader import load_model

from .test_kernels import _ops
from .tiny_models import save_tiny_model

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IDS = ["fp32", "bf16", "fp16"]
# one unit in the last place of each dtype (relative): the sums run in another order than torch's
ULP = {torch.float32: 1e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def close(got, expected, dtype):
    torch.testing.assert_close(got.float(), expected.float(), rtol=ULP[dtype], atol=ULP[dtype])


def torch_path(monkeypatch):
    monkeypatch.setattr(kernels, "layer_ops", lambda x: None)


@pytest.mark.parametrize("rows, width", [(1, 64), (5, 512), (513, 512), (33, 2048)])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@torch.no_grad()
def test_rms_norm_and_fused_add_match_the_reference(dtype, rows, width, monkeypatch):
    _ops()
    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(width, 1e-5).to(dtype)
    norm.weight.copy_(torch.randn(width, generator=gen))
    x = (torch.randn(rows, width, generator=gen) * 3).to(dtype)
    residual = torch.randn(rows, width, generator=gen).to(dtype)
    got, (got_add, got_sum) = norm(x), norm.add(x.clone(), residual.clone())
    torch_path(monkeypatch)
    close(got, norm(x), dtype)
    expected_add, expected_sum = norm.add(x, residual)
    assert torch.equal(got_sum, expected_sum)  # the residual stream itself: one rounding of the same sum
    close(got_add, expected_add, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@torch.no_grad()
def test_rotary_in_place_on_views_of_qkv(dtype, monkeypatch):
    _ops()
    from infer.layers.rope_config import RopeConfig

    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), head_dim=64, max_positions=300)
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(11, (8 + 2 * 4) * 64, generator=gen).to(dtype)
    positions = torch.randint(0, 300, (11,), generator=gen)
    q, k, v = (t.view(11, -1, 64) for t in qkv.split([512, 256, 256], dim=1))
    expected_v = v.clone()
    cos, sin = rotary.cos[positions].unsqueeze(1), rotary.sin[positions].unsqueeze(1)
    expected = _rotate(q, cos, sin), _rotate(k, cos, sin)
    got = rotary(positions, q, k)
    assert got[0].data_ptr() == q.data_ptr()  # in place, in qkv
    for g, e in zip(got, expected, strict=True):
        close(g, e, dtype)
    assert torch.equal(v, expected_v)  # v, beside them in qkv, untouched


@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@torch.no_grad()
def test_silu_and_mul_matches_the_reference(dtype, rows):
    ops = _ops()
    x = (torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(rows)) * 4).to(dtype)
    close(ops.silu_and_mul(x), F.silu(x[:, :1536]) * x[:, 1536:], dtype)


@pytest.mark.parametrize("tokens", [1, 7, 300])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_write_cache_is_index_put(dtype, tokens):
    """A step's k and v (views of qkv, tokens strided) into scattered slots of both caches, as the
    index_put it replaces writes them; every other slot untouched."""
    check_write_cache(_ops(), dtype, tokens)


@pytest.mark.parametrize("tokens", [1, 300])
@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_write_cache_rounds_float32_into_a_16_bit_cache(half, tokens):
    """A float32 model's keys and values into a bf16 or fp16 cache: each rounded as torch's .to() rounds
    (ties to even, NaN, overflow to inf), as the index_put of the converted rows writes them."""
    check_write_cache(_ops(), torch.float32, tokens, cache_dtype=half, special=True)


def check_write_cache(ops, dtype, tokens, cache_dtype=None, special=False) -> None:
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (8 + 2 * 4) * 64, generator=gen).to(dtype)
    if special:  # a bf16 tie, its neighbours, NaN, infinities, beyond float16's range, a subnormal
        ties = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, math.nan, math.inf, -math.inf])
        qkv[0, 512 : 512 + 10] = torch.cat([ties, torch.tensor([7e4, -1e5, 1e-6, 3e-8])])
    _, k, v = (t.view(tokens, -1, 64) for t in qkv.split([512, 256, 256], dim=1))
    cache_dtype = cache_dtype or dtype
    caches = [torch.randn(40, 16, 4, 64, generator=gen).to(cache_dtype) for _ in range(2)]
    slots = torch.randperm(40 * 16, generator=gen)[:tokens]
    expected = [c.clone() for c in caches]
    expected[0].view(-1, 4, 64)[slots] = k.to(cache_dtype)
    expected[1].view(-1, 4, 64)[slots] = v.to(cache_dtype)
    ops.write_cache(k, v, *caches, slots)
    for got, want in zip(caches, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_bad_arguments_raise():
    ops = _ops()
    x = torch.randn(4, 64)
    with pytest.raises(RuntimeError, match="multiple of"):
        ops.rms_norm(torch.randn(4, 36), torch.ones(36), 1e-5)  # no multiple of 8 or 16 lanes
    with pytest.raises(RuntimeError, match="dtype"):
        ops.rms_norm(x, torch.ones(64, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(RuntimeError, match="same shape"):
        ops.add_rms_norm(x, torch.randn(5, 64), torch.ones(64), 1e-5)
    q, k = torch.randn(2, 4, 64), torch.randn(2, 2, 64)
    table = torch.randn(10, 32)
    with pytest.raises(RuntimeError, match="position out of"):
        ops.rotary(torch.tensor([0, 10]), q, k, table, table)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        ops.silu_and_mul(torch.randn(2, 64, dtype=torch.float64))
    cache = torch.zeros(2, 16, 2, 64)
    with pytest.raises(RuntimeError, match="slot out of range"):
        ops.write_cache(k, k, cache, cache.clone(), torch.tensor([3, 32]))
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.write_cache(k.half(), k.half(), cache.bfloat16(), cache.bfloat16(), torch.tensor([3, 4]))


@pytest.mark.parametrize("name", ["llama_bias", "qwen3"])  # head_dim 32: the rotary kernel serves them
@torch.no_grad()
def test_bf16_model_through_both_paths(name, tmp_path, monkeypatch):
    """Logits of a bf16 model (norms with fused adds, rotary, SiLU) with the ops and without."""
    _ops()
    _, path = save_tiny_model(name, tmp_path)
    model, _, _ = load_model(str(path), dtype="bfloat16")
    lens = [9, 1, 23]
    input_ids = torch.randint(
        2, model.config.vocab_size, (sum(lens),), generator=torch.Generator().manual_seed(0)
    )
    positions = torch.cat([torch.arange(n) for n in lens])

    def logits():
        return model.compute_logits(model(input_ids, positions, AttentionMetadata.prefill_only(lens)))

    got = logits()
    torch_path(monkeypatch)
    expected = logits()
    torch.testing.assert_close(got, expected, rtol=0.02, atol=0.02)
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.95


def check_layer_ops(ops) -> None:
    """Each op in every dtype against its torch reference, at widths of one and several vectors (also
    run on the AVX2 and plain C++ builds by test_kernels.py's test_other_isas)."""
    for dtype in DTYPES:
        for width in (16, 48, 512):
            x = (torch.randn(7, width) * 3).to(dtype)
            weight, residual = torch.randn(width).to(dtype), torch.randn(7, width).to(dtype)
            xf = x.float()
            norm = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
            close(ops.rms_norm(x, weight, 1e-5), norm, dtype)
            summed, got = residual.clone(), x.clone()
            ops.add_rms_norm(got, summed, weight, 1e-5)
            assert torch.equal(summed, x + residual)
            close(ops.silu_and_mul(torch.cat([x, residual], 1)), F.silu(x) * residual, dtype)
        q, k = torch.randn(5, 4, 64).to(dtype), torch.randn(5, 2, 64).to(dtype)
        cos, sin, positions = torch.randn(9, 32), torch.randn(9, 32), torch.tensor([0, 8, 3, 3, 1])
        expected = [_rotate(t, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)) for t in (q, k)]
        ops.rotary(positions, q, k, cos, sin)
        close(q, expected[0], dtype)
        close(k, expected[1], dtype)
        check_write_cache(ops, dtype, 33)
        check_argmax(ops, dtype)


def check_argmax(ops, dtype) -> None:
    """argmax_rows is torch.argmax exactly: widths below, at and between its blocks, equal maxima (the
    first wins), a NaN (it wins), infinities, rows mostly -inf (a grammar's bans), rows of -inf alone."""
    gen = torch.Generator().manual_seed(0)
    for rows, width in [(1, 7), (3, 256), (5, 300), (4, 4099), (2, 32000)]:
        x = torch.randn(rows, width, generator=gen).to(dtype)
        tied = x.clone()
        tied[:, [width // 3, width // 2, width - 1]] = 1e4
        special = x.clone()
        special[0, -1] = float("inf")
        special[-1, width // 2] = float("nan")
        special[-1, 0] = float("-inf")
        masked = x.masked_fill(torch.rand(rows, width, generator=gen) > 0.01, float("-inf"))  # a grammar's
        infinite = masked.clone()
        infinite[:, [width // 2, width // 3]] = float("inf")  # equal infinities: the first wins
        infinite[0, -1] = float("nan")  # after them: the NaN wins
        every = (x, tied, special, masked, infinite, torch.full((rows, width), float("-inf"), dtype=dtype))
        for case in every:
            assert torch.equal(ops.argmax_rows(case), case.argmax(-1)), (rows, width, case)


def test_layer_ops_in_every_dtype():
    check_layer_ops(_ops())
