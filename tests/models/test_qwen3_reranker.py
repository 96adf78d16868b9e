"""Qwen3-Reranker as vLLM serves it: the causal LM's "yes"/"no" logits made a one-row classifier by
`hf_overrides` (score = sigmoid(logit_yes - logit_no)), and a checkpoint already converted to
Qwen3ForSequenceClassification; against transformers in float32, to 1e-4, on tiny random models with
Qwen3-Reranker's tokenizer shape. The cases are vLLM's (tests/models/language/pooling/
test_qwen3_reranker.py, test_qwen3_reranker_seq_cls.py; examples/offline_inference/qwen3_reranker.py).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from infer.config import EngineConfig
from infer.engine.llm import LLM
from infer.engine.pooling import PoolingEngine
from infer.engine.pooling_inputs import ScoreJob
from infer.models.config import ModelConfig
from infer.runner.pooling_runner import PoolingInput
from tests.models.pooling_models import build_qwen3_reranker

transformers = pytest.importorskip("transformers")

HF_OVERRIDES = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True,
}
# Qwen3-Reranker's prompt (its model card's, vLLM's example): the query carries the instruction
PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
    'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
QUERY = "What is the capital of France?"
DOCUMENTS = ["The capital of Brazil is Brasilia.", "The capital of France is Paris.", "Explain gravity"]


def format_query(query: str) -> str:
    return f"{PREFIX}<Instruct>: {INSTRUCTION}\n<Query>: {query}\n"


def format_document(document: str) -> str:
    return f"<Document>: {document}{SUFFIX}"


def hf_scores(folder, pairs) -> np.ndarray:
    """vLLM's reference: the causal LM's last logits, log_softmax over [no, yes], exp of yes."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    model = transformers.Qwen3ForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    false_id, true_id = tokenizer.convert_tokens_to_ids("no"), tokenizer.convert_tokens_to_ids("yes")
    scores = []
    with torch.no_grad():
        for a, b in pairs:  # one at a time: no padding to get wrong
            ids = torch.tensor([tokenizer(a, b)["input_ids"]])
            last = model(input_ids=ids).logits[0, -1]
            two = torch.log_softmax(torch.stack([last[false_id], last[true_id]]), dim=0)
            scores.append(two[1].exp().item())
    return np.array(scores)


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def reranker(request, tmp_path_factory):
    return build_qwen3_reranker(tmp_path_factory.mktemp("r") / "m", tie_word_embeddings=request.param)


PAIRS = [(format_query(QUERY), format_document(d)) for d in DOCUMENTS]


@pytest.mark.slow
def test_llm_score_matches_transformers_yes_no_logits(reranker):
    expected = hf_scores(reranker, PAIRS)
    llm = LLM(str(reranker), dtype="float32", hf_overrides=HF_OVERRIDES)  # a dict, as vLLM's LLM takes
    got = np.array([o.outputs.score for o in llm.score(PAIRS[0][0], [b for _, b in PAIRS])])
    np.testing.assert_allclose(got, expected, atol=1e-4)
    assert len(set(np.round(expected, 4))) == len(expected)  # the random model tells the pairs apart
    pairwise = np.array([o.outputs.score for o in llm.score([a for a, _ in PAIRS], [b for _, b in PAIRS])])
    np.testing.assert_allclose(pairwise, expected, atol=1e-4)


@pytest.mark.slow
def test_hf_overrides_as_json_text_batches_pairs_packed(reranker):
    """The flag's JSON text; pairs in batches of several (packed, causal, last token of each)."""
    expected = hf_scores(reranker, PAIRS)
    config = EngineConfig(
        model=str(reranker),
        dtype="float32",
        hf_overrides=json.dumps(HF_OVERRIDES),
        max_num_batched_tokens=300,
    )
    engine = PoolingEngine(config)
    assert engine.task == "classify" and engine.pooler.pooling_type == "LAST" and engine.num_labels == 1
    job = ScoreJob.build(engine, PAIRS * 2)
    np.testing.assert_allclose(job.scores(engine.encode(job.inputs)), np.tile(expected, 2), atol=1e-4)
    raw = ScoreJob.build(engine, PAIRS, use_activation=False)  # the logit: yes - no
    logits = np.array(raw.scores(engine.encode(raw.inputs)))
    np.testing.assert_allclose(1 / (1 + np.exp(-logits)), expected, atol=1e-5)


