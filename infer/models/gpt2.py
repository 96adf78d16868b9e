"""GPT-2 (GPT2LMHeadModel): learned positions, LayerNorm, fused c_attn. Also the NanoGPT-style toy."""

from __future__ import annotations

import torch
from torch import nn

from infer.layers.activations import get_activation
from infer.layers.attention import attention
from infer.layers.linear import MergedLinear
from infer.layers.parallel import COLUMN, ROW, SINGLE, VOCAB, TensorParallel, VocabParallelEmbedding
from infer.models.config import ModelConfig
from infer.models.llama import CausalLM

# HF stores these as Conv1D, whose weight is [in, out]: the transpose of nn.Linear's
_CONV1D = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")


class GPT2Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TensorParallel):
        super().__init__()
        self.layer_idx, self.head_dim, self.tp = layer_idx, cfg.head_dim, tp
        self.num_heads = tp.split(cfg.num_heads, "the number of attention heads")  # this rank's
        size = self.num_heads * self.head_dim
        self.c_attn = MergedLinear(cfg.hidden_size, [size] * 3, bias=True)  # q | k | v
        self.c_proj = nn.Linear(size, cfg.hidden_size)
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else self.head_dim**-0.5

    def forward(self, x, meta):
        qkv = self.c_attn(x).view(-1, 3, self.num_heads, self.head_dim)  # [num_tokens, 3, heads, head_dim]
        q, k, v = qkv.unbind(1)
        out = attention(q, k, v, meta, self.layer_idx, self.scale).flatten(1)
        return self.tp.all_reduce(self.c_proj(out))


class GPT2MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        size = tp.split(cfg.intermediate_size, "intermediate_size")
        self.c_fc = nn.Linear(cfg.hidden_size, size)
        self.c_proj = nn.Linear(size, cfg.hidden_size)
        self.act = get_activation(cfg.hidden_act)

    def forward(self, x):
        return self.tp.all_reduce(self.c_proj(self.act(self.c_fc(x))))


class GPT2Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TensorParallel):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = GPT2Attention(cfg, layer_idx, tp)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = GPT2MLP(cfg, tp)

    def forward(self, h, meta):
        h = h + self.attn(self.ln_1(h), meta)
        return h + self.mlp(self.ln_2(h))


class GPT2Model(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.wte = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.wpe = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.h = nn.ModuleList(GPT2Block(cfg, i, tp) for i in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)

    def forward(self, input_ids, positions, meta):
        h = self.wte(input_ids) + self.wpe(positions)  # [num_tokens, hidden_size]
        for block in self.h:
            h = block(h, meta)
        return self.ln_f(h)


class GPT2LMHeadModel(CausalLM):
    packed_modules = {}
    tp_plan = {"c_attn": COLUMN, "c_fc": COLUMN, "c_proj": ROW, "wte": VOCAB, "lm_head": VOCAB}

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__(cfg, tp)
        self.transformer = GPT2Model(cfg, tp)
        self.lm_head = nn.Linear(cfg.hidden_size, tp.vocab_rows(cfg.vocab_size), bias=False)
        self.tie_weights()

    def input_embeddings(self) -> nn.Embedding:
        return self.transformer.wte

    def forward(self, input_ids, positions, meta):
        return self.transformer(input_ids, positions, meta)

    def remap_weight(self, name: str, tensor: torch.Tensor):
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            return None  # causal-mask buffers of old checkpoints, not weights
        if not name.startswith(("transformer.", "lm_head.")):
            name = "transformer." + name  # the original openai-community/gpt2 files have no prefix
        if name.endswith(_CONV1D):
            tensor = tensor.t()
        return name, tensor
