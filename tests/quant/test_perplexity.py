"""The perplexity harness against transformers' logits, in both its windowing schemes."""

from __future__ import annotations

import math

import pytest
import torch

from infer.eval.perplexity import llama_cpp_perplexity, perplexity
from infer.models.loader import load_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.models.tiny_models import save_tiny_model

    hf, path = save_tiny_model("llama", tmp_path_factory.mktemp("tiny_perplexity"))
    model, _, _ = load_model(str(path), dtype="float32", prepack=False)
    return hf, model


def _token_nll(hf, ids: list[int]) -> torch.Tensor:
    """transformers' negative log-likelihood of ids[1:], each given the ids before it."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, :-1].float()
    return torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none")


def test_llama_cpp_scheme_scores_the_second_half_of_whole_chunks_after_a_bos(tiny):
    """tools/perplexity/perplexity.cpp: chunks of n_ctx, the tail dropped, each chunk's first token made
    BOS, the predictions of tokens n_ctx/2 + 1 .. n_ctx - 1 averaged."""
    hf, model = tiny
    n_ctx, bos = 32, 0
    ids = torch.randint(2, 256, (3 * n_ctx + 7,), generator=torch.Generator().manual_seed(0)).tolist()
    nll = []
    for c in range(3):
        chunk = [bos, *ids[c * n_ctx + 1 : (c + 1) * n_ctx]]
        nll.append(_token_nll(hf, chunk)[n_ctx // 2 :])
    expected = math.exp(torch.cat(nll).mean().item())
    assert len(nll[0]) == n_ctx - 1 - n_ctx // 2
    assert llama_cpp_perplexity(model, ids, n_ctx, bos) == pytest.approx(expected, rel=1e-4)
    # the chunk's own first token kept where the vocabulary adds no BOS
    kept = [_token_nll(hf, ids[c * n_ctx : (c + 1) * n_ctx])[n_ctx // 2 :] for c in range(3)]
    kept_ppl = math.exp(torch.cat(kept).mean().item())
    assert llama_cpp_perplexity(model, ids, n_ctx, None) == pytest.approx(kept_ppl, rel=1e-4)
    # every token of every window scored: another figure
    assert perplexity(model, ids, window=n_ctx) != pytest.approx(expected, rel=1e-3)


def test_llama_cpp_scheme_needs_two_chunks(tiny):
    _, model = tiny
    with pytest.raises(ValueError, match="at least 64 tokens"):
        llama_cpp_perplexity(model, list(range(2, 63)), 32, 0)
