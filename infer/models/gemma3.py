"""Gemma 3 text decoder (Gemma3ForCausalLM, e.g. gemma-3-1b-it).

Its quirks live here: the (1 + w) RMSNorm, four norms per layer, the embedding scaled by
sqrt(hidden_size), sliding-window layers with their own (local) rope base, query_pre_attn_scalar, and
optional logit soft-capping (handled by the shared attention and CausalLM.compute_logits).
"""

from __future__ import annotations

import torch
from torch import nn

from infer.layers.parallel import SINGLE, TensorParallel, VocabParallelEmbedding
from infer.layers.rotary import RotaryEmbedding
from infer.models.config import SLIDING, ModelConfig
from infer.models.llama import CausalLM, LlamaAttention, LlamaMLP


class GemmaRMSNorm(nn.Module):
    """Scales by (1 + weight), all in float32: Gemma stores weights as offsets from 1."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).type_as(x)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, tp: TensorParallel):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx, rotary, norm_cls=GemmaRMSNorm, tp=tp)
        self.mlp = LlamaMLP(cfg, tp)
        dim, eps = cfg.hidden_size, cfg.norm_eps
        self.input_layernorm = GemmaRMSNorm(dim, eps)
        self.post_attention_layernorm = GemmaRMSNorm(dim, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(dim, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(dim, eps)

    def forward(self, positions, h, meta):
        h = h + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(h), meta))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.embed_scale = cfg.hidden_size**0.5
        full = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
        local = full
        if cfg.rope_local is not None:
            local = RotaryEmbedding(cfg.rope_local, cfg.head_dim, cfg.max_position_embeddings)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, i, local if cfg.layer_types[i] == SLIDING else full, tp)
            for i in range(cfg.num_layers)
        )
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.norm_eps)

    def forward(self, input_ids, positions, meta):
        h = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        h = h * torch.tensor(self.embed_scale, dtype=h.dtype)  # rounded to the model dtype, as HF does
        for layer in self.layers:
            h = layer(positions, h, meta)
        return self.norm(h)


class Gemma3ForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__(cfg, tp)
        self.model = Gemma3Model(cfg, tp)
        self.lm_head = nn.Linear(cfg.hidden_size, tp.vocab_rows(cfg.vocab_size), bias=False)
        self.tie_weights()

    def input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def forward(self, input_ids, positions, meta):
        return self.model(input_ids, positions, meta)
