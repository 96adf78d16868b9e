"""Perplexity of a model on a text: how much quantization costs in quality.

`perplexity`: the text is cut into windows of `window` tokens, each scored on its own (one packed prefill
through the model's own paged attention, as the engine runs it), and the loss is averaged over every
predicted token. `decode_nll`: each token predicted by a one-token decode step over the cache, as a
generation computes it; the kernels take other paths for one row than for a prompt (one-row linears of
quantized weights, decode attention over fp8 codes), which prompts' perplexity never runs.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from infer.layers.attention import AttentionMetadata
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
    num_blocks = -(-window // BLOCK_SIZE)
    model_dtype = next(model.parameters()).dtype
    kv_caches = allocate_kv_cache(model.config, num_blocks, BLOCK_SIZE, kv_cache_dtype or model_dtype)
    total_nll, total_tokens = 0.0, 0
    for start in range(0, len(token_ids) - 1, window):
        ids = torch.tensor(token_ids[start : start + window + 1])
        inputs, targets = ids[:-1], ids[1:]
        n = len(inputs)
        meta = AttentionMetadata(
            query_lens=[n],
            seq_lens=[n],
            slot_mapping=torch.arange(n),
            block_tables=torch.arange(num_blocks).view(1, num_blocks),
            kv_caches=kv_caches,
            query_dtype=model_dtype,
        )
        hidden = model(inputs, torch.arange(n), meta)  # [n, hidden]
        logits = model.compute_logits(hidden).float()  # [n, vocab]
        total_nll += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
        total_tokens += n
    return math.exp(total_nll / total_tokens)


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
