"""The roofline: what this machine should do with a model, before any serving overhead.

    infer bench roofline [--model M] [--dtype bfloat16] [--quantization int8|int4] [--memory-gb 16]
    infer bench roofline --model FILE.gguf        the file's own bytes: quantized blocks as stored

From the model's shape (built on the meta device: no weights loaded, presets need no download):
parameters, weight bytes, KV bytes per token, KV capacity for a memory budget. From this machine: memory
read bandwidth (a matrix-vector product over a matrix far larger than any cache, which streams it once as a
decode step streams the weights) and matmul throughput (a square matmul), both measured with torch. Then:

- single-stream decode ceiling = bandwidth / weight bytes (every token streams all weights; KV reads,
  attention and launch overheads come on top, so real decode is slower),
- prefill ceiling = matmul FLOP/s / (2 x parameters) tokens/s,
- the decode batch where compute catches up with memory: B* = (FLOP/s / bandwidth) x weight bytes /
  (2 x parameters); below it, batching more requests is nearly free.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

from infer.bench.record import new_record, table, write_record
from infer.bench.report import render_tables

DTYPES = ("float32", "bfloat16", "float16")  # torch is imported where used: `infer --help` stays fast


def model_shape(model: str | None, dtype: str, quantization: str = "none") -> dict:
    """Parameters, weight bytes and KV bytes per token of `model` (a folder, hub id, preset, GGUF file or
    embedded). Weight bytes are what a decode step reads: all parameters but an untied token embedding.

    With `quantization` int8/int4, weight bytes are what a decode step reads as infer quantizes
    (infer.quant.linear.quantize_model): the linear layers' codes and float16 scales (and offsets),
    the LM head in int8, the other parameters in `dtype`; the embedding is only looked up, not read."""
    import torch

    from infer.models import gguf
    from infer.models.config import ModelConfig
    from infer.models.loader import read_config, resolve_model_path
    from infer.models.registry import model_class

    path = resolve_model_path(model, load_format="dummy")
    if gguf.is_gguf(path):
        return _gguf_shape(model, gguf.open_gguf(path), dtype)
    cfg = ModelConfig.from_hf(read_config(path))
    with torch.device("meta"):
        net = model_class(cfg.architecture)(cfg)
    if hasattr(net, "tie_weights"):
        net.tie_weights()
    num_params = sum(p.numel() for p in net.parameters())  # shared (tied) parameters counted once
    nbytes = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    # a decode step looks one row of the token embedding up: read only as the head, when tied to it
    embedding = net.input_embeddings().weight
    head = getattr(net, "lm_head", None)
    looked_up = 0 if head is not None and head.weight is embedding else embedding.numel()
    weight_bytes = (num_params - looked_up) * nbytes
    if quantization != "none":
        weight_bytes = _quantized_bytes(net, quantization, nbytes)
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * nbytes
    return {
        "model": model or "embedded",
        "architecture": cfg.architecture,
        "dtype": dtype if quantization == "none" else f"{quantization} weights, {dtype} activations",
        "num_params": num_params,
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_per_token,
        "max_position_embeddings": cfg.max_position_embeddings,
    }


def _gguf_shape(model: str, file, dtype: str) -> dict:
    """model_shape of a GGUF file: its weight bytes are what its tensors take in the file, quantized blocks
    as they are (what llama.cpp reads a token), the others in `dtype`; the token embedding is only looked
    up, unless the head is tied to it. A ceiling for every engine that runs the file: infer holds some
    blocks in wider forms (docs/quantization.md, "GGUF files")."""
    import torch

    from infer.models import gguf

    cfg = gguf.model_config(file)
    nbytes = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    tied = "output.weight" not in file.tensors
    weight_bytes = num_params = 0
    for name, tensor in file.tensors.items():
        numel = 1
        for n in tensor.shape:
            numel *= n
        num_params += numel
        if name == gguf.EMBEDDING and not tied:
            continue
        weight_bytes += tensor.data.nbytes if tensor.type_name in gguf.QUANTIZED else numel * nbytes
    counts = ", ".join(f"{n} {kind}" for kind, n in file.type_counts().items())
    return {
        "model": model,
        "architecture": cfg.architecture,
        "dtype": f"GGUF ({counts}), {dtype} activations",
        "num_params": num_params,
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * nbytes,
        "max_position_embeddings": cfg.max_position_embeddings,
    }


def _quantized_bytes(net, quantization: str, nbytes: int) -> int:
    from torch import nn

    from infer.quant.linear import HEAD_BITS, quantized_bytes

    bits = 8 if quantization == "int8" else 4
    linear_params, total = set(), 0
    for name, module in net.named_modules():
        if isinstance(module, nn.Linear):
            head = name.rpartition(".")[2] == "lm_head"
            total += quantized_bytes(module.out_features, module.in_features, HEAD_BITS if head else bits)
            linear_params.add(id(module.weight))
    embedding = id(net.input_embeddings().weight)
    rest = sum(p.numel() for p in net.parameters() if id(p) not in linear_params | {embedding})
    return total + rest * nbytes


def _best_time(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure_bandwidth(num_bytes: int = 2**30, repeats: int = 5) -> float:
    """Bytes/s read over `num_bytes` of float32 matrix: the faster of a matrix-vector product and a sum,
    best of `repeats` each.

    A read, as a decode step's weights are read, not a copy (read + write), which undercounts what reads
    alone reach. Two probes, since either can fall short of the memory: on an AMD EPYC Zen 4 torch's
    product (MKL's) read at about half the sum's rate, below what a decode step's weights read at
    (docs/performance.md). The matrix is large so that it is read from DRAM, not from the cache."""
    import torch

    cols = 4096
    matrix = torch.ones(num_bytes // 4 // cols, cols, dtype=torch.float32)
    vector = torch.ones(cols, dtype=torch.float32)
    seconds = min(_best_time(lambda: torch.mv(matrix, vector), repeats), _best_time(matrix.sum, repeats))
    return matrix.numel() * 4 / seconds


def matmul_dtype(dtype: str) -> str:
    """The dtype infer multiplies `dtype` weights in here: float32 for bf16 on a CPU without bf16
    arithmetic (infer/layers/widened_linear.py), where torch's own bf16 matmul is a slow path infer
    does not take."""
    import torch

    from infer.models import loader

    return "float32" if dtype == "bfloat16" and loader.widens(torch.bfloat16) else dtype


def measure_matmul(dtype: str, n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of an n x n matmul in `dtype`, best of `repeats`."""
    import torch

    a = torch.randn(n, n).to(getattr(torch, dtype))
    b = torch.randn(n, n).to(getattr(torch, dtype))
    return 2 * n**3 / _best_time(lambda: torch.mm(a, b), repeats)


def total_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def roofline(
    shape: dict, bandwidth: float, flops: float, matmul_dtype: str, memory_bytes: int | None
) -> dict:
    """The ceilings implied by a model's shape and a machine's measured speeds (pure arithmetic);
    `flops` is the matmul rate measured in `matmul_dtype`."""
    params, wbytes = shape["num_params"], shape["weight_bytes"]
    kv_capacity = None
    if memory_bytes is not None:
        kv_capacity = max(0, (memory_bytes - wbytes) // shape["kv_bytes_per_token"])
    return {
        "bandwidth_bytes_per_s": bandwidth,
        "matmul_flops_per_s": flops,
        "matmul_dtype": matmul_dtype,
        "memory_budget_bytes": memory_bytes,
        "kv_capacity_tokens": kv_capacity,
        "decode_ceiling_tokens_per_s": bandwidth / wbytes,
        "prefill_ceiling_tokens_per_s": flops / (2 * params),
        "compute_bound_batch": (flops / bandwidth) * wbytes / (2 * params),
    }


def rows(shape: dict, roof: dict) -> list[tuple[str, str]]:
    gb = 1e9
    cap = roof["kv_capacity_tokens"]
    budget = roof["memory_budget_bytes"]
    return [
        ("model", f"{shape['model']} ({shape['architecture']}, {shape['dtype']})"),
        ("parameters", f"{shape['num_params'] / 1e6:,.1f} M"),
        ("weight bytes", f"{shape['weight_bytes'] / gb:,.3f} GB"),
        ("KV bytes per token", f"{shape['kv_bytes_per_token'] / 1024:,.1f} KiB"),
        ("KV capacity", "-" if cap is None else f"{cap:,} tokens in {budget / gb:,.1f} GB"),
        ("memory bandwidth (measured)", f"{roof['bandwidth_bytes_per_s'] / gb:,.1f} GB/s"),
        (
            f"matmul throughput (measured, {roof['matmul_dtype']})",
            f"{roof['matmul_flops_per_s'] / 1e9:,.1f} GFLOP/s",
        ),
        ("decode ceiling, 1 stream", f"{roof['decode_ceiling_tokens_per_s']:,.1f} tok/s"),
        ("prefill ceiling", f"{roof['prefill_ceiling_tokens_per_s']:,.1f} tok/s"),
        ("decode turns compute-bound at batch", f"{roof['compute_bound_batch']:,.1f}"),
    ]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default=None, help="model folder, hub id, preset or GGUF file; default: embedded"
    )
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES), help="weights / KV / matmul dtype")
    p.add_argument(
        "--quantization", default="none", choices=["none", "int8", "int4"], help="weights as --quantization"
    )
    p.add_argument("--memory-gb", type=float, default=None, help="memory budget; default: this machine's RAM")
    p.add_argument("--matmul-size", type=int, default=1024)
    p.add_argument("--json", type=Path, default=None, help="also write the numbers to this JSON file")


def cmd_roofline(args: argparse.Namespace, out=None) -> int:
    out = sys.stdout if out is None else out
    shape = model_shape(args.model, args.dtype, args.quantization)
    memory = int(args.memory_gb * 1e9) if args.memory_gb is not None else total_memory_bytes()
    compute = matmul_dtype(args.dtype)
    roof = roofline(shape, measure_bandwidth(), measure_matmul(compute, args.matmul_size), compute, memory)
    tables = [table(["Roofline", "Value"], rows(shape, roof), "== roofline (ceilings before overheads)")]
    print(render_tables(tables), file=out)
    if args.json is not None:
        config = {
            k: str(v) if isinstance(v, Path) else v
            for k, v in vars(args).items()
            if k not in ("func", "argv")
        }
        command = shlex.join(["infer", *getattr(args, "argv", ["bench", "roofline"])])
        write_record(
            args.json, new_record("roofline", command, config, tables=tables, shape=shape, roofline=roof)
        )
    return 0
