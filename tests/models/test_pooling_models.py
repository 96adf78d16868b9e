"""Embedding models and cross-encoders against sentence-transformers, in float32.

Every architecture (BERT, XLM-RoBERTa, Qwen3 as an embedder) with every pooler it is served with, read
from the sentence-transformers folder as the hub's models ship it: cosine >= 0.9999 against
SentenceTransformer.encode (and the vectors themselves to 1e-5: normalisation follows the folder too).
Cross-encoders (BertForSequenceClassification, XLMRobertaForSequenceClassification) against
CrossEncoder.predict to 1e-4, pairs carrying their token types.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from infer.config import EngineConfig
from infer.engine.pooling import PoolingEngine, pooling_task, token_batches
from infer.models.pooler_config import read_pooler_config
from infer.runner.pooling_runner import PoolingInput
from tests.models.pooling_models import build_cross_encoder, build_embedder

st = pytest.importorskip("sentence_transformers")

TEXTS = [
    "In the beginning God created the heaven and the earth.",
    "And the earth was without form, and void; and darkness was upon the face of the deep.",
    "Light",
    "What is the capital of France?",
    "The capital of France is Paris.",
]
PAIRS = [(TEXTS[3], TEXTS[4]), (TEXTS[3], TEXTS[0]), (TEXTS[2], TEXTS[1]), (TEXTS[1], TEXTS[2])]

EMBEDDERS = [
    ("bert", "cls_token", True),
    ("bert", "mean_tokens", True),
    ("bert", "lasttoken", False),
    ("xlm-roberta", "mean_tokens", True),
    ("xlm-roberta", "cls_token", False),
    ("qwen3", "lasttoken", True),
    ("qwen3", "mean_tokens", True),
]


def _engine(folder, **kw) -> PoolingEngine:
    return PoolingEngine(EngineConfig(model=str(folder), dtype="float32", **kw))


def _embed(engine: PoolingEngine, texts, **kw) -> np.ndarray:
    return np.array(engine.encode([PoolingInput(engine.tokenizer.encode(t), **kw) for t in texts]))


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "pooling", "normalize"), EMBEDDERS)
def test_embeddings_match_sentence_transformers(tmp_path, arch, pooling, normalize):
    folder = build_embedder(tmp_path / "m", arch, pooling, normalize)
    expected = st.SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_numpy=True)
    engine = _engine(folder, max_num_batched_tokens=40, max_num_seqs=3)  # several batches, packed
    got = _embed(engine, TEXTS)
    assert got.shape == expected.shape
    assert _cosines(got, expected).min() >= 0.9999
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-4)
    if normalize:
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["bert", "xlm-roberta"])
@pytest.mark.parametrize("num_labels", [1, 3])
def test_cross_encoder_scores_match_sentence_transformers(tmp_path, arch, num_labels):
    folder = build_cross_encoder(tmp_path / "m", arch, num_labels)
    expected = st.CrossEncoder(str(folder), device="cpu").predict(PAIRS)
    engine = _engine(folder)
    inputs = [PoolingInput(*engine.tokenizer.encode_pair(a, b)) for a, b in PAIRS]
    got = np.array(engine.encode(inputs))
    np.testing.assert_allclose(got.reshape(expected.shape), expected, atol=1e-4)
    if num_labels == 1:  # a sigmoid, as CrossEncoder's default; without it, the logit
        raw = np.array(
            engine.encode([PoolingInput(x.token_ids, x.token_type_ids, use_activation=False) for x in inputs])
        )
        np.testing.assert_allclose(1 / (1 + np.exp(-raw[:, 0])), expected, atol=1e-5)


@pytest.mark.slow
def test_decoder_embedder_saved_as_causal_lm(tmp_path):
    """Qwen3-Embedding's config.json says Qwen3ForCausalLM over the body's tensors: `--runner pooling`
    serves it, and auto does not take it for a pooling model."""
    folder = build_embedder(tmp_path / "m", "qwen3", "lasttoken")
    expected = st.SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_numpy=True)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3ForCausalLM"]}))
    with pytest.raises(ValueError, match="generation model"):
        _engine(folder)
    got = _embed(_engine(folder, runner="pooling"), TEXTS)
    assert _cosines(got, expected).min() >= 0.9999


@pytest.mark.slow
def test_pooler_config_overrides_the_folder(tmp_path):
    folder = build_embedder(tmp_path / "m", "bert", "cls_token", normalize=True)
    mean = st.SentenceTransformer(str(build_embedder(tmp_path / "mean", "bert", "mean_tokens", False)))
    expected = mean.encode(TEXTS, convert_to_numpy=True)
    got = _embed(_engine(folder, pooler_config='{"pooling_type": "mean", "normalize": false}'), TEXTS)
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_matryoshka_dimensions_truncate_then_renormalise(tmp_path):
    folder = build_embedder(
        tmp_path / "m", "bert", "mean_tokens", extra_config={"matryoshka_dimensions": [16, 32]}
    )
    engine = _engine(folder)
    full = _embed(engine, TEXTS)
    cut = _embed(engine, TEXTS, dimensions=16)
    expected = full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True)
    np.testing.assert_allclose(cut, expected, atol=1e-6)
    engine.pooler.check_dimensions(32, 64)
    with pytest.raises(ValueError, match=r"\[16, 32\]"):
        engine.pooler.check_dimensions(8, 64)
    plain = _engine(build_embedder(tmp_path / "plain", "bert", "mean_tokens"))
    with pytest.raises(ValueError, match="Matryoshka"):
        plain.pooler.check_dimensions(16, 64)


def test_pooler_config_from_sentence_transformers_files(tmp_path):
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text('{"pooling_mode": "lasttoken"}')
    modules = [
        {"path": "", "type": "sentence_transformers.models.Transformer"},
        {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    config = read_pooler_config(tmp_path, {}, "embed", decoder=False)
    assert (config.pooling_type, config.normalize) == ("LAST", False)  # no Normalize module
    assert read_pooler_config(tmp_path / "none", {}, "embed", decoder=True).pooling_type == "LAST"
    assert read_pooler_config(tmp_path / "none", {}, "embed", decoder=False).normalize
    (tmp_path / "1_Pooling" / "config.json").write_text('{"pooling_mode": "weightedmean"}')
    with pytest.raises(ValueError, match="weightedmean"):
        read_pooler_config(tmp_path, {}, "embed", decoder=False)
    for bad in ('{"pooling_type": "MAX"}', '{"softmax": true}', "[1]", "{"):
        with pytest.raises(ValueError, match="--pooler-config"):
            read_pooler_config(tmp_path / "none", {}, "embed", decoder=False, override=bad)
    (tmp_path / "1_Pooling" / "config.json").write_text('{"pooling_mode": "mean"}')
    modules.append({"path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    modules.append({"path": "3_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    config = read_pooler_config(tmp_path, {}, "embed", decoder=False)
    assert (config.pooling_type, config.dense_folders, config.normalize) == ("MEAN", ("2_Dense",), True)
    modules[2:] = modules[:1:-1]  # Normalize, then Dense: the vector would be normalised before it
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="Dense module after Normalize"):
        read_pooler_config(tmp_path, {}, "embed", decoder=False)
    modules.append({"path": "4_LayerNorm", "type": "sentence_transformers.models.LayerNorm"})
    (tmp_path / "modules.json").write_text(json.dumps(modules[:3] + modules[4:]))
    with pytest.raises(ValueError, match="LayerNorm"):
        read_pooler_config(tmp_path, {}, "embed", decoder=False)


def test_cross_encoder_activation_as_sentence_transformers_saves_it():
    assert read_pooler_config(_nowhere(), {"num_labels": 1}, "classify", False).use_activation
    assert not read_pooler_config(
        _nowhere(), {"id2label": {"0": "a", "1": "b"}}, "classify", False
    ).use_activation
    saved = {"num_labels": 1, "sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"}}
    assert not read_pooler_config(_nowhere(), saved, "classify", False).use_activation


def _nowhere():
    from pathlib import Path

    return Path("/nonexistent")


def test_pooling_task_by_architecture_and_runner():
    assert pooling_task("BertModel", "auto") == "embed"
    assert pooling_task("XLMRobertaForSequenceClassification", "auto") == "classify"
    assert pooling_task("Qwen3ForCausalLM", "auto") is None
    assert pooling_task("Qwen3ForCausalLM", "pooling") == "embed"
    with pytest.raises(ValueError, match="--runner pooling"):
        pooling_task("BertModel", "generate")
    with pytest.raises(ValueError, match="cannot serve as a pooling model"):
        pooling_task("GPT2LMHeadModel", "pooling")


def test_token_batches_respect_the_budget():
    assert token_batches([3, 3, 3, 3], max_tokens=6, max_seqs=8) == [[0, 1], [2, 3]]
    assert token_batches([3, 3, 3, 3], max_tokens=100, max_seqs=3) == [[0, 1, 2], [3]]
    assert token_batches([2, 10, 2], max_tokens=6, max_seqs=8) == [[0], [1], [2]]  # too long: alone
    assert token_batches([], max_tokens=6, max_seqs=8) == []


def test_encode_pair_truncates_the_longer_text_first():
    import tempfile
    from pathlib import Path

    from infer.engine.tokenizer import Tokenizer
    from tests.models.pooling_models import _tokenizer

    folder = Path(tempfile.mkdtemp())
    _tokenizer(folder, "bert")
    tok = Tokenizer.from_pretrained(folder)
    a, b = tok.encode("one two three four five six seven eight", False), tok.encode("nine ten", False)
    ids, types = tok.encode_pair("one two three four five six seven eight", "nine ten")
    assert ids == [0, *a, 1, *b, 1] and types == [0] * (len(a) + 2) + [1] * (len(b) + 1)
    ids, types = tok.encode_pair("one two three four five six seven eight", "nine ten", max_length=9)
    assert len(ids) == 9 and ids[-len(b) - 1 :] == [*b, 1]  # the longer one lost its tail
    ids, _ = tok.encode_pair("one two three four five six seven eight", "nine ten", max_length=5)
    assert len(ids) == 5
    ids, _ = tok.encode_pair("one two three four five six seven eight", None, max_length=4)
    assert ids == [0, *a[:2], 1]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["bert", "qwen3"])
def test_the_default_dtype_stays_close_to_float32(tmp_path, arch):
    """`--dtype auto` (bfloat16 on a CPU with bf16 hardware, prepacked linears) against float32: a few
    texts (forwards of up to SMALL_ROWS rows: the small-batch kernel) and many (oneDNN, with the
    activation and the residual add in its epilogue)."""
    folder = build_embedder(tmp_path / "m", arch, "mean_tokens")
    for texts in (TEXTS, TEXTS * 40):
        exact = _embed(_engine(folder), texts)
        auto = _embed(PoolingEngine(EngineConfig(model=str(folder))), texts)
        assert _cosines(auto, exact).min() >= 0.999


DENSE = {
    "tanh": [{"in_features": 64, "out_features": 32}],  # sentence-transformers' default activation
    "identity-no-bias": [{"in_features": 64, "out_features": 96, "bias": False, "activation_function": None}],
    "two": [
        {"in_features": 64, "out_features": 48},
        {"in_features": 48, "out_features": 16, "activation_function": None},
    ],
    "residual": [
        {"in_features": 64, "out_features": 64, "use_residual": True},
        {"in_features": 64, "out_features": 24, "use_residual": True},
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("dense", list(DENSE))
@pytest.mark.parametrize(
    ("arch", "pooling", "normalize"), [("bert", "mean_tokens", True), ("qwen3", "lasttoken", False)]
)
def test_dense_modules_after_the_pooler_match_sentence_transformers(
    tmp_path, dense, arch, pooling, normalize
):
    folder = build_embedder(tmp_path / "m", arch, pooling, normalize, dense=DENSE[dense])
    expected = st.SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_numpy=True)
    engine = _engine(folder)
    got = _embed(engine, TEXTS)
    assert got.shape == expected.shape == (len(TEXTS), DENSE[dense][-1]["out_features"])
    assert _cosines(got, expected).min() >= 0.9999
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-4)
    assert engine.embedding_size == expected.shape[1]


def test_dense_modules_it_cannot_compute_are_refused(tmp_path):
    from safetensors.torch import save_file

    from infer.models.st_dense import load_dense

    save_file(
        {"linear.weight": torch.zeros(4, 8), "linear.bias": torch.zeros(4)}, tmp_path / "model.safetensors"
    )
    config = {"in_features": 8, "out_features": 4, "bias": True}
    for extra, message in [
        ({"activation_function": "torch.nn.modules.activation.Softplus"}, "Softplus"),
        ({"module_input_name": "token_embeddings"}, "token_embeddings"),
        ({"out_features": 5}, r"linear.weight is \[4, 8\]"),
    ]:
        (tmp_path / "config.json").write_text(json.dumps(config | extra))
        with pytest.raises(ValueError, match=message):
            load_dense(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))  # no activation named: Tanh, the default
    assert load_dense(tmp_path).activation is torch.tanh


@pytest.mark.parametrize("pooling", ["CLS", "LAST"])
@pytest.mark.parametrize("lens", [[5, 9, 3], [6, 6]])  # padded and masked, and all alike (no mask)
def test_encoder_last_layer_for_the_pooled_rows_alone_equals_the_full_forward(tmp_path, pooling, lens):
    from infer.layers.attention_metadata import AttentionMetadata
    from infer.layers.pooler import pool, pooled_rows

    engine = _engine(build_embedder(tmp_path / "m", "bert", "cls_token"))
    model = engine.runner.model
    assert model.computes_pooled_rows
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(5, engine.model_config.vocab_size, (sum(lens),), generator=gen)
    positions = torch.cat([torch.arange(n) for n in lens])
    meta = AttentionMetadata.prefill_only(lens)
    with torch.inference_mode():
        full = pool(model(input_ids, positions, meta), lens, pooling)
        only = model(input_ids, positions, meta, rows=pooled_rows(lens, pooling))
    assert only.shape == (len(lens), engine.model_config.hidden_size)
    torch.testing.assert_close(only.float(), full, atol=1e-5, rtol=1e-5)
