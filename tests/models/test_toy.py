"""The NanoGPT-style toy trains, saves as a GPT-2 folder, and reads the same in transformers."""

from __future__ import annotations

import json

import torch

from infer.layers.attention_metadata import AttentionMetadata
from infer.models.loader import load_model, num_parameters
from infer.models.toy import build_toy


def test_toy_trains_and_matches_transformers(tmp_path):
    import transformers

    path = build_toy(tmp_path / "toy", train_seconds=2.0)
    losses = json.loads((path / "train_log.json").read_text())["losses"]
    assert len(losses) >= 3 and losses[-1] < losses[0]
    ours, cfg, _ = load_model(str(path), dtype="float32")
    assert abs(num_parameters(ours) - 57_000) < 5_000  # the reference toy: 0.056769 M parameters
    assert cfg.max_position_embeddings == 64
    hf_tok = transformers.AutoTokenizer.from_pretrained(path)
    ids = hf_tok("In the beginning")["input_ids"]
    assert len(ids) == len("In the beginning") and hf_tok.decode(ids) == "In the beginning"
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        meta = AttentionMetadata.prefill_only([len(ids)])
        got = ours.compute_logits(ours(torch.tensor(ids), torch.arange(len(ids)), meta))
        torch.testing.assert_close(got, hf_model(torch.tensor([ids])).logits[0], atol=1e-4, rtol=1e-4)
