"""The roofline: model shapes against known numbers, the ceilings' arithmetic, and the command."""

from __future__ import annotations

import argparse
import contextlib
import io
import json

import pytest
import torch

from infer.bench.cli import add_bench_parsers
from infer.bench.roofline import model_shape, roofline


def test_shape_of_a_preset_matches_its_published_size():
    shape = model_shape("Llama-3.2-1B", "bfloat16")
    assert shape["num_params"] == 1_235_814_400  # tied embeddings counted once
    assert shape["weight_bytes"] == 2 * shape["num_params"]
    assert shape["kv_bytes_per_token"] == 2 * 16 * 8 * 64 * 2  # K and V, 16 layers, 8 kv heads, dim 64, bf16
    assert model_shape("Llama-3.2-1B", "float32")["kv_bytes_per_token"] == 2 * shape["kv_bytes_per_token"]


def test_ceilings_arithmetic():
    shape = {"num_params": 1_000, "weight_bytes": 2_000, "kv_bytes_per_token": 10}
    r = roofline(shape, bandwidth=4_000.0, flops=1e6, matmul_dtype="float32", memory_bytes=12_000)
    assert r["decode_ceiling_tokens_per_s"] == pytest.approx(2.0)  # 4000 B/s / 2000 B per token
    assert r["prefill_ceiling_tokens_per_s"] == pytest.approx(500.0)  # 1e6 / (2 * 1000)
    assert r["compute_bound_batch"] == pytest.approx(250.0)  # (1e6 / 4000) * 2000 / 2000
    assert r["kv_capacity_tokens"] == 1_000  # (12000 - 2000) / 10
    assert r["matmul_dtype"] == "float32"
    assert roofline(shape, 4_000.0, 1e6, "float32", None)["kv_capacity_tokens"] is None


@pytest.mark.slow  # measures the machine's memory bandwidth and matmul rate
def test_roofline_command(tmp_path):
    parser = argparse.ArgumentParser(prog="infer")
    add_bench_parsers(parser.add_subparsers(dest="command"))
    path = tmp_path / "roof.json"
    args = parser.parse_args(
        ["bench", "roofline", "--memory-gb", "1", "--matmul-size", "256", "--json", str(path)]
    )
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert args.func(args) == 0
    report = json.loads(path.read_text())
    assert report["shape"]["model"] == "embedded" and report["shape"]["num_params"] > 0
    assert report["roofline"]["bandwidth_bytes_per_s"] > 0 and report["roofline"]["matmul_flops_per_s"] > 0
    assert "decode ceiling" in out.getvalue()


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_weight_bytes_are_what_the_quantized_model_holds(method):
    from infer.models.loader import load_model
    from infer.quant.linear import QuantizedLinear

    net, _, _ = load_model("llama-50m", dtype="bfloat16", load_format="dummy", quantization=method)
    held = 0
    for module in net.modules():
        if isinstance(module, QuantizedLinear):  # codes, scales, zero points: what a decode step reads
            held += sum(
                t.nbytes
                for t in (module.qweight, module.scales, getattr(module, "offsets", None))  # torch's: none
                if t is not None
            )
    quantized = {id(p) for m in net.modules() if isinstance(m, QuantizedLinear) for p in m.parameters()}
    embedding = net.input_embeddings().weight
    held += sum(p.nbytes for p in net.parameters() if id(p) not in quantized and p is not embedding)
    # avx2_linear holds float32 scales (and offsets) where float16 would round them: 2 more bytes each
    wider = sum(
        t.numel() * 2
        for m in net.modules()
        if isinstance(m, QuantizedLinear)
        for t in (m.scales, getattr(m, "offsets", None))
        if t is not None and t.dtype == torch.float32
    )
    assert model_shape("llama-50m", "bfloat16", method)["weight_bytes"] + wider == held


def test_an_untied_embedding_is_not_counted_as_read():
    """A decode step looks one row of an untied token embedding up: its bytes are not the step's."""
    shape = model_shape("llama-50m", "bfloat16")
    assert shape["weight_bytes"] == 2 * (shape["num_params"] - 32000 * 512)


def _write_gguf(path, tied: bool):
    """A one-layer Llama's metadata; token_embd and the head (unless tied) in Q8_0 (34 bytes a block of
    32), attn_q in Q4_0 (18 bytes), two float32 norms of 64."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter

    writer = GGUFWriter(path, "llama")
    for key, value in [("block_count", 1), ("embedding_length", 64), ("feed_forward_length", 128),
                       ("attention.head_count", 4), ("context_length", 256)]:  # fmt: skip
        writer.add_uint32(f"llama.{key}", value)
    q8 = np.zeros((96, 2 * 34), dtype=np.uint8)
    writer.add_tensor("token_embd.weight", q8, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(64, dtype=np.float32))
    writer.add_tensor(
        "blk.0.attn_q.weight", np.zeros((64, 2 * 18), np.uint8), raw_dtype=GGMLQuantizationType.Q4_0
    )
    if not tied:
        writer.add_tensor("output.weight", q8, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("tied", [False, True])
def test_a_gguf_files_weight_bytes_are_its_own(tmp_path, tied):
    """Quantized blocks as the file stores them, the rest in --dtype; the token embedding only when the
    head is tied to it (then read once, as the head)."""
    path = _write_gguf(tmp_path / "m.gguf", tied)
    head = 96 * 2 * 34  # the head, or the embedding it is tied to
    shape = model_shape(str(path), "bfloat16")
    assert shape["weight_bytes"] == head + 64 * 2 * 18 + 2 * 64 * 2
    assert shape["num_params"] == 96 * 64 * (1 if tied else 2) + 64 * 64 + 2 * 64
    assert shape["kv_bytes_per_token"] == 2 * 1 * 4 * 16 * 2
    assert "Q8_0" in shape["dtype"] and "Q4_0" in shape["dtype"]


def test_the_matmul_ceiling_is_measured_in_the_dtype_infer_multiplies_in(monkeypatch):
    """bf16 weights on a CPU without bf16 arithmetic multiply in float32 (widened_linear): torch's bf16
    matmul there is a path infer never takes, ~100x slower, and would put the prefill ceiling below
    what infer does."""
    from infer.bench.roofline import matmul_dtype
    from infer.models import loader

    monkeypatch.setattr(loader, "widens", lambda dtype: dtype == torch.bfloat16)
    assert matmul_dtype("bfloat16") == "float32" and matmul_dtype("float16") == "float16"
    monkeypatch.setattr(loader, "widens", lambda dtype: False)
    assert matmul_dtype("bfloat16") == "bfloat16"
