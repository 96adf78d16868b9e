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
    """bf16 linears computed the same way at every row count: on a CPU without bf16 arithmetic avx2_linear
    sums a row in an order that depends on the step's rows, and a step of more rows multiplies in float32
    (infer/layers/widened_linear.py); their sums round apart by an ulp now and then. Here torch's bf16
    matmul, a product per row, runs every step. For tests that compare a verification's tokens with plain
    decoding's bit for bit in bf16 (the attention's part of that equality)."""
    from infer.layers import widened_linear

    monkeypatch.setattr(widened_linear, "WIDEN_ROWS", 2**31)
    monkeypatch.setattr(widened_linear, "KERNEL_ROWS", 0)
