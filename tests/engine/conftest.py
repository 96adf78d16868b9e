"""The tiny model the engine tests share, with its greedy outputs from transformers."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_engine import MAX_TOKENS, make_prompts
from tests.models.tiny_models import save_byte_tokenizer, save_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model folder, prompts, transformers' greedy outputs of MAX_TOKENS tokens for each)."""
    hf_model, path = save_tiny_model("llama", tmp_path_factory.mktemp("engine"))
    save_byte_tokenizer(path)
    prompts = make_prompts()
    expected = []
    for p in prompts:
        out = hf_model.generate(
            torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        expected.append(out[0, len(p) :].tolist())
    return str(path), prompts, expected


@pytest.fixture
def row_invariant_linears(monkeypatch):
    """bf16 linears as torch's bf16 matmul computes them, a product per row, at every row count, on a CPU
    without bf16 arithmetic (where infer/layers/widened_linear.py serves them). avx2_linear is row-invariant
    too, but rounds its float32 sums apart from torch's products: tests whose Python attention paths
    differ between verification and plain decoding (SDPA over 1 + K queries against one) keep the
    linears whose values their equality was established on."""
    from infer import kernels
    from infer.layers import widened_linear

    monkeypatch.setattr(kernels, "avx2_ops", lambda: None)
    monkeypatch.setattr(widened_linear, "WIDEN_ROWS", 2**31)
