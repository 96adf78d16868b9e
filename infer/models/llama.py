"""Llama-family decoders: Llama 2/3/3.1/3.2, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norms).

Inputs are flat: `input_ids[num_tokens]`, `positions[num_tokens]`, with the packing of sequences
described by AttentionMetadata (see infer/layers/attention_metadata.py).
"""

from __future__ import annotations

import torch
from torch import nn

from infer.layers.activations import gated_act, get_activation
from infer.layers.attention import attention
from infer.layers.attention_metadata import AttentionMetadata
from infer.layers.linear import MergedLinear
from infer.layers.norms import RMSNorm
from infer.layers.parallel import COLUMN, ROW, SINGLE, VOCAB, TensorParallel, VocabParallelEmbedding
from infer.layers.rotary import RotaryEmbedding
from infer.models.config import SLIDING, ModelConfig


class LlamaAttention(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, norm_cls=RMSNorm, tp=SINGLE
    ):
        super().__init__()
        self.layer_idx, self.tp, self.head_dim = layer_idx, tp, cfg.head_dim
        self.num_heads = tp.split(cfg.num_heads, "the number of attention heads")  # this rank's
        self.num_kv_heads = tp.kv_heads(cfg.num_kv_heads)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, [q_size, kv_size, kv_size], bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        if cfg.qk_norm:
            self.q_norm = norm_cls(self.head_dim, cfg.norm_eps)
            self.k_norm = norm_cls(self.head_dim, cfg.norm_eps)
        self.rotary = rotary
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else self.head_dim**-0.5
        self.sliding_window = cfg.sliding_window if cfg.layer_types[layer_idx] == SLIDING else None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [num_tokens, num_heads, head_dim]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [num_tokens, num_kv_heads, head_dim]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = attention(q, k, v, meta, self.layer_idx, self.scale, self.sliding_window)
        return self.tp.all_reduce(self.o_proj(out.flatten(1)))  # [num_tokens, hidden_size]


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        size = tp.split(cfg.intermediate_size, "intermediate_size")
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [size, size], bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = get_activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj
        if getattr(gate_up, "fused_silu", False):  # a PrepackedLinear applying it (infer/layers/linear.py)
            h = gate_up.silu_and_mul(x)
        else:
            h = gated_act(self.act, gate_up(x))
        return self.tp.all_reduce(self.down_proj(h))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, tp: TensorParallel):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx, rotary, tp=tp)
        self.mlp = LlamaMLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)

    def forward(self, positions, h, residual, meta):
        """(h, residual) -> (h, residual): the residual stream is carried beside the sublayer output and
        added in the next norm (RMSNorm.add, one pass), as vLLM does; the sums equal `h = h + ...`."""
        if residual is None:
            h, residual = self.input_layernorm(h), h
        else:
            h, residual = self.input_layernorm.add(h, residual)
        h = self.self_attn(positions, h, meta)
        h, residual = self.post_attention_layernorm.add(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, rotary, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)

    def forward(self, input_ids, positions, meta):
        h = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        residual = None
        for layer in self.layers:
            h, residual = layer(positions, h, residual, meta)
        return self.norm.add(h, residual)[0]


class CausalLM(nn.Module):
    """What every model class offers the loader and the runner."""

    # fused parameter -> the checkpoint names it concatenates, in order
    packed_modules: dict[str, tuple[str, ...]] = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }
    # module name -> how its weights split over tensor-parallel ranks (infer.layers.parallel); the
    # modules not named (norms, rotary) are replicated
    tp_plan: dict[str, str] = {
        "qkv_proj": COLUMN,
        "gate_up_proj": COLUMN,
        "o_proj": ROW,
        "down_proj": ROW,
        "embed_tokens": VOCAB,
        "lm_head": VOCAB,
    }

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.config, self.tp = cfg, tp

    def remap_weight(self, name: str, tensor) -> tuple[str, object] | None:
        """Checkpoint name/tensor -> ours; None skips it. Identity unless a model's format differs.
        The loader passes a lazily read tensor (infer.models.loader.LazyTensor: `.shape`, `.t()`)."""
        return name, tensor

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """[num_tokens, vocab_size] logits in float32, or with float32=False in the LM head's dtype unless
        soft-capping needs float math (the sampler upcasts where it computes: greedy rows need not)."""
        logits = self.tp.gather_vocab(self.lm_head(hidden), self.config.vocab_size)
        cap = self.config.final_logit_softcapping
        if cap:
            logits = logits.float()
            return torch.tanh(logits / cap) * cap
        return logits.float() if float32 else logits

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.input_embeddings().weight


class LlamaForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__(cfg, tp)
        self.model = LlamaModel(cfg, tp)
        self.lm_head = nn.Linear(cfg.hidden_size, tp.vocab_rows(cfg.vocab_size), bias=False)
        self.tie_weights()

    def input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)  # [num_tokens, hidden_size]
