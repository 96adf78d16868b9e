"""Perplexity of a model on a text: how much quantization costs in quality.

`perplexity`: the text is cut into windows of `window` tokens, each scored on its own (one packed prefill
through the model's own paged attention, as the engine runs it), and the loss is averaged over every
predicted token. `llama_cpp_perplexity`: llama.cpp's `llama-perplexity` scheme, to set figures beside
its own on the same file and text. `decode_nll`: each token predicted by a one-token decode step over the
cache, as a generation computes it; the kernels take other paths for one row than for a prompt (one-row
linears of quantized weights, decode attention over fp8 codes), which prompts' perplexity never runs.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from infer.layers.attention_metadata import AttentionMetadata
from infer.runner.kv_cache import allocate_kv_cache

BLOCK_SIZE = 16
GENESIS = Path(__file__).resolve().parents[1] / "assets" / "toy" / "genesis.txt"
HELD_OUT = (1121, 1150)  # Genesis 38 in genesis.txt (1-based lines, inclusive): held out from training


def held_out_text() -> str:
    """Text the embedded model never trained on (infer/assets/embedded/README.md: its eval chapters)."""
    lines = GENESIS.read_text().splitlines()
    return "\n".join(lines[HELD_OUT[0] - 1 : HELD_OUT[1]])


@torch.inference_mode()
def perplexity(
    model, token_ids: list[int], window: int = 512, kv_cache_dtype: torch.dtype | None = None
) -> float:
    """exp(mean negative log-likelihood of each token given the ones before it in its window); the keys and
    values in a cache of kv_cache_dtype (None: the model's; an fp8 dtype: what `--kv-cache-dtype` costs)."""
    if len(token_ids) < 2:
        raise ValueError("perplexity needs at least 2 tokens")
    window = min(window, model.config.max_position_embeddings)
    prefill = _Prefill(model, window, kv_cache_dtype)
    total_nll, total_tokens = 0.0, 0
    for start in range(0, len(token_ids) - 1, window):
        ids = token_ids[start : start + window + 1]
        total_nll += prefill.nll(ids[:-1], ids[1:], scored_from=0)
        total_tokens += len(ids) - 1
    return math.exp(total_nll / total_tokens)


@torch.inference_mode()
def llama_cpp_perplexity(
    model, token_ids: list[int], n_ctx: int, bos_id: int | None, kv_cache_dtype: torch.dtype | None = None
) -> float:
    """Perplexity as `llama-perplexity -c n_ctx` computes it (tools/perplexity/perplexity.cpp): the text cut
    into whole chunks of n_ctx tokens (a shorter tail dropped), the first token of each chunk replaced by
    bos_id (when the vocabulary adds a BOS; None: kept), and only the second half of each chunk scored,
    every scored token seeing at least n_ctx / 2 before it. token_ids: the text as llama.cpp tokenizes it,
    its BOS included."""
    chunks = len(token_ids) // n_ctx
    if chunks < 2:  # llama-perplexity's own limit
        raise ValueError(f"a context of {n_ctx} needs at least {2 * n_ctx} tokens, got {len(token_ids)}")
    if n_ctx > model.config.max_position_embeddings:
        raise ValueError(f"context {n_ctx} exceeds the model's {model.config.max_position_embeddings}")
    prefill = _Prefill(model, n_ctx, kv_cache_dtype)
    first = n_ctx // 2
    total_nll = 0.0
    for c in range(chunks):
        chunk = token_ids[c * n_ctx : (c + 1) * n_ctx]
        if bos_id is not None:
            chunk = [bos_id, *chunk[1:]]
        total_nll += prefill.nll(chunk[:-1], chunk[1:], scored_from=first)
    return math.exp(total_nll / (chunks * (n_ctx - 1 - first)))


class _Prefill:
    """One sequence of up to `length` tokens prefilled at a time through the model's paged attention, into
    a cache that each call reuses from its first block."""

    def __init__(self, model, length: int, kv_cache_dtype: torch.dtype | None):
        self.model = model
        self.num_blocks = -(-length // BLOCK_SIZE)
        self.dtype = next(model.parameters()).dtype
        self.kv_caches = allocate_kv_cache(
            model.config, self.num_blocks, BLOCK_SIZE, kv_cache_dtype or self.dtype
        )

    def nll(self, inputs: list[int], targets: list[int], scored_from: int) -> float:
        """Summed negative log-likelihood of targets[scored_from:], each predicted from inputs before it."""
        n = len(inputs)
        meta = AttentionMetadata(
            query_lens=[n],
            seq_lens=[n],
            slot_mapping=torch.arange(n),
            block_tables=torch.arange(self.num_blocks).view(1, self.num_blocks),
            kv_caches=self.kv_caches,
            query_dtype=self.dtype,
        )
        hidden = self.model(torch.tensor(inputs), torch.arange(n), meta)  # [n, hidden]
        logits = self.model.compute_logits(hidden[scored_from:]).float()  # [n - scored_from, vocab]
        scored = torch.tensor(targets[scored_from:])
        return torch.nn.functional.cross_entropy(logits, scored, reduction="sum").item()


@torch.inference_mode()
def decode_nll(
    model, token_ids: list[int], kv_cache_dtype: torch.dtype | None = None, prefill: int = 100
) -> float:
    """Mean negative log-likelihood of token_ids[prefill + 1:], each predicted by a decode step of one token
    over the cache (kv_cache_dtype as in `perplexity`), after one prefill of the first `prefill` tokens."""
    if not prefill + 2 <= len(token_ids) <= model.config.max_position_embeddings:
        limit = model.config.max_position_embeddings
        raise ValueError(
            f"decode_nll takes {prefill + 2} to {limit} tokens (one sequence), got {len(token_ids)}"
        )
    num_blocks = -(-len(token_ids) // BLOCK_SIZE)
    model_dtype = next(model.parameters()).dtype
    kv_caches = allocate_kv_cache(model.config, num_blocks, BLOCK_SIZE, kv_cache_dtype or model_dtype)
    table = torch.arange(num_blocks).view(1, -1)
    total = 0.0
    for start, end in [(0, prefill)] + [(p, p + 1) for p in range(prefill, len(token_ids) - 1)]:
        meta = AttentionMetadata(
            [end - start], [end], torch.arange(start, end), table, kv_caches, query_dtype=model_dtype
        )
        hidden = model(torch.tensor(token_ids[start:end]), torch.arange(start, end), meta)
        if start >= prefill:
            logits = model.compute_logits(hidden[-1:]).float()
            total += torch.nn.functional.cross_entropy(logits, torch.tensor([token_ids[end]])).item()
    return total / (len(token_ids) - 1 - prefill)
