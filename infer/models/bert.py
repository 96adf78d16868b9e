"""BERT-family encoders: BERT and XLM-RoBERTa (bge, e5, gte, multilingual-e5), and their cross-encoders.

Against the decoders of llama.py: attention is bidirectional (every token of a sequence sees every
other), nothing is cached (a sequence is encoded whole, once), positions come from a learned table
(XLM-RoBERTa numbers them from pad_token_id + 1) beside a token-type (segment) table, and the norms
come after each sublayer's residual add (post-LN), with biases everywhere.

Inputs are flat as everywhere: `input_ids[num_tokens]`, `positions[num_tokens]` (from 0 in each
sequence), the sequences' lengths in `meta.query_lens` (AttentionMetadata.prefill_only). The
classifiers read each sequence's first token ([CLS] / <s>), as transformers' heads do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from infer.layers.activations import get_activation
from infer.layers.attention_metadata import AttentionMetadata
from infer.layers.linear import MergedLinear, linear_act, linear_add
from infer.layers.parallel import SINGLE, TensorParallel
from infer.models.config import ModelConfig


@dataclass(frozen=True)
class PaddedLayout:
    """Where a packed batch's tokens sit once its sequences are padded to the longest, computed once per
    forward for every layer: `rows` are the tokens' rows of the padded [num_seqs * longest] buffer, and
    `mask` [num_seqs, 1, 1, longest] the keys that exist (None, both, when every sequence is as long)."""

    num_seqs: int
    longest: int
    rows: torch.Tensor | None = None
    mask: torch.Tensor | None = None

    @classmethod
    def of(cls, seq_lens: list[int]) -> PaddedLayout:
        longest = max(seq_lens)
        if all(n == longest for n in seq_lens):
            return cls(len(seq_lens), longest)
        keep = torch.arange(longest)[None, :] < torch.tensor(seq_lens)[:, None]  # [num_seqs, longest]
        return cls(len(seq_lens), longest, keep.flatten().nonzero().squeeze(1), keep[:, None, None, :])


def bidirectional_attention(q, k, v, layout: PaddedLayout, scale: float) -> torch.Tensor:
    """q, k, v: [num_tokens, num_heads, head_dim] of packed sequences -> the same shape, each token
    attending to every token of its own sequence. Sequences are padded to the longest and masked: one
    SDPA call for the batch, where a call per sequence costs tens of microseconds each.

    q may instead hold one query per sequence [num_seqs, num_heads, head_dim] (the row a pooler reads):
    then the result has that shape, each query over its own sequence's keys."""
    n, longest, heads = layout.num_seqs, layout.longest, q.shape[1:]
    if q.shape[0] == n and k.shape[0] != n:  # one query per sequence
        return _one_query_per_sequence(q, k, v, layout, scale)
    if layout.rows is None:  # no padding: a view
        q, k, v = (t.reshape(n, longest, *heads).transpose(1, 2) for t in (q, k, v))  # [n, heads, len, dim]
        out = F.scaled_dot_product_attention(q, k, v, scale=scale)
        return out.transpose(1, 2).reshape(-1, *heads)
    padded = []
    for t in (q, k, v):  # zeros, not garbage, under the mask: 0 x NaN would still be NaN
        buf = t.new_zeros(n * longest, *heads).index_copy_(0, layout.rows, t)
        padded.append(buf.view(n, longest, *heads).transpose(1, 2))  # [n, num_heads, longest, head_dim]
    out = F.scaled_dot_product_attention(*padded, attn_mask=layout.mask, scale=scale)
    return out.transpose(1, 2).reshape(n * longest, *heads).index_select(0, layout.rows)


