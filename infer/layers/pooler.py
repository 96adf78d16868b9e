"""Poolers: a packed batch's token states -> one vector per sequence, as sentence-transformers' Pooling
module computes them (and vLLM's CLS / MEAN / LAST poolers).

    hidden [num_tokens, hidden_size], rows of sequence i at starts[i] .. starts[i] + seq_lens[i]
      CLS   its first row ([CLS] / <s>: BERT-family embedders)
      MEAN  the mean of its rows (e5, gte; padding never enters: the batch is packed)
      LAST  its last row (decoder embedders: Qwen3-Embedding, whose tokenizer ends a text with EOS)

Sums and norms are taken in float32 whatever the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

POOLING_TYPES = ("CLS", "MEAN", "LAST")


def pooled_rows(seq_lens: list[int], pooling_type: str) -> torch.Tensor | None:
    """The one row of each sequence that a CLS or LAST pooler reads, [num_seqs]; None for MEAN."""
    lens = torch.tensor(seq_lens)
    starts = torch.cumsum(lens, 0) - lens
    if pooling_type == "CLS":
        return starts
    if pooling_type == "LAST":
        return starts + lens - 1
    return None


def pool(hidden: torch.Tensor, seq_lens: list[int], pooling_type: str) -> torch.Tensor:
    """[num_tokens, hidden_size] -> [num_seqs, hidden_size] float32."""
    if pooling_type in ("CLS", "LAST"):
        return hidden[pooled_rows(seq_lens, pooling_type)].float()
    lens = torch.tensor(seq_lens)
    if pooling_type == "MEAN":
        seq_of_row = torch.repeat_interleave(torch.arange(len(seq_lens)), lens)  # [num_tokens]
        sums = torch.zeros(len(seq_lens), hidden.shape[-1]).index_add_(0, seq_of_row, hidden.float())
        return sums / lens[:, None]
    raise ValueError(f"pooling type {pooling_type!r} is not supported; supported: {', '.join(POOLING_TYPES)}")


def normalize(x: torch.Tensor) -> torch.Tensor:
    """Each row to unit L2 norm (sentence-transformers' Normalize)."""
    return F.normalize(x, p=2, dim=-1)


def truncate_dimensions(x: torch.Tensor, dimensions: int, renormalize: bool) -> torch.Tensor:
    """A Matryoshka model's embedding cut to its first `dimensions`, renormalised when the full one was."""
    x = x[..., :dimensions]
    return normalize(x) if renormalize else x
