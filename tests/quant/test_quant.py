"""Quantized linear layers, at-load quantization and pre-quantized checkpoints through the engine."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from infer import kernels
from infer.engine.llm import LLM
from infer.eval.perplexity import decode_nll, held_out_text, perplexity
from infer.models.loader import EMBEDDED_MODEL, load_model
from infer.quant import linear as quant_linear
from infer.quant.linear import QuantizedLinear, group_size_for, quantize_model, quantized_bytes
from infer.quant.weights import QuantizedWeight, quantize
from infer.sampling_params import SamplingParams
from tests.grids import pairwise_grid
from tests.quant.packing import quantize_for, write_quantized_checkpoint

HAS_KERNEL = kernels.bf16_ops() is not None
HAS_AVX2_KERNEL = kernels.avx2_ops() is not None  # a CPU with AVX2, without AVX-512 BF16
SCHEMES = [(8, None, True), (8, 32, False), (8, 64, True), (4, 32, False), (4, 64, True), (4, 128, False)]
ROWS = [1, 2, 3, 4, 5, 13, 33]
# llama.cpp's blocks of 32: Q8_0 (int8, one scale), Q4_0 (int4, one scale), Q4_1 (int4, scale and min)
BLOCKS_OF_32 = [(8, 32, True), (4, 32, True), (4, 32, "mins")]
# every scheme at every row count, each with both activation paths across the row counts (pairwise)
BLOCKS_OF_32_CASES = [
    (*scheme, rows, (i + j) % 2 == 0) for j, scheme in enumerate(BLOCKS_OF_32) for i, rows in enumerate(ROWS)
]


def _reference(x: torch.Tensor, layer_weight, bias) -> torch.Tensor:
    y = x.float() @ layer_weight.dequantize().T
    return y if bias is None else y + bias.float()


@pytest.mark.parametrize(
    "int8_activations, rows, bits, group, symmetric",
    pairwise_grid([True, False], ROWS, [pytest.param(*s, id="-".join(map(str, s))) for s in SCHEMES]),
)
def test_every_backend_computes_the_dequantized_product(
    bits, group, symmetric, rows, int8_activations, monkeypatch
):
    """Every path against x @ dequantized W in float32: exact up to bf16 rounding, and up to the rounding
    of x to 8 bits per row where batches take int8 activations (the kernel's W8A8 path)."""
    _check_every_backend(bits, group, symmetric, rows, int8_activations, monkeypatch)


@pytest.mark.parametrize("bits,group,symmetric,rows,int8_activations", BLOCKS_OF_32_CASES)
def test_blocks_of_32_compute_the_dequantized_product(
    bits, group, symmetric, rows, int8_activations, monkeypatch
):
    """GGUF's layouts on every path, Q4_1's float min included (the kernel adds it as the group's offset)."""
    _check_every_backend(bits, group, symmetric, rows, int8_activations, monkeypatch)


def _check_every_backend(bits, group, symmetric, rows, int8_activations, monkeypatch) -> None:
    monkeypatch.setattr(quant_linear, "INT8_ACTIVATIONS", int8_activations)
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(80, 256, generator=gen) * 0.05  # 5 blocks of 16 channels: whole and partial tiles
    qw = quantize_for(w, bits, group, symmetric)
    bias = torch.randn(80, generator=gen)
    x = torch.randn(rows, 256, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        ref = _reference(xd, qw, bias.to(dtype))
        backends = ["dequant", "torch"] + (["infer"] if dtype == torch.bfloat16 and HAS_KERNEL else [])
        backends += ["avx2"] if HAS_AVX2_KERNEL else []
        for backend in backends:
            try:
                layer = QuantizedLinear(qw, bias, dtype, backend=backend)
            except ValueError:
                no_kernel = (bits == 8) != (group is None and symmetric is True)
                assert backend == "torch" and no_kernel
                continue
            y = layer(xd.view(rows, 1, 256)).view(rows, 80).float()
            expected = ref  # avx2 holds float32 scales where float16 would round them: exact
            # bf16, or x rounded to int8 per block of 32 (avx2's int8 activations)
            rounded_x = backend == "avx2" and int8_activations
            tol = 2e-2 if dtype == torch.bfloat16 or rounded_x else 1e-4
            err = (y - expected).abs().max() / expected.abs().max()
            assert err < tol, (backend, dtype, err)


@pytest.mark.skipif(not HAS_AVX2_KERNEL, reason="avx2_linear serves CPUs with AVX2 but no AVX-512 BF16")
@pytest.mark.parametrize("int8_activations", [True, False])
@pytest.mark.parametrize("bits", [8, 4])
def test_avx2_runs_a_channel_count_off_its_blocks_of_8(bits, int8_activations, monkeypatch):
    """An output size that is no multiple of 8 (a vocabulary of 50,257) stays quantized on avx2_linear,
    padded with channels of zero weight that the output drops, bias included."""
    monkeypatch.setattr(quant_linear, "INT8_ACTIVATIONS", int8_activations)
    gen = torch.Generator().manual_seed(bits)
    qw = quantize_for(torch.randn(53, 256, generator=gen) * 0.05, bits, 32, bits == 8)
    bias = torch.randn(53, generator=gen)
    layer = QuantizedLinear(qw, bias, torch.float32)
    assert layer.backend == "avx2"
    for rows in (1, 3, 70):
        x = torch.randn(2, rows, 256, generator=gen)
        y = layer(x)
        assert y.shape == (2, rows, 53) and y.is_contiguous()
        expected = _reference(x.view(-1, 256), qw, bias).view(2, rows, 53)
        tol = 2e-2 if int8_activations else 1e-4
        assert (y - expected).abs().max() / expected.abs().max() < tol, rows


def _as_held(qw: QuantizedWeight) -> QuantizedWeight:
    """`qw` with the kernel's float16 scales and offsets (the weight at code 0), what it multiplies by."""
    scales, offsets = qw.scales.half().float(), qw.offsets()
    mins = None if offsets is None else offsets.half().float()
    return QuantizedWeight(qw.q, scales, None, qw.bits, qw.group_size, mins=mins)


def _w8a8_reference(x: torch.Tensor, qw) -> torch.Tensor:
    """What the kernel's int8-activation paths compute, in float64: each row of x rounded to int8 as the
    kernel rounds it (scale max|x| / 127, x * (1 / scale) in float32, to nearest even), times the
    weight as the kernel holds it (float16 scales), times the row's scale."""
    qw = _as_held(qw)
    x = x.float()
    scale = x.abs().amax(1, keepdim=True) / 127
    xq = torch.round(x * (1 / scale))
    return (xq.double() @ qw.dequantize().double().T) * scale.double()


@pytest.mark.skipif(not HAS_KERNEL, reason="the kernel needs AVX-512 BF16")
@pytest.mark.parametrize(
    "bits,group,symmetric", [(8, None, True), (8, 64, False), (4, 64, True), (4, 128, False), *BLOCKS_OF_32]
)
def test_int8_activation_paths_round_x_per_row_and_sum_exactly(bits, group, symmetric, monkeypatch):
    """Every step the kernel runs with int8 activations (with AMX on the tiles: int8 weights at every row
    count, int4 from 2 rows; else with VNNI int8 weights at every row count, up to 4 rows straight from
    the codes, and int4 from 5 rows) is x rounded to int8 per row times the
    codes, summed exactly: its output is that product rounded once to bf16 (float32 folding aside), a
    tighter bound than the float reference's."""
    monkeypatch.setattr(quant_linear, "INT8_ACTIVATIONS", True)
    gen = torch.Generator().manual_seed(bits + (group or 0))
    w = torch.randn(80, 512, generator=gen) * 0.05
    qw = quantize_for(w, bits, group, symmetric)
    layer = QuantizedLinear(qw, None, torch.bfloat16, backend="infer")
    first = layer._decode_rows + 1
    for rows in sorted(r for r in {first, first + 1, 4, 5, 13, 33, 70} if r >= first):
        x = torch.randn(rows, 512, generator=gen).bfloat16()
        ref = _w8a8_reference(x, qw)
        y = layer(x).double()
        assert ((y - ref).abs() <= ref.abs() * 2**-8 + 1e-6 * ref.abs().max()).all(), rows
        unrounded = _reference(x, qw, None).double()  # x not rounded: beyond one bf16 rounding somewhere
        assert not ((unrounded - ref).abs() <= ref.abs() * 2**-8 + 1e-6 * ref.abs().max()).all(), rows


def test_the_kernel_is_chosen_for_bf16_where_the_cpu_has_it():
    qw = quantize(torch.randn(64, 128), 4, 32)
    int4 = "avx2" if HAS_AVX2_KERNEL else "torch"  # torch's int4 kernel is slower than widening there
    assert QuantizedLinear(qw, None, torch.bfloat16).backend == ("infer" if HAS_KERNEL else int4)
    assert QuantizedLinear(qw, None, torch.float32).backend == int4
    odd = quantize(torch.randn(6, 40), 8)  # the kernels want rows in 16s (avx2: 8s) and inputs in 32s
    assert QuantizedLinear(odd, None, torch.bfloat16).backend == "torch"
    assert QuantizedLinear(odd, None, torch.float32).backend == "torch"
    in_groups = quantize(torch.randn(64, 128), 8, 32)  # GGUF's Q8_0: torch has no kernel for it
    assert QuantizedLinear(in_groups, None, torch.float32).backend == (
        "avx2" if HAS_AVX2_KERNEL else "dequant"
    )
    with pytest.raises(ValueError, match="cannot run"):
        QuantizedLinear(quantize(torch.randn(64, 128), 8, 32), None, torch.float32, backend="torch")


def test_quantize_round_trip_is_within_half_a_step():
    w = torch.randn(32, 256)
    for bits, group in ((8, None), (4, 128), (4, 32)):
        qw = quantize(w, bits, group)
        step = qw.scales.repeat_interleave(qw.group_size, dim=1)
        assert ((qw.dequantize() - w).abs() <= step / 2 + 1e-6).all()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.models.tiny_models import save_byte_tokenizer, save_tiny_model

    root = tmp_path_factory.mktemp("tiny_quant")
    _, path = save_tiny_model("llama_bias", root)
    save_byte_tokenizer(path)
    return path


def _dequantized_copy(src, dst, weights: dict) -> None:
    """src's checkpoint with the given weights (by tensor name) in float32, untied: the reference model."""
    tensors = {k: v.float() for k, v in load_file(src / "model.safetensors").items()} | weights
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text()) | {"tie_word_embeddings": False}
    config.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (dst / name).write_bytes((src / name).read_bytes())


def _greedy(model: str, **kwargs) -> list[list[int]]:
    llm = LLM(model, dtype="float32", max_num_batched_tokens=64, num_kv_blocks=64, **kwargs)
    prompts = ["hello quantized world", "a b c d e f g", "0123456789" * 3]
    return [
        r.token_ids
        for r in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    ]


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_at_load_quantization_matches_its_dequantized_weights_greedily(
    tiny, tmp_path, method, float_activations
):
    net, _, _ = load_model(str(tiny), dtype="float32", quantization=method)
    # float32: torch's kernels (on AVX2 CPUs: avx2_linear); 2 x 4 layers + head
    int8 = "avx2" if HAS_AVX2_KERNEL else "torch"
    assert net.quantization["backends"] == {int8: 9}  # int4 layers: torch's kernel, or avx2_linear
    # the reference: the same quantization, done by hand on the checkpoint, dequantized
    weights = {}
    for name, t in load_file(tiny / "model.safetensors").items():
        if name.endswith("_proj.weight") or name == "lm_head.weight":
            bits = 8 if method == "int8" or name == "lm_head.weight" else 4
            group = None if bits == 8 else group_size_for(t.shape[1], 128)  # tiny inputs: groups of 64 or 128
            weights[name] = quantize(t.float(), bits, group).dequantize()
    ref = tmp_path / "ref"
    _dequantized_copy(tiny, ref, weights)
    assert _greedy(str(tiny), quantization=method) == _greedy(str(ref))


CHECKPOINTS = [
    ("awq", 4, 32, False, {}),
    ("gptq", 4, 32, True, {"checkpoint_format": "gptq"}),
    ("gptq", 8, None, False, {"checkpoint_format": "gptq_v2"}),
    ("compressed-tensors", 4, 32, True, {"ct_format": "pack-quantized"}),
    ("compressed-tensors", 8, None, True, {"ct_format": "int-quantized"}),
]


@pytest.mark.parametrize("method,bits,group,symmetric,kwargs", CHECKPOINTS)
def test_prequantized_checkpoints_load_and_match_their_weights(
    tiny, tmp_path, method, bits, group, symmetric, kwargs, float_activations
):
    quantized = tmp_path / "q"
    written = write_quantized_checkpoint(tiny, quantized, method, bits, group, symmetric, **kwargs)
    net, _, _ = load_model(str(quantized), dtype="float32")
    assert (
        net.quantization["layers"] == 8 and net.quantization["bits"] == bits
    )  # 2 layers x (qkv, o, gate_up, down)
    assert net.quantization["method"].startswith(method)
    ref = tmp_path / "ref"
    _dequantized_copy(tiny, ref, {f"{p}.weight": w.dequantize() for p, w in written.items()})
    assert _greedy(str(quantized)) == _greedy(str(ref))
    # bf16 through the kernel (where the CPU has it): the same model, to bf16 rounding
    bf16, _, _ = load_model(str(quantized), dtype="bfloat16")
    ids = list(range(40, 90))
    ref_net, _, _ = load_model(str(ref), dtype="bfloat16")
    assert abs(perplexity(bf16, ids) / perplexity(ref_net, ids) - 1) < 0.02


def test_bad_checkpoints_are_refused_before_the_kv_pool(tiny, tmp_path):
    quantized = tmp_path / "q"
    write_quantized_checkpoint(tiny, quantized, "awq", 4, 32, False)
    with pytest.raises(ValueError, match="already quantized"):
        load_model(str(quantized), quantization="int8")
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "bitsandbytes"
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method"):
        LLM(str(quantized))
    write_quantized_checkpoint(tiny, quantized, "awq", 4, 32, False)  # fresh config
    state = load_file(quantized / "model.safetensors")
    state["model.layers.0.mlp.down_proj.qweight"] = state["model.layers.0.mlp.down_proj.qweight"][
        :, :4
    ].contiguous()
    save_file(state, str(quantized / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj\.qweight"):
        LLM(str(quantized))


def test_unknown_quantization_is_refused():
    with pytest.raises(ValueError, match="quantization"):
        LLM(quantization="int3")
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize_model(torch.nn.Linear(4, 4), "fp8")


@pytest.mark.slow
def test_embedded_model_perplexity_and_memory():
    """The quality bar of the issue: int8 within 1% of bf16, int4 within 10%, on held-out KJV text, for
    prompts (perplexity) and for decode steps of one token (their own kernel paths: with AMX, int8
    activations at one row too); and the weights shrink."""
    figures = {}
    for method in ("none", "int8", "int4"):
        llm = LLM(dtype="bfloat16", quantization=method, num_kv_blocks=64)
        ids = llm.engine.tokenizer.encode(held_out_text())
        model = llm.engine.runner.model
        figures[method] = (
            perplexity(model, ids),
            decode_nll(model, ids[:300]),
            llm.engine.quantization["weight_mib"],
        )
    base, base_nll, base_mib = figures["none"]
    assert abs(figures["int8"][0] / base - 1) < 0.01
    assert abs(figures["int4"][0] / base - 1) < 0.10
    assert abs(figures["int8"][1] / base_nll - 1) < 0.01
    assert abs(figures["int4"][1] / base_nll - 1) < 0.10
    assert base_mib > figures["int8"][2] > figures["int4"][2]
    assert EMBEDDED_MODEL.is_dir()


@pytest.mark.parametrize(("bits", "shape"), [(8, (64, 256)), (4, (64, 256)), (4, (32, 96))])
def test_quantized_bytes_counts_what_quantize_stores(bits, shape):
    # the roofline's weight bytes of a quantized model, computed without quantizing it
    weight = torch.randn(shape)
    group = None if bits == 8 else group_size_for(shape[1], 128)
    q = quantize(weight, bits, group)
    # the kernel's float16 scales and offsets (one per group), beside the codes
    stored = q.q.numel() * bits // 8 + 2 * (
        q.scales.numel() + (q.zeros.numel() if q.zeros is not None else 0)
    )
    assert quantized_bytes(*shape, bits) == stored
