"""GGUF files made by llama.cpp's own converter (convert_hf_to_gguf.py) from Hugging Face folders.

The converter comes from scripts/fetch_llama_cpp.py (llama-cpp-python's sdist on PyPI); tests that need
it skip, saying why, where it cannot be fetched. All conversions of a test session run in one converter
process (importing torch and transformers costs more than a conversion of a tiny model).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]

# Runs the converter's main() once per job. llama.cpp recognises a BPE tokenizer's pre-tokenizer by the
# hash of its ids on a test text, and knows only published tokenizers: for the tests' own tokenizers the
# job names the pre-tokenizer they were built with (what a user adds to convert_hf_to_gguf_update.py).
DRIVER = """
import json, runpy, sys
root, jobs = sys.argv[1], json.loads(sys.argv[2])
sys.path.insert(0, root)
sys.argv = ["convert_hf_to_gguf.py"]
main = runpy.run_path(root + "/convert_hf_to_gguf.py")["main"]
import conversion.base as base
recognised = base.TextModel.get_vocab_base_pre
for job in jobs:
    def pre(self, tokenizer, name=job["pre"]):
        try:
            return recognised(self, tokenizer)
        except NotImplementedError:
            return name
    base.TextModel.get_vocab_base_pre = pre
    sys.argv = ["convert_hf_to_gguf.py", job["model"], "--outfile", job["out"], "--outtype", job["outtype"],
                *job.get("args", [])]
    main()
"""


def converter_dir() -> Path:
    spec = importlib.util.spec_from_file_location("fetch_llama_cpp", ROOT / "scripts/fetch_llama_cpp.py")
    fetch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fetch)
    try:
        return fetch.fetch()
    except Exception as exc:  # offline, or PyPI unreachable
        pytest.skip(f"llama.cpp's converter could not be fetched (scripts/fetch_llama_cpp.py): {exc}")


def convert(jobs: list[dict]) -> None:
    """Each job: {"model": HF folder, "out": .gguf path, "outtype": f32|f16|bf16|q8_0, "pre": name, and
    optionally "args": more converter flags}."""
    for module in ("sentencepiece", "transformers"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"llama.cpp's converter needs {module} (pip install -e '.[test]')")
    root = converter_dir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", DRIVER, str(root), json.dumps(jobs)], capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, f"convert_hf_to_gguf.py failed:\n{result.stderr[-3000:]}"


def rewrite(src: Path, dst: Path, encode) -> Path:
    """A copy of the GGUF file `src` at `dst`, its metadata as it is and each tensor as
    `encode(name, float32 values in torch order)` says: a GGMLQuantizationType to store it in (quantized
    by the gguf package, llama.cpp's reference quantizers), or None to keep it as the file holds it.
    How the tests make Q4_0 / Q4_1 files: llama.cpp's converter writes neither (llama-quantize does)."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quants

    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue  # the writer writes these itself
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub_type)
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        values = quants.dequantize(t.data, t.tensor_type).reshape(shape)
        qtype = encode(t.name, values)
        if qtype is None:  # float32 and float16 arrays say their type; others are bytes
            plain = t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
            writer.add_tensor(t.name, t.data, raw_dtype=None if plain else t.tensor_type)
        elif qtype == GGMLQuantizationType.F32:
            writer.add_tensor(t.name, np.ascontiguousarray(values, dtype=np.float32))
        else:
            writer.add_tensor(t.name, quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
