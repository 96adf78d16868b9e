"""A decoder served as an embedding model (Qwen3-Embedding: Qwen3 + last-token pooling): the Llama-family
body of llama.py without its LM head.

Embedding checkpoints hold the body alone, saved as `Qwen3Model` (tensors named `layers.0...`) even where
config.json says `Qwen3ForCausalLM`; a causal LM's checkpoint has a `model.` prefix and an `lm_head`.
Both load here: the prefix is added where missing and the LM head skipped. Attention stays causal, as
the model was trained, and runs without a KV cache (AttentionMetadata.prefill_only).
"""

from __future__ import annotations

import torch
from torch import nn

from infer.layers.attention_metadata import AttentionMetadata
from infer.layers.parallel import SINGLE, TensorParallel
from infer.models.config import ModelConfig
from infer.models.llama import CausalLM, LlamaModel


class DecoderEmbeddingModel(CausalLM):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__(cfg, tp)
        self.model = LlamaModel(cfg, tp)

    def remap_weight(self, name: str, tensor):
        if name.startswith("lm_head."):
            return None
        return (name if name.startswith("model.") else f"model.{name}"), tensor

    def tie_weights(self) -> None:
        pass  # no LM head to tie

    def input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def forward(self, input_ids, positions, meta: AttentionMetadata, token_type_ids=None) -> torch.Tensor:
        return self.model(input_ids, positions, meta)  # [num_tokens, hidden_size], after the final norm
