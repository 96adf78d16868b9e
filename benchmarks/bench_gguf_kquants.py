"""What reading K-quants costs: GGUF files of the embedded model in Q4_K / Q5_K / Q6_K and a Q4_K_M-like
mix, each against its own weights as gguf.quants dequantizes them.

    python benchmarks/bench_gguf_kquants.py [--out DIR]

The embedded model's f32 GGUF comes from llama.cpp's convert_hf_to_gguf.py (scripts/fetch_llama_cpp.py);
its K-quant tensors from tests/quant/kquant_blocks.py's round-to-nearest encoder (the gguf package has no
K-quant quantizer). Rows must be multiples of 256 for a K-quant: in this model (hidden size 384) only
ffn_down (1024 inputs) can be one, and llama-quantize gives the others its fallbacks (Q4_K -> Q5_0,
Q6_K -> Q8_0), which the mix does too. Prints, per file: the RMS error of the weights as loaded against
gguf.quants' dequantization (relative to the weights' RMS), and perplexity on held-out text (windows of
512 tokens) of the file as loaded and of its dequantized weights (torch's path), each in bf16 (the file
on our kernels) and float32 (the file's int8 groups dequantized: the weights' cost alone).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quants

from infer.engine.tokenizer import load_tokenizer
from infer.eval.perplexity import held_out_text, perplexity
from infer.models.gguf import open_gguf
from infer.models.loader import EMBEDDED_MODEL, load_model
from infer.quant.gguf_blocks import unpack_blocks
from tests.models.gguf_files import convert
from tests.quant.kquant_blocks import encode

PYTHON_QUANTIZERS = ("Q8_0", "Q5_0", "Q5_1", "Q4_0", "Q4_1")


def mix_type(name: str, cols: int, layers: int) -> str | None:
    """llama.cpp's Q4_K_M choice for a tensor of a model with tied embeddings (llama_tensor_get_type,
    use_more_bits), with its fallbacks for rows that are not whole super-blocks."""
    more = False
    if ".attn_v." in name or ".ffn_down." in name:
        i = int(name.split(".")[1])
        more = i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2
    head = name == "output.weight" or name == "token_embd.weight"  # the embedding: when tied, as here
    kind = "Q6_K" if head or more else "Q4_K"
    if cols % 256:
        kind = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}[kind]
    return kind


def write(src: Path, dst: Path, choose) -> tuple[Path, Path]:
    """`src` re-encoded: each matrix in choose(name, cols) (None: F32), and its dequantized twin."""
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    twin = dst.with_name(dst.stem + "-dequantized.gguf")
    writers = [GGUFWriter(dst, arch), GGUFWriter(twin, arch)]
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        for w in writers:
            w.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        values = quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        kind = choose(t.name, shape[-1]) if values.ndim == 2 else None
        if kind is None:
            for w in writers:
                w.add_tensor(t.name, values)
            continue
        qtype = GGMLQuantizationType[kind]
        data = quants.quantize(values, qtype) if kind in PYTHON_QUANTIZERS else encode(kind, values)
        writers[0].add_tensor(t.name, data, raw_dtype=qtype)
        writers[1].add_tensor(t.name, np.ascontiguousarray(quants.dequantize(data, qtype), dtype=np.float32))
    for w in writers:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return dst, twin


def weight_errors(path: Path) -> dict[str, float]:
    """Per block type: RMS of (weights as loaded - gguf.quants' dequantization) / RMS of the weights."""
    model = open_gguf(path)
    sums: dict[str, list[float]] = {}
    for t in model.tensors.values():
        if len(t.shape) != 2 or t.type_name == "F32":
            continue
        ref = torch.from_numpy(quants.dequantize(t.data, GGMLQuantizationType[t.type_name]))
        ours = unpack_blocks(t.type_name, t.data, t.shape).dequantize()
        acc = sums.setdefault(t.type_name, [0.0, 0.0])
        acc[0] += float((ours - ref).double().pow(2).sum())
        acc[1] += float(ref.double().pow(2).sum())
    return {kind: (e / w) ** 0.5 for kind, (e, w) in sums.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="kquants-"))
    out.mkdir(parents=True, exist_ok=True)
    f32 = out / "embedded-f32.gguf"
    if not f32.exists():
        convert([{"model": str(EMBEDDED_MODEL), "out": str(f32), "outtype": "f32", "pre": "gpt-2"}])
    layers = 6
    files = {}
    for kind in ("Q4_K", "Q5_K", "Q6_K"):  # every matrix that can be one (ffn_down); the others F32
        files[kind] = write(
            f32, out / f"embedded-{kind.lower()}.gguf", lambda n, c, k=kind: (None, k)[c % 256 == 0]
        )
    files["Q4_K_M-like"] = write(f32, out / "embedded-q4_k_m.gguf", lambda n, c: mix_type(n, c, layers))
    ids = load_tokenizer(EMBEDDED_MODEL).encode(held_out_text())
    print(f"{len(ids)} held-out tokens, windows of 512")
    print("| file | types | weight RMS error | infer bf16 | dequantized bf16 | infer f32 | dequantized f32 |")
    print("|---|---|---|---:|---:|---:|---:|")
    for name, (path, twin) in files.items():
        types = open_gguf(path).type_counts()
        errors = ", ".join(f"{k} {v:.2e}" for k, v in weight_errors(path).items())
        ours = perplexity(load_model(str(path), dtype="bfloat16")[0], ids)
        ref_bf16 = perplexity(load_model(str(twin), dtype="bfloat16")[0], ids)
        ours_f32 = perplexity(load_model(str(path), dtype="float32")[0], ids)
        ref_f32 = perplexity(load_model(str(twin), dtype="float32")[0], ids)
        kinds = ", ".join(f"{k} x{n}" for k, n in types.items())
        print(
            f"| {name} | {kinds} | {errors} | {ours:.3f} | {ref_bf16:.3f} | {ours_f32:.3f} | {ref_f32:.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
