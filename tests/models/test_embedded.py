"""The embedded default model: loads in transformers unchanged, and we generate exactly what it does."""

from __future__ import annotations

import re

import pytest
import torch

from infer.engine.tokenizer import Tokenizer
from infer.eval.generate import generate
from infer.models.loader import EMBEDDED_MODEL, load_model, num_parameters
from infer.models.toy import TEXT as TOY_TEXT

PROMPTS = ["In the beginning God created", "And the LORD spake unto Moses, saying,", "Blessed are the"]


@pytest.fixture(scope="module")
def models():
    import transformers

    ours, cfg, _ = load_model(None, dtype="float32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL, dtype=torch.float32).eval()
    return ours, hf, Tokenizer.from_pretrained(EMBEDDED_MODEL)


def test_shape_and_size(models):
    ours, _, _ = models
    assert ours.config.architecture == "LlamaForCausalLM"
    assert 5e6 <= num_parameters(ours) <= 30e6
    size = sum(f.stat().st_size for f in EMBEDDED_MODEL.iterdir())
    assert size < 50 * 2**20


def test_greedy_equals_transformers(models):
    ours, hf, tok = models
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        got = generate(ours, [ids], max_new_tokens=24)[0]
        out = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None)
        assert got == out[0, len(ids) :].tolist(), prompt


def test_output_is_recognisable_kjv(models):
    """Greedy continuations speak the corpus: its words, its archaic forms. A random or broken model
    (or a wrong tokenizer) fails both checks."""
    ours, _, tok = models
    genesis_words = set(re.findall(r"[A-Za-z]+", TOY_TEXT.read_text()))
    markers = {"unto", "thee", "thou", "thy", "hath", "saith", "LORD", "shall"}
    prompts = [tok.encode(p) for p in PROMPTS]
    for prompt, out in zip(PROMPTS, generate(ours, prompts, max_new_tokens=32), strict=True):
        words = re.findall(r"[A-Za-z]+", tok.decode(out))
        assert len(words) >= 5, (prompt, words)
        known = sum(w in genesis_words for w in words) / len(words)
        # Genesis holds only part of the Bible's vocabulary (no "Moses", "Psalms"); random weights score 0.0
        assert known >= 0.75, (prompt, words)
    text = " ".join(tok.decode(out) for out in generate(ours, prompts, max_new_tokens=32))
    assert len(markers & set(re.findall(r"[A-Za-z]+", text))) >= 2, text
