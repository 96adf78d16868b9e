"""Model presets: every name and alias resolves, and each shape is the published model's.

The parameter counts are an independent check of the preset values: a typo in any dimension changes
them. They are counted on a transformers model built on the meta device (no memory, no weights).
"""

from __future__ import annotations

import pytest

from infer.models.presets import list_presets, preset_config, preset_names

NAMES = ("gemma-3-1b-it", "Llama-3.2-1B", "Llama-3.2-3B", "llama-50m", "Qwen3-0.6B", "Qwen3-4B")
ALIASES = {
    "meta-llama/Llama-3.2-1B": "Llama-3.2-1B",
    "meta-llama/Llama-3.2-1B-Instruct": "Llama-3.2-1B",
    "meta-llama/Llama-3.2-3B": "Llama-3.2-3B",
    "meta-llama/Llama-3.2-3B-Instruct": "Llama-3.2-3B",
    "Llama-3.2-3B-Instruct": "Llama-3.2-3B",
    "Qwen/Qwen3-0.6B": "Qwen3-0.6B",
    "qwen/QWEN3-4B": "Qwen3-4B",
    "google/gemma-3-1b-it": "gemma-3-1b-it",
    "GEMMA-3-1B-IT": "gemma-3-1b-it",
    "LLAMA-50M": "llama-50m",
}
# (total, non-embedding) parameters as published; None where no figure is published.
PUBLISHED = {
    "gemma-3-1b-it": (999_885_952, None),  # keras-hub gemma3_instruct_1b preset metadata, exact
    "Llama-3.2-1B": (1.23e9, None),  # Llama 3.2 model card: 1.23B
    "Llama-3.2-3B": (3.21e9, None),  # Llama 3.2 model card: 3.21B
    "Qwen3-0.6B": (0.6e9, 0.44e9),  # Qwen3-0.6B model card: 0.6B, non-embedding 0.44B
    "Qwen3-4B": (4.0e9, 3.6e9),  # Qwen3-4B model card: 4.0B, non-embedding 3.6B
    "llama-50m": (5.0e7, None),  # our CPU shape: "about 50M"
}


def test_list_presets():
    assert set(list_presets()) == set(NAMES)
    assert set(n.lower() for n in NAMES) <= set(preset_names())


@pytest.mark.parametrize("name", NAMES)
def test_every_preset_loads(name):
    cfg = preset_config(name)
    assert cfg is not None and cfg == preset_config(name.upper())
    assert cfg["architectures"][0].endswith("ForCausalLM")
    assert cfg["hidden_size"] > 0 and cfg["num_hidden_layers"] > 0 and cfg["vocab_size"] > 0
    assert cfg["num_attention_heads"] % cfg["num_key_value_heads"] == 0


@pytest.mark.parametrize("alias,name", sorted(ALIASES.items()))
def test_aliases(alias, name):
    assert preset_config(alias) == preset_config(name)


def test_unknown_and_fresh_copies():
    assert preset_config("gpt-5") is None
    cfg = preset_config("Llama-3.2-1B")
    cfg["rope_scaling"]["factor"] = 1.0
    assert preset_config("Llama-3.2-1B")["rope_scaling"]["factor"] == 32.0


def test_key_values():
    llama = preset_config("Llama-3.2-1B")
    assert llama["rope_scaling"] == {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    }
    assert llama["tie_word_embeddings"] is True and llama["rope_theta"] == 500000.0
    gemma = preset_config("google/gemma-3-1b-it")
    assert (gemma["sliding_window"], gemma["sliding_window_pattern"], gemma["head_dim"]) == (512, 6, 256)
    assert (gemma["rope_local_base_freq"], gemma["rope_theta"], gemma["query_pre_attn_scalar"]) == (
        10000,
        1000000,
        256,
    )
    expected = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)]
    assert gemma["layer_types"] == expected
    small = preset_config("llama-50m")
    shape = [
        small[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    ]
    assert shape == [512, 8, 8, 4] and small["intermediate_size"] == 1536 and small["vocab_size"] == 32000
    assert (small["max_position_embeddings"], small["rope_theta"], small["tie_word_embeddings"]) == (
        2048,
        10000.0,
        False,
    )


@pytest.mark.parametrize("name", NAMES)
def test_parameter_count_matches_published(name):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = preset_config(name)
    hf_config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    if name == "gemma-3-1b-it":  # our layer_types equal what transformers derives from sliding_window_pattern
        without = {k: v for k, v in cfg.items() if k != "layer_types"}
        assert transformers.Gemma3TextConfig(**without).layer_types == cfg["layer_types"]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    total = sum(p.numel() for p in model.parameters())
    non_embedding = total - model.get_input_embeddings().weight.numel()
    published_total, published_non_embedding = PUBLISHED[name]
    tolerance = 0.0 if name == "gemma-3-1b-it" else 0.2 if name == "llama-50m" else 0.01
    assert abs(total - published_total) <= tolerance * published_total
    if published_non_embedding is not None:
        assert abs(non_embedding - published_non_embedding) <= 0.01 * published_non_embedding