@pytest.mark.slow
def test_converted_sequence_classification_checkpoint(tmp_path):
    """A reranker saved as Qwen3ForSequenceClassification (its score head one row, yes - no) needs no
    overrides, and scores as transformers' Qwen3ForSequenceClassification does."""
    causal = build_qwen3_reranker(tmp_path / "causal", tie_word_embeddings=False)
    expected = hf_scores(causal, PAIRS)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(causal))
    lm = transformers.Qwen3ForCausalLM.from_pretrained(str(causal), dtype=torch.float32)
    head = lm.lm_head.weight
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    config = lm.config
    config.architectures, config.num_labels = ["Qwen3ForSequenceClassification"], 1
    seq_cls = transformers.Qwen3ForSequenceClassification(config).eval()
    seq_cls.model.load_state_dict(lm.model.state_dict())
    with torch.no_grad():
        seq_cls.score.weight.copy_(head[yes] - head[no])
    folder = tmp_path / "seq-cls"
    seq_cls.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    with torch.no_grad():
        hf_logits = [
            seq_cls(input_ids=torch.tensor([tokenizer(a, b)["input_ids"]])).logits[0, 0] for a, b in PAIRS
        ]
    np.testing.assert_allclose(torch.sigmoid(torch.stack(hf_logits)).numpy(), expected, atol=1e-5)

    llm = LLM(str(folder), dtype="float32")
    got = np.array([o.outputs.score for o in llm.score(PAIRS[0][0], [b for _, b in PAIRS])])
    np.testing.assert_allclose(got, expected, atol=1e-4)


def _base() -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
    }


def test_overrides_make_a_one_label_classifier():
    cfg = ModelConfig.from_hf(_base() | HF_OVERRIDES)
    assert cfg.architecture == "Qwen3ForSequenceClassification" and cfg.qk_norm
    assert (cfg.num_labels, cfg.classifier_method, cfg.classifier_from_token) == (
        1,
        "from_2_way_softmax",
        ("no", "yes"),
    )
    rows = ModelConfig.from_hf(
        _base()
        | HF_OVERRIDES
        | {
            "is_original_qwen3_reranker": False,
            "method": "no_post_processing",
            "classifier_from_token": ["a", "b", "c"],
        }
    )
    assert rows.num_labels == 3 and rows.classifier_method == "no_post_processing"
    converted = ModelConfig.from_hf(
        _base() | {"architectures": ["Qwen3ForSequenceClassification"], "id2label": {"0": "LABEL_0"}}
    )
    assert converted.num_labels == 1 and converted.classifier_method is None


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"is_original_qwen3_reranker": False}, "needs a method"),
        ({"classifier_from_token": ["no", "yes", "maybe"]}, "two tokens"),
        ({"classifier_from_token": []}, "two tokens"),
        ({"is_original_qwen3_reranker": False, "method": "from_3_way"}, "not supported"),
    ],
)
def test_bad_overrides_say_what_is_wrong(extra, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(_base() | HF_OVERRIDES | extra)


@pytest.mark.parametrize(("text", "message"), [("{not json", "not valid JSON"), ('["a"]', "JSON object")])
def test_hf_overrides_text_must_be_a_json_object(text, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(hf_overrides=text)


@pytest.mark.slow
def test_a_token_missing_from_the_vocabulary(tmp_path):
    folder = build_qwen3_reranker(tmp_path / "m")
    with pytest.raises(ValueError, match="'oui' is not a token"):
        LLM(str(folder), hf_overrides=HF_OVERRIDES | {"classifier_from_token": ["non", "oui"]})


def test_the_engine_takes_every_decoder_classifier_for_a_pooling_model():
    from infer.engine import pooling
    from infer.models import config

    assert set(pooling.DECODER_CLASSIFIERS) == set(config.DECODER_CLASSIFIERS)


@pytest.mark.slow
def test_no_post_processing_keeps_each_tokens_logit(reranker):
    """vLLM's other method: one label per token, its LM head row as it is (the logits themselves, no
    sigmoid with two labels)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(reranker))
    model = transformers.Qwen3ForCausalLM.from_pretrained(str(reranker), dtype=torch.float32).eval()
    ids = [tokenizer.convert_tokens_to_ids(t) for t in ("no", "yes")]
    with torch.no_grad():
        expected = [
            model(input_ids=torch.tensor([tokenizer(a, b)["input_ids"]])).logits[0, -1, ids] for a, b in PAIRS
        ]
    overrides = HF_OVERRIDES | {"is_original_qwen3_reranker": False, "method": "no_post_processing"}
    engine = PoolingEngine(EngineConfig(model=str(reranker), dtype="float32", hf_overrides=overrides))
    assert engine.num_labels == 2 and not engine.pooler.use_activation
    got = engine.encode([PoolingInput(engine.tokenizer.encode_pair(a, b)[0]) for a, b in PAIRS])
    np.testing.assert_allclose(np.array(got), torch.stack(expected).numpy(), atol=1e-4)
