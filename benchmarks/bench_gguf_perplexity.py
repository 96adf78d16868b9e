"""infer's perplexity beside llama.cpp's `llama-perplexity`, on the same GGUF file and the same text.

    scripts/setup_llama_cpp.sh                         # builds llama-quantize and llama-perplexity
    python benchmarks/bench_gguf_perplexity.py         # the embedded model, Genesis 38, -c 256

The files are the embedded model's (or --model's) GGUF files: F32, BF16 and Q8_0 from llama.cpp's
converter (convert_hf_to_gguf.py --outtype), then Q8_0, Q4_0, Q4_1 and Q4_K_M by llama-quantize from the
F32 file. Each is scored by `llama-perplexity -m FILE -f TEXT -c N` and by infer's harness loading the
same file (infer.eval.perplexity.llama_cpp_perplexity: llama-perplexity's windows, whole chunks of N
tokens, a BOS first, the second half of each scored). A file that infer does not load is reported as
refused, with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.models.gguf_files: the converter run with the tests' recipe

BIN = Path.home() / ".cache/infer/llama.cpp-build/0.3.36/bin"
CONVERTED = ("f32", "bf16", "q8_0")  # convert_hf_to_gguf.py --outtype
QUANTIZED = ("Q8_0", "Q4_0", "Q4_1", "Q4_K_M")  # llama-quantize from the F32 file
FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")


def make_files(model: Path, out: Path, bin_dir: Path) -> dict[str, Path]:
    """name -> GGUF file, made unless already there."""
    from tests.models.gguf_files import convert

    files = {f"{t.upper()} (converter)": out / f"model-{t}.gguf" for t in CONVERTED}
    jobs = [
        {"model": str(model), "out": str(f), "outtype": t, "pre": "gpt-2"}
        for t, f in zip(CONVERTED, files.values(), strict=True)
        if not f.exists()
    ]
    if jobs:
        convert(jobs)
    for qtype in QUANTIZED:
        target = out / f"model-{qtype}.gguf"
        if not target.exists():
            cmd = [str(bin_dir / "llama-quantize"), str(out / "model-f32.gguf"), str(target), qtype, "2"]
            subprocess.run(cmd, check=True, capture_output=True)
        files[f"{qtype} (llama-quantize)"] = target
    return files


def llama_perplexity(bin_dir: Path, file: Path, text: Path, n_ctx: int, threads: int) -> dict:
    cmd = [str(bin_dir / "llama-perplexity"), "-m", str(file), "-f", str(text), "-c", str(n_ctx)]
    # --no-repack: llama.cpp's AMX matmuls (weights it "repacks" for Q8_0 / Q4_0 on CPUs with AMX) stop with
    # an illegal instruction in their worker threads on some VMs (its pull request 26954, open); this keeps
    # its AVX-512 VNNI kernels
    cmd += ["-t", str(threads), "--no-repack"]
    for _ in range(5):  # its log is written by a thread, whose last lines an exit now and then cuts off
        result = subprocess.run(cmd, capture_output=True, text=True)
        found = FINAL.search(result.stderr + result.stdout)
        if result.returncode == 0 and found:
            return {"ppl": float(found.group(1)), "error": float(found.group(2)), "command": " ".join(cmd)}
    raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr[-2000:]}")


def infer_perplexity(file: Path, text: str, n_ctx: int, dtype: str) -> dict:
    from infer.engine.llm import LLM
    from infer.eval.perplexity import llama_cpp_perplexity
    from infer.models.gguf import open_gguf

    meta = open_gguf(file).metadata
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    bos = int(meta["tokenizer.ggml.bos_token_id"]) if add_bos else None
    try:
        llm = LLM(str(file), dtype=dtype, num_kv_blocks=64)
    except ValueError as exc:
        return {"refused": str(exc).splitlines()[0]}
    ids = llm.engine.tokenizer.encode(text)  # a BOS first where the file says add_bos, as llama.cpp's
    ppl = llama_cpp_perplexity(llm.engine.runner.model, ids, n_ctx, bos)
    info = llm.engine.quantization
    return {"ppl": ppl, "tokens": len(ids), "backends": info.get("backends"), "dtype": dtype}


def main() -> None:
    from infer.eval.perplexity import held_out_text
    from infer.models.loader import EMBEDDED_MODEL

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=EMBEDDED_MODEL, help="Hugging Face folder to convert")
    p.add_argument("--out", type=Path, default=Path("/tmp/infer-gguf-perplexity"), help="GGUF files here")
    p.add_argument("--text", type=Path, default=None, help="text file (default: Genesis 38, held out)")
    p.add_argument("-c", "--ctx-size", type=int, default=256, help="llama-perplexity's -c")
    p.add_argument("--llama-cpp-bin", type=Path, default=BIN, help="scripts/setup_llama_cpp.sh's output")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--dtype", default="auto", help="infer's --dtype for the unquantized tensors")
    p.add_argument("--only", default=None, help="comma-separated names (e.g. Q4_0) to run")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    text_file = args.text or args.out / "genesis-38.txt"
    if args.text is None:
        text_file.write_text(held_out_text())
    text = text_file.read_text()
    files = make_files(args.model, args.out, args.llama_cpp_bin)
    rows = []
    for name, file in files.items():
        if args.only and not any(k.strip() in name for k in args.only.split(",")):
            continue
        ref = llama_perplexity(args.llama_cpp_bin, file, text_file, args.ctx_size, args.threads)
        ours = infer_perplexity(file, text, args.ctx_size, args.dtype)
        row = {
            "name": name,
            "file": str(file),
            "mib": file.stat().st_size / 2**20,
            "llama": ref,
            "infer": ours,
        }
        row["types"] = _types(file)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{platform.processor() or platform.machine()}, -c {args.ctx_size}, {text_file}\n")
    print("| file | tensor types | llama-perplexity | infer | infer / llama | file MiB |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        ref, ours = r["llama"], r["infer"]
        if "refused" in ours:
            cells = ["refused", "-"]
        else:
            cells = [f"{ours['ppl']:.4f}", f"{ours['ppl'] / ref['ppl']:.4f}"]
        row = [r["name"], r["types"], f"{ref['ppl']:.4f} ± {ref['error']:.4f}", *cells, f"{r['mib']:.1f}"]
        print("| " + " | ".join(row) + " |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


def _types(file: Path) -> str:
    from infer.models.gguf import open_gguf

    return ", ".join(f"{t} {n}" for t, n in open_gguf(file).type_counts().items())


if __name__ == "__main__":
    main()
