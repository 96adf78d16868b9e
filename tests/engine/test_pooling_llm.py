"""LLM.embed and LLM.score offline, as vLLM's (`.outputs.embedding`, `.outputs.score`), against
sentence-transformers; vLLM's offline cases (tests/entrypoints/pooling/llm: test_embedding, test_score)."""

from __future__ import annotations

import numpy as np
import pytest

from infer.engine.llm import LLM
from tests.models.pooling_models import build_cross_encoder, build_embedder

st = pytest.importorskip("sentence_transformers")
pytestmark = pytest.mark.slow  # each builds a model

PROMPTS = ["The chef prepared a delicious meal.", "The capital of France is Paris.", "Light"]
TEXTS_1 = ["What is the capital of France?", "What is the capital of Germany?"]
TEXTS_2 = ["The capital of France is Paris.", "The capital of Germany is Berlin."]


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    return build_embedder(tmp_path_factory.mktemp("e") / "m", "bert", "mean_tokens")


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    return build_cross_encoder(tmp_path_factory.mktemp("c") / "m", "xlm-roberta")


def test_embed_matches_sentence_transformers_and_batching_changes_nothing(embedder):
    expected = st.SentenceTransformer(str(embedder), device="cpu").encode(PROMPTS)
    llm = LLM(str(embedder), dtype="float32", max_num_batched_tokens=16, max_num_seqs=2)
    outputs = llm.embed(PROMPTS)
    got = np.array([o.outputs.embedding for o in outputs])
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-4)
    assert [o.prompt_token_ids for o in outputs] == [llm.pooling.tokenizer.encode(p) for p in PROMPTS]
    one = llm.embed(PROMPTS[0])  # a single prompt, and token ids
    assert len(one) == 1 and np.allclose(one[0].outputs.embedding, got[0], atol=1e-6)
    by_ids = llm.embed([outputs[1].prompt_token_ids])
    assert np.allclose(by_ids[0].outputs.embedding, got[1], atol=1e-6)
    cut = llm.embed(PROMPTS[0], truncate_prompt_tokens=4)
    assert len(cut[0].prompt_token_ids) == 4 and cut[0].prompt_token_ids[-1] == 1  # ends with its [SEP]
    with pytest.raises(ValueError, match="generate"):
        llm.generate("hello")


def test_score_of_an_embedding_model_is_cosine_similarity(embedder):
    model = st.SentenceTransformer(str(embedder), device="cpu")
    expected = st.util.cos_sim(model.encode(TEXTS_1[:1]), model.encode(TEXTS_2)).numpy()[0]
    llm = LLM(str(embedder), dtype="float32")
    got = [o.outputs.score for o in llm.score(TEXTS_1[0], TEXTS_2)]
    np.testing.assert_allclose(got, expected, atol=1e-5)


def test_score_of_a_cross_encoder(cross_encoder):
    """vLLM's test_score: 1 x 1, 1 x N and N x N pairs against CrossEncoder.predict."""
    model = st.CrossEncoder(str(cross_encoder), device="cpu")
    llm = LLM(str(cross_encoder), dtype="float32")
    one = llm.score(TEXTS_1[0], TEXTS_2[0])
    assert len(one) == 1
    assert one[0].outputs.score == pytest.approx(
        float(model.predict([(TEXTS_1[0], TEXTS_2[0])])[0]), abs=1e-4
    )
    got = [o.outputs.score for o in llm.score(TEXTS_1[0], TEXTS_2)]
    np.testing.assert_allclose(got, model.predict([(TEXTS_1[0], t) for t in TEXTS_2]), atol=1e-4)
    got = [o.outputs.score for o in llm.score(TEXTS_1, TEXTS_2)]
    np.testing.assert_allclose(got, model.predict(list(zip(TEXTS_1, TEXTS_2, strict=True))), atol=1e-4)
    with pytest.raises(ValueError, match="text_1 has 2 texts and text_2 3"):
        llm.score(TEXTS_1, [*TEXTS_2, "x"])
    with pytest.raises(ValueError, match="cross-encoder"):
        llm.embed("hello")


def test_a_generation_model_does_not_embed():
    llm = LLM(None, max_model_len=64, num_kv_blocks=8)
    with pytest.raises(ValueError, match="pooling model"):
        llm.embed("hello")


def test_infer_generate_on_a_pooling_model_says_what_to_use(embedder, capsys):
    from infer import cli

    assert cli.main(["generate", "--model", str(embedder), "--prompt", "hello"]) == 2
    err = capsys.readouterr().err
    assert "is a pooling model" in err and "infer serve" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "budget, lengths, forwards",
    [
        (None, [128] * 64, [64]),  # the pooling default: 64 texts of 128 tokens are one forward
        (None, [128] * 96, [64, 32]),
        (1024, [128] * 32, [8, 8, 8, 8]),  # a budget that was set is kept
        (200, [50, 120, 40, 100, 128, 60], [3, 1, 1, 1]),  # shortest first
    ],
)
def test_a_requests_inputs_take_as_few_forwards_as_the_budget_allows(embedder, budget, lengths, forwards):
    """PoolingEngine.encode packs a request's inputs into forwards of at most the token budget: 8192
    tokens (POOLING_TOKEN_BUDGET) unless --max-num-batched-tokens was set; counted, not timed."""
    from infer.engine import pooling

    flags = {} if budget is None else {"max_num_batched_tokens": budget}
    flags["max_num_seqs"] = 4 if budget == 200 else 128
    llm = LLM(str(embedder), dtype="float32", **flags)
    engine = llm.pooling
    assert engine.max_num_batched_tokens == (budget or pooling.POOLING_TOKEN_BUDGET)
    sizes = []
    run = engine.runner.run
    engine.runner.run = lambda inputs: sizes.append(len(inputs)) or run(inputs)
    vocab = engine.model_config.vocab_size
    ids = [[(7 * i + j) % (vocab - 1) + 1 for j in range(n)] for i, n in enumerate(lengths)]
    outputs = llm.embed(ids)
    assert sizes == forwards and len(outputs) == len(lengths)
