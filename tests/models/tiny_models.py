"""Tiny random Hugging Face models of every supported architecture, saved with save_pretrained."""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)

# name -> (config class name, config overrides); each variant exercises one quirk
VARIANTS = {
    "llama": ("LlamaConfig", {}),
    "llama3_rope_tied": (
        "LlamaConfig",
        dict(
            tie_word_embeddings=True,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            rope_theta=500000.0,
        ),
    ),
    "llama_bias": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True, head_dim=32)),
    "mistral_window": ("MistralConfig", dict(sliding_window=7)),
    "qwen2": ("Qwen2Config", {}),
    # YaRN over an original context of 64: max_position_embeddings (256) = factor x 64, as checkpoints hold it
    "qwen2_yarn": (
        "Qwen2Config",
        dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    ),
    "qwen3": ("Qwen3Config", dict(head_dim=32)),
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            head_dim=32,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=24,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            },
        ),
    ),
    "gemma3_softcap": (
        "Gemma3TextConfig",
        dict(
            head_dim=16,
            sliding_window=5,
            layer_types=["full_attention", "sliding_attention"],
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
        ),
    ),
    "gpt2": ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, vocab_size=256)),
}


def build_hf_model(name: str, seed: int = 0):
    import transformers

    cls_name, overrides = VARIANTS[name]
    config_cls = getattr(transformers, cls_name)
    if cls_name == "GPT2Config":
        config = config_cls(**overrides, bos_token_id=0, eos_token_id=0)
    else:
        config = config_cls(
            **{**COMMON, **overrides, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 0}
        )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():  # perturb every tensor (norms too) so a weight loaded wrong shows up
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def save_tiny_model(name: str, root: Path, seed: int = 0):
    model = build_hf_model(name, seed)
    path = root / name
    model.save_pretrained(path)
    return model, path


def save_byte_tokenizer(path: Path) -> None:
    """A byte-level tokenizer with exactly 256 ids and no merges: fits the tiny models' vocab."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


def greedy_with(hf_model, ids: list[int], max_new_tokens: int, processor, eos_token_ids=None) -> list[int]:
    """transformers' greedy tokens after `ids` under one LogitsProcessor (eos_token_ids end them)."""
    import torch
    from transformers import LogitsProcessorList

    eos = sorted(eos_token_ids) if eos_token_ids else None
    out = hf_model.generate(
        torch.tensor([ids]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=eos[0] if eos else 1,  # not a BOS of id 0: generate would mask it out as padding
        logits_processor=LogitsProcessorList([processor]),
    )
    return out[0, len(ids) :].tolist()
