"""The NanoGPT-style toy of the micro-benchmarks: a char-level GPT-2 with a 64-token context.

The reference engine's toy has 0.057M parameters (n_embd 32, 4 layers, 4 heads, block_size 64) and is
trained for a few seconds before each benchmark; so is ours, on the book of Genesis (KJV, public domain)
shipped in infer/assets/toy. It is saved as a standard GPT2LMHeadModel folder with a char-level
tokenizer.json, so the loader, the engine and transformers all read it like any other model.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from infer.layers.attention_metadata import AttentionMetadata
from infer.models.config import ModelConfig
from infer.models.gpt2 import _CONV1D, GPT2LMHeadModel
from infer.models.loader import init_dummy_weights

TEXT = Path(__file__).resolve().parent.parent / "assets" / "toy" / "genesis.txt"
TOY_SHAPE = dict(n_embd=32, n_layer=4, n_head=4, n_positions=64)


def build_toy(out_dir: str | Path, train_seconds: float = 5.0, seed: int = 0, batch_size: int = 16) -> Path:
    """Train the toy for `train_seconds` of wall time and save it as an HF folder at `out_dir`."""
    text = TEXT.read_text()
    chars = sorted(set(text))
    vocab = {c: i for i, c in enumerate(chars)}
    hf_config = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": len(chars),
        **TOY_SHAPE,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": True,
        "bos_token_id": None,
        "eos_token_id": None,
        "dtype": "float32",
    }
    model = GPT2LMHeadModel(ModelConfig.from_hf(hf_config))
    init_dummy_weights(model, seed)  # GPT-2's N(0, 0.02): nn defaults start the tied head far too hot
    losses = _train(model, torch.tensor([vocab[c] for c in text]), train_seconds, batch_size, seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _save(model, hf_config, vocab, out)
    (out / "train_log.json").write_text(json.dumps({"seconds": train_seconds, "losses": losses}))
    return out


def _train(model, data: torch.Tensor, seconds: float, batch_size: int, seed: int) -> list[float]:
    ctx = TOY_SHAPE["n_positions"]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    meta = AttentionMetadata.prefill_only([ctx] * batch_size)
    positions = torch.arange(ctx).repeat(batch_size)
    losses: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        starts = torch.randint(0, len(data) - ctx - 1, (batch_size,), generator=gen)
        windows = torch.stack([data[s : s + ctx + 1] for s in starts.tolist()])  # [batch, ctx + 1]
        logits = model.compute_logits(model(windows[:, :-1].flatten(), positions, meta))
        loss = torch.nn.functional.cross_entropy(logits, windows[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(round(loss.item(), 4))
    return losses


def _save(model, hf_config: dict, vocab: dict[str, int], out: Path) -> None:
    state = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied to transformer.wte.weight
        state[name] = (tensor.t() if name.endswith(_CONV1D) else tensor).contiguous()
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": {"type": "Fuse"},  # chars join without spaces
        "model": {"type": "BPE", "vocab": vocab, "merges": [], "unk_token": None, "fuse_unk": False},
    }
    (out / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": TOY_SHAPE["n_positions"]}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config))
