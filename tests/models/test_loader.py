"""Loading: sharded checkpoints, dtypes, dummy weights, presets, and the errors a user meets."""

from __future__ import annotations

import json

import pytest
import torch

from infer.layers.attention_metadata import AttentionMetadata
from infer.layers.linear import PrepackedLinear, can_prepack
from infer.models.config import ModelConfig
from infer.models.loader import load_model, num_parameters, resolve_model_path

from .tiny_models import save_tiny_model


def forward_logits(model, ids):
    meta = AttentionMetadata.prefill_only([len(ids)])
    return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), meta))


def test_sharded_checkpoint_loads_like_single_file(tmp_path):
    hf_model, single = save_tiny_model("qwen3", tmp_path)
    sharded = tmp_path / "sharded"
    hf_model.save_pretrained(sharded, max_shard_size="40KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    a, _, _ = load_model(str(single), dtype="float32")
    b, _, _ = load_model(str(sharded), dtype="float32")
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(pa, pb), name


def test_bfloat16_follows_float32(tmp_path):
    _, path = save_tiny_model("llama", tmp_path)
    fp32, _, _ = load_model(str(path), dtype="float32")
    bf16, _, _ = load_model(str(path), dtype="bfloat16")
    assert next(bf16.parameters()).dtype == torch.bfloat16
    ids = list(range(3, 40))
    a, b = forward_logits(fp32, ids), forward_logits(bf16, ids)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.8
    assert (a - b).abs().max() < 0.1 * a.abs().max()


@pytest.mark.parametrize("variant", ["llama", "llama3_rope_tied", "qwen3", "gemma3", "gpt2"])
def test_prepacked_bfloat16_linears_compute_what_plain_ones_do(tmp_path, variant):
    """On a CPU whose oneDNN does bf16, every bf16 nn.Linear (a tied LM head too) is replaced by a
    prepacked one, with the same logits up to bf16 rounding; elsewhere nothing is replaced."""
    _, path = save_tiny_model(variant, tmp_path)
    plain, _, _ = load_model(str(path), dtype="bfloat16", prepack=False)
    packed, _, _ = load_model(str(path), dtype="bfloat16")
    linears = sum(isinstance(m, torch.nn.Linear) for m in plain.modules())
    prepacked = sum(isinstance(m, PrepackedLinear) for m in packed.modules())
    assert linears > 0
    if not can_prepack(torch.bfloat16):
        assert prepacked == 0
        return
    assert prepacked == linears and not any(isinstance(m, torch.nn.Linear) for m in packed.modules())
    assert num_parameters(packed) == num_parameters(plain)  # a tied head counted once, as before
    ids = list(range(3, 40))
    a, b = forward_logits(plain, ids), forward_logits(packed, ids)
    assert (a - b).abs().max() < 0.05 * a.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9
    # fp32 is never prepacked (no faster there)
    fp32, _, _ = load_model(str(path), dtype="float32")
    assert not any(isinstance(m, PrepackedLinear) for m in fp32.modules())


def test_missing_weight_is_an_error(tmp_path):
    from safetensors.torch import load_file, save_file

    _, path = save_tiny_model("llama", tmp_path)
    state = load_file(path / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, path / "model.safetensors")
    with pytest.raises(ValueError, match="missing.*up_proj"):
        load_model(str(path))


def test_unsupported_architecture_lists_supported():
    with pytest.raises(ValueError, match="not supported; supported: .*LlamaForCausalLM"):
        ModelConfig.from_hf({"architectures": ["FalconForCausalLM"]})


def test_folder_without_config(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model_path(str(tmp_path))


def test_offline_hub_id_says_what_to_do(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="--load-format dummy"):
        resolve_model_path("nobody-here/no-such-model")


def test_dummy_preset_in_a_realistic_shape():
    model, cfg, _ = load_model("llama-50m", load_format="dummy", dtype="float32")
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_kv_heads) == (512, 8, 4)
    assert 45e6 < num_parameters(model) < 60e6
    logits = forward_logits(model, [1, 2, 3])
    assert logits.shape == (3, 32000) and torch.isfinite(logits).all()


@pytest.mark.parametrize(
    "name, layers, kv_heads, head_dim",
    [
        ("meta-llama/Llama-3.2-1B", 16, 8, 64),
        ("meta-llama/Llama-3.2-3B-Instruct", 28, 8, 128),
        ("Qwen/Qwen3-0.6B", 28, 8, 128),
        ("Qwen/Qwen3-4B", 36, 8, 128),
        ("google/gemma-3-1b-it", 26, 1, 256),
    ],
)
def test_seed_presets_parse(name, layers, kv_heads, head_dim):
    from infer.models.loader import read_config

    cfg = ModelConfig.from_hf(read_config(resolve_model_path(name, load_format="dummy")))
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) == (layers, kv_heads, head_dim)