def _one_query_per_sequence(q, k, v, layout: PaddedLayout, scale: float) -> torch.Tensor:
    n, longest, heads = layout.num_seqs, layout.longest, k.shape[1:]
    if layout.rows is None:
        k, v = (t.reshape(n, longest, *heads).transpose(1, 2) for t in (k, v))  # [n, heads, len, dim]
    else:
        k, v = (
            t.new_zeros(n * longest, *heads)
            .index_copy_(0, layout.rows, t)
            .view(n, longest, *heads)
            .transpose(1, 2)
            for t in (k, v)
        )
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=layout.mask, scale=scale)
    return out.squeeze(2)  # [n, heads, dim]


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        num_positions = cfg.max_position_embeddings + cfg.position_offset
        self.position_embeddings = nn.Embedding(num_positions, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.position_offset = cfg.position_offset

    def forward(self, input_ids, positions, token_type_ids) -> torch.Tensor:
        h = self.word_embeddings(input_ids) + self.position_embeddings(positions + self.position_offset)
        return self.LayerNorm(h + self.token_type_embeddings(token_type_ids))  # [num_tokens, hidden_size]


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        size = cfg.num_heads * cfg.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, [size, size, size], bias=True)

    def forward(
        self, x: torch.Tensor, layout: PaddedLayout, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """rows: the tokens whose outputs are wanted (one per sequence), else every token's."""
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
        shape = (-1, self.num_heads, self.head_dim)  # [num_tokens, num_heads, head_dim]
        q = q.reshape(shape) if rows is None else q.index_select(0, rows).reshape(shape)
        out = bidirectional_attention(q, k.reshape(shape), v.reshape(shape), layout, self.head_dim**-0.5)
        return out.flatten(1)  # [num_tokens or len(rows), hidden_size]


class BertSelfOutput(nn.Module):
    """A sublayer's output projection, then the residual add and its norm (post-LN)."""

    def __init__(self, in_size: int, cfg: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(in_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)

    def forward(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(linear_add(self.dense, h, residual))  # the add in the GEMM where prepacked


class BertAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        setattr(self, "self", BertSelfAttention(cfg))  # noqa: B010 (transformers' name, a Python keyword)
        self.output = BertSelfOutput(cfg.hidden_size, cfg)

    def forward(self, x, layout, rows=None):
        residual = x if rows is None else x.index_select(0, rows)
        return self.output(self.self(x, layout, rows), residual)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.act = get_activation(cfg.hidden_act)

    def forward(self, x):
        return linear_act(self.dense, self.act, x)  # fused where the dense layer is prepacked


class BertLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention = BertAttention(cfg)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertSelfOutput(cfg.intermediate_size, cfg)

    def forward(self, x, layout, rows=None):
        h = self.attention(x, layout, rows)
        return self.output(self.intermediate(h), h)


class BertEncoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_layers))

    def forward(self, h, layout, rows=None):
        """rows: where only those tokens' final states are wanted (a CLS pooler's), the last layer
        computes only them: their queries over all the keys, and their output projection and MLP."""
        for layer in self.layer[:-1]:
            h = layer(h, layout)
        return self.layer[-1](h, layout, rows)


class BertModel(nn.Module):
    """The encoder alone (BertModel, XLMRobertaModel: what embedding checkpoints hold): hidden states of
    every token, for a pooler (infer.layers.pooler) to reduce."""

    # checkpoint prefixes of the encoder inside the task models (BertForMaskedLM, ...)
    prefixes = ("bert.", "roberta.")
    computes_pooled_rows = True  # forward(..., rows=): the last layer for the pooled tokens alone
    packed_modules = {"qkv_proj": ("query", "key", "value")}
    tp_plan: dict[str, str] = {}

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        if tp.size > 1:
            raise ValueError(f"{cfg.architecture} does not run under tensor parallelism")
        self.config, self.tp = cfg, tp
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertEncoder(cfg)

    def remap_weight(self, name: str, tensor):
        """Task prefixes off; the parts of other heads (the MLM head, BertModel's unused pooler) and old
        checkpoints' position-id buffers skipped."""
        for prefix in self.prefixes:
            name = name.removeprefix(prefix)
        if name.startswith(("embeddings", "encoder")) and not name.endswith("position_ids"):
            return name, tensor
        return None

    def tie_weights(self) -> None:
        pass

    def input_embeddings(self) -> nn.Embedding:
        return self.embeddings.word_embeddings

    def forward(
        self, input_ids, positions, meta: AttentionMetadata, token_type_ids=None, rows=None
    ) -> torch.Tensor:
        """[num_tokens, hidden_size]; with `rows` (one token per sequence: the row its pooler reads),
        those tokens' states alone [len(rows), hidden_size], the last layer run for them only."""
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        h = self.embeddings(input_ids, positions, token_type_ids)
        return self.encoder(h, PaddedLayout.of(meta.query_lens), rows)


class BertForSequenceClassification(BertModel):
    """A cross-encoder: BERT's pooler (tanh of a dense layer over [CLS]) and a linear classifier."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__(cfg, tp)
        self.pooler = nn.Module()
        self.pooler.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.classifier = nn.Linear(cfg.hidden_size, cfg.num_labels)

    def remap_weight(self, name: str, tensor):
        name = name.removeprefix("bert.")
        if name.startswith(("pooler.", "classifier.")):
            return name, tensor
        return super().remap_weight(name, tensor)

    def classify(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        """[num_seqs, hidden_size] first-token states -> [num_seqs, num_labels] logits."""
        return self.classifier(torch.tanh(self.pooler.dense(cls_hidden)))


class XLMRobertaForSequenceClassification(BertModel):
    """A cross-encoder (bge-reranker): RoBERTa's head, dense + tanh + out_proj over <s>."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__(cfg, tp)
        self.classifier = nn.Module()
        self.classifier.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.classifier.out_proj = nn.Linear(cfg.hidden_size, cfg.num_labels)

    def remap_weight(self, name: str, tensor):
        if name.startswith("classifier."):
            return name, tensor
        return super().remap_weight(name, tensor)

    def classify(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        return self.classifier.out_proj(torch.tanh(self.classifier.dense(cls_hidden)))
