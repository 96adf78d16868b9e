"""infer's perplexity on a GGUF file against llama.cpp's own `llama-perplexity` on the same file and text.

The binary comes from scripts/setup_llama_cpp.sh (about 20 minutes to build on 2 cores, so no test builds
it): where it is missing the test skips, saying so. docs/quantization.md has the full table.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from infer.engine.llm import LLM
from infer.eval.perplexity import held_out_text, llama_cpp_perplexity
from infer.models.gguf import open_gguf
from infer.models.loader import EMBEDDED_MODEL

from .gguf_files import convert

pytestmark = pytest.mark.slow  # the converter, llama-perplexity and a model load: ~1 min

VERSION = "0.3.36"  # scripts/setup_llama_cpp.sh's
BIN = (
    Path(os.environ.get("INFER_LLAMA_CPP_BUILD", Path.home() / ".cache/infer/llama.cpp-build"))
    / VERSION
    / "bin"
)
N_CTX = 128


def test_q8_0_perplexity_is_llama_cpps(tmp_path):
    """The embedded model in Q8_0 (llama.cpp's converter), Genesis 38 in chunks of 128 tokens: infer's
    perplexity within 1% of llama-perplexity's, over the same number of chunks (the same tokens)."""
    tool = BIN / "llama-perplexity"
    if not tool.is_file():
        pytest.skip(f"no {tool}: run scripts/setup_llama_cpp.sh to build llama.cpp's tools")
    gguf = tmp_path / "embedded-q8_0.gguf"
    convert([{"model": str(EMBEDDED_MODEL), "out": str(gguf), "outtype": "q8_0", "pre": "gpt-2"}])
    text = tmp_path / "genesis-38.txt"
    text.write_text(held_out_text())

    cmd = [str(tool), "-m", str(gguf), "-f", str(text), "-c", str(N_CTX), "-t", "2", "--no-repack"]
    # --no-repack: llama.cpp's AMX matmuls stop with an illegal instruction on some VMs (its pull request
    # 26954, open); this keeps its AVX-512 kernels
    for _ in range(5):  # its log is written by a thread, whose last lines an exit now and then cuts off
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        log = result.stdout + result.stderr
        assert result.returncode == 0, log[-3000:]
        if "Final estimate" in log:
            break
    reference = float(re.search(r"Final estimate: PPL = ([0-9.]+)", log).group(1))
    chunks = int(re.search(r"calculating perplexity over (\d+) chunks", log).group(1))

    llm = LLM(str(gguf), num_kv_blocks=64)
    ids = llm.engine.tokenizer.encode(held_out_text())  # the BOS first, as llama.cpp's tokenizer adds it
    assert len(ids) // N_CTX == chunks
    meta = open_gguf(gguf).metadata  # llama-perplexity puts a BOS first in each chunk where the file adds one
    bos = meta["tokenizer.ggml.bos_token_id"] if meta.get("tokenizer.ggml.add_bos_token") else None
    assert bos is not None and ids[0] == bos
    ours = llama_cpp_perplexity(llm.engine.runner.model, ids, N_CTX, bos)
    assert abs(ours / reference - 1) < 0.01, (ours, reference)
