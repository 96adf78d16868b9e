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
