"""The pooling runner: whole sequences -> one forward without a KV cache -> a vector (or a classifier's
logits) per sequence.

What a pooling model serves is a prefill and nothing after it: no cache to keep, no tokens to sample, no
step to come back to. So it does not go through the generation scheduler and its block pool; the
engine (infer.engine.pooling) hands this runner batches of whole sequences under the token budget, and
each batch is one packed forward (AttentionMetadata.prefill_only: bidirectional for the encoders of
infer/models/bert.py, causal for decoder embedders).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from infer.layers.attention_metadata import AttentionMetadata
from infer.layers.pooler import normalize, pool, pooled_rows, truncate_dimensions


@dataclass
class PoolingInput:
    token_ids: list[int]
    token_type_ids: list[int] | None = None  # a cross-encoder's pair: 0 for the first text, 1 the second
    dimensions: int | None = None  # a Matryoshka embedding's size
    use_activation: bool = True  # a cross-encoder's sigmoid (when the model has one)


class PoolingRunner:
    def __init__(
        self,
        model,
        pooling_type: str,
        normalize: bool,
        classify: bool,
        use_activation: bool,
        project: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        """classify: the model has a classifier (`model.classify`), whose logits are returned instead of
        a pooled vector; use_activation: whether its scores take a sigmoid, unless a request says not;
        project: what maps a pooled float32 vector before normalisation (sentence-transformers' Dense)."""
        self.model = model
        self.pooling_type, self.normalize = pooling_type, normalize
        self.classify, self.use_activation = classify, use_activation
        self.project = project

    @torch.inference_mode()
    def run(self, inputs: list[PoolingInput]) -> list[list[float]]:
        """One packed forward over `inputs`: per input its embedding, or its classifier's scores."""
        seq_lens = [len(x.token_ids) for x in inputs]
        input_ids = torch.tensor([t for x in inputs for t in x.token_ids])  # [num_tokens]
        positions = torch.cat([torch.arange(n) for n in seq_lens])  # [num_tokens]
        types = None
        if any(x.token_type_ids for x in inputs):
            types = torch.tensor([t for x in inputs for t in (x.token_type_ids or [0] * len(x.token_ids))])
        meta = AttentionMetadata.prefill_only(seq_lens)
        rows = pooled_rows(seq_lens, self.pooling_type)
        if rows is not None and getattr(self.model, "computes_pooled_rows", False):
            # the model's last layer runs for the pooled rows alone: [num_seqs, hidden_size]
            pooled = self.model(input_ids, positions, meta, types, rows=rows).float()
        else:
            pooled = pool(self.model(input_ids, positions, meta, types), seq_lens, self.pooling_type)
        if self.classify:
            # a cross-encoder's first token ([CLS]), a decoder classifier's last (the pooler's type)
            return self._scores(pooled, inputs)
        # pooled: [num_seqs, hidden_size] float32
        if self.project is not None:
            pooled = self.project(pooled)  # [num_seqs, embedding size]
        if self.normalize:
            pooled = normalize(pooled)
        out = []
        for row, x in zip(pooled, inputs, strict=True):
            if x.dimensions is not None:
                row = truncate_dimensions(row, x.dimensions, self.normalize)
            out.append(row.tolist())
        return out

    def _scores(self, first_rows: torch.Tensor, inputs: list[PoolingInput]) -> list[list[float]]:
        dtype = next(self.model.parameters()).dtype
        logits = self.model.classify(first_rows.to(dtype)).float()  # [num_seqs, num_labels]
        out = []
        for row, x in zip(logits, inputs, strict=True):
            out.append((torch.sigmoid(row) if self.use_activation and x.use_activation else row).tolist())
        return out
