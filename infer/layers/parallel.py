"""Tensor parallelism inside a model: which rank holds which slice, and the two collectives.

Megatron's split, as vLLM does it: q/k/v and gate/up are column-parallel (each rank computes its heads
and its share of the MLP's inner width), o_proj and down_proj row-parallel (each rank multiplies its
slice of the inputs; one all-reduce sums the partial outputs), the embedding and the LM head
vocab-parallel (each rank holds a contiguous range of token rows). A layer of N ranks thus costs two
all-reduces, plus one for the embedding and one all-gather of the logits per step.

The linears themselves stay plain `nn.Linear` / `MergedLinear` of the local shape, so prepacking, the
small-batch kernel and quantization apply to a shard as they do to a whole weight; the model file calls
`tp.all_reduce` after a row-parallel linear. Which checkpoint slice a rank loads is the loader's business
(`shard_range` below, `CausalLM.tp_plan`). With one rank every collective is the identity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

COLUMN, ROW, VOCAB = "column", "row", "vocab"


@dataclass(frozen=True)
class TensorParallel:
    """This process's rank among `size` tensor-parallel ranks (torch.distributed's default group)."""

    rank: int = 0
    size: int = 1

    def split(self, n: int, what: str) -> int:
        """n // size, refused when the ranks cannot share n evenly."""
        if n % self.size:
            raise ValueError(f"{what} ({n}) must divide evenly over --tensor-parallel-size {self.size}")
        return n // self.size

    def kv_heads(self, num_kv_heads: int) -> int:
        """KV heads on this rank. With more ranks than KV heads each rank keeps one, replicated on
        size // num_kv_heads ranks (as vLLM does), so every rank's query heads find their group."""
        if self.size > num_kv_heads and self.size % num_kv_heads == 0:
            return 1
        return self.split(num_kv_heads, "the number of key/value heads")

    def vocab_rows(self, vocab_size: int) -> int:
        """Rows of the embedding / LM head on each rank: the vocabulary padded to a multiple of size."""
        return -(-vocab_size // self.size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place."""
        if self.size > 1:
            torch.distributed.all_reduce(x)
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[tokens, vocab_rows] on each rank -> [tokens, vocab_size], the padding rows cut."""
        if self.size == 1:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        torch.distributed.all_gather(parts, logits.contiguous())
        return torch.cat(parts, dim=-1)[:, :vocab_size]


SINGLE = TensorParallel()


def shard_range(style: str, full: int, local: int, tp: TensorParallel) -> tuple[int, int]:
    """(start, length) of this rank's slice of a checkpoint dimension of `full` entries, where the
    rank's parameter has `local`. Column and row shards are contiguous blocks; a block smaller than
    full / size is a replicated one (KV heads shared by several ranks); vocab shards may end short."""
    if style == VOCAB:
        start = tp.rank * local
        return start, max(0, min(local, full - start))
    if local * tp.size == full:
        return tp.rank * local, local
    if full % local == 0 and tp.size % (full // local) == 0:  # replicated: size // (full // local) each
        return tp.rank // (tp.size // (full // local)) * local, local
    raise ValueError(f"cannot split {full} entries into shards of {local} over {tp.size} ranks")


class VocabParallelEmbedding(nn.Embedding):
    """An embedding whose rows [rank * rows, (rank + 1) * rows) live on this rank; a token outside them
    contributes zeros, and the all-reduce adds the one rank's row that holds it."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = SINGLE):
        rows = tp.vocab_rows(vocab_size)
        # the loader fills the weight: a random init of a large vocabulary would cost seconds per load
        super().__init__(rows, hidden_size, _weight=torch.empty(rows, hidden_size))
        self.tp = tp
        self.first = tp.rank * self.num_embeddings

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(input_ids)
        local = input_ids - self.first
        outside = (local < 0) | (local >= self.num_embeddings)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)  # [num_tokens, hidden_size]
        return self.tp.all_reduce(h.masked_fill_(outside.unsqueeze(-1), 0))
