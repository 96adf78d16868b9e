"""/v1/embeddings, /score and /rerank on a real server, with the official openai client and httpx,
against sentence-transformers; vLLM's cases (tests/entrypoints/pooling: embed/test_online.py,
scoring/test_cross_encoder_online.py, scoring/test_bi_encoder_online.py) on tiny random models."""

from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import openai
import pytest

from tests.models.pooling_models import build_cross_encoder, build_embedder
from tests.server.conftest import API_KEY, ServerProcess

st = pytest.importorskip("sentence_transformers")
pytestmark = pytest.mark.slow  # servers in subprocesses

INPUT = "The best thing about vLLM is that it supports many different models"
TEXTS_1 = ["What is the capital of France?", "What is the capital of Germany?"]
TEXTS_2 = ["The capital of France is Paris.", "The capital of Germany is Berlin."]
DOCUMENTS = [
    "The capital of Brazil is Brasilia.",
    "The capital of France is Paris.",
    "Cross-encoders are neat",
]


def _start(folder, tmp_path_factory, *extra) -> ServerProcess:
    args = ["--model", str(folder), "--dtype", "float32", "--max-model-len", "64", *extra]
    return ServerProcess(args, tmp_path_factory.mktemp("log") / "server.log").start()


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    matryoshka = {"matryoshka_dimensions": [16, 32]}
    folder = build_embedder(
        tmp_path_factory.mktemp("e") / "m", "bert", "mean_tokens", extra_config=matryoshka
    )
    server = _start(folder, tmp_path_factory, "--max-num-batched-tokens", "64", "--max-num-seqs", "4")
    yield server, st.SentenceTransformer(str(folder), device="cpu"), str(folder)
    server.stop()


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    folder = build_cross_encoder(tmp_path_factory.mktemp("c") / "m", "xlm-roberta")
    server = _start(folder, tmp_path_factory)
    yield server, st.CrossEncoder(str(folder), device="cpu"), str(folder)
    server.stop()


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _assert_close(got, expected):
    got, expected = np.asarray(got), np.asarray(expected)
    cos = (got * expected).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(expected, axis=-1)
    assert cos.min() >= 0.9999
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-4)


def test_models_and_tokenize(embedder):
    server, _, name = embedder
    card = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert card["id"] == name and card["task"] == "embed"
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": INPUT}).json()["tokens"]
    assert tokens[0] == 0 and tokens[-1] == 1  # [CLS] ... [SEP]
    info = httpx.get(server.url + "/server_info").json()
    assert info["task"] == "embed" and info["max_model_len"] == 64 and info["dtype"] == "float32"
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_embeddings_of_texts_and_token_ids(embedder):
    server, model, _ = embedder
    client = _client(server)
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": INPUT}).json()["tokens"]
    expected = model.encode([INPUT])
    for given in (INPUT, tokens):
        response = client.embeddings.create(model=server.args[1], input=given, encoding_format="float")
        assert response.object == "list" and len(response.data) == 1
        assert response.data[0].object == "embedding" and response.data[0].index == 0
        assert response.usage.prompt_tokens == response.usage.total_tokens == len(tokens)
        _assert_close([response.data[0].embedding], expected)
    n = 10  # batched over several forwards (64-token budget, 4 sequences)
    texts = [f"{INPUT} {i}" for i in range(n)]
    response = client.embeddings.create(model=server.args[1], input=texts, encoding_format="float")
    assert [d.index for d in response.data] == list(range(n))
    _assert_close([d.embedding for d in response.data], model.encode(texts))
    ids = [httpx.post(server.url + "/tokenize", json={"prompt": t}).json()["tokens"] for t in texts]
    response = client.embeddings.create(model=server.args[1], input=ids)  # the client's default: base64
    _assert_close([d.embedding for d in response.data], model.encode(texts))
    assert response.usage.prompt_tokens == sum(len(t) for t in ids)


def test_base64_is_the_float_vector(embedder):
    server, _, _ = embedder
    body = {"input": ["Hello my name is", INPUT]}
    floats = httpx.post(server.url + "/v1/embeddings", json={**body, "encoding_format": "float"}).json()
    encoded = httpx.post(server.url + "/v1/embeddings", json={**body, "encoding_format": "base64"}).json()
    for f, b in zip(floats["data"], encoded["data"], strict=True):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        np.testing.assert_array_equal(decoded, np.asarray(f["embedding"], dtype=np.float32))


def test_concurrent_requests_share_forwards_and_get_their_own_vectors(embedder):
    server, model, _ = embedder
    texts = [f"request {i}: {INPUT[: 10 + 3 * i]}" for i in range(12)]

    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        responses = await asyncio.gather(*(client.embeddings.create(model="x", input=t) for t in texts))
        return [r.data[0].embedding for r in responses]

    with pytest.raises(openai.NotFoundError):  # the model name is checked
        asyncio.run(run())
    served = server.args[1]

    async def run_served():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        responses = await asyncio.gather(*(client.embeddings.create(model=served, input=t) for t in texts))
        return [r.data[0].embedding for r in responses]

    _assert_close(asyncio.run(run_served()), model.encode(texts))


def test_truncate_prompt_tokens(embedder):
    server, model, _ = embedder
    client = _client(server)
    text = "Como o Brasil pode fomentar o desenvolvimento de modelos de IA?"
    response = client.embeddings.create(
        model=server.args[1], input=[text], extra_body={"truncate_prompt_tokens": 10}
    )
    assert response.usage.prompt_tokens == 10
    tokens = list(range(5, 30))
    response = client.embeddings.create(
        model=server.args[1], input=tokens, extra_body={"truncate_prompt_tokens": 10}
    )
    assert response.usage.prompt_tokens == 10
    with pytest.raises(openai.BadRequestError, match="Please request a smaller truncation size") as exc:
        client.embeddings.create(model=server.args[1], input=text, extra_body={"truncate_prompt_tokens": 65})
    assert exc.value.body["param"] == "truncate_prompt_tokens"
    whole = client.embeddings.create(
        model=server.args[1], input=text * 20, extra_body={"truncate_prompt_tokens": -1}
    )
    assert whole.usage.prompt_tokens == 64
    with pytest.raises(openai.BadRequestError, match="Please reduce the length of the input prompt"):
        client.embeddings.create(model=server.args[1], input=text * 20)


def test_matryoshka_dimensions(embedder):
    server, _, _ = embedder
    client = _client(server)
    full = np.asarray(client.embeddings.create(model=server.args[1], input=INPUT).data[0].embedding)
    cut = np.asarray(
        client.embeddings.create(model=server.args[1], input=INPUT, dimensions=16).data[0].embedding
    )
    np.testing.assert_allclose(cut, full[:16] / np.linalg.norm(full[:16]), atol=1e-6)
    with pytest.raises(openai.BadRequestError, match=r"\[16, 32\]") as exc:
        client.embeddings.create(model=server.args[1], input=INPUT, dimensions=8)
    assert exc.value.body["param"] == "dimensions"


def test_bad_embedding_requests_are_openai_shaped_400s(embedder):
    server, _, _ = embedder
    for body in (
        {"input": []},
        {"input": [[]]},
        {"input": [8192]},  # beyond the vocabulary
        {"input": INPUT, "encoding_format": "int8"},
        {"input": INPUT, "dimensions": 0},
        {"input": INPUT, "truncate_prompt_tokens": -2},
        {},
    ):
        response = httpx.post(server.url + "/v1/embeddings", json=body)
        assert response.status_code == 400, body
        assert response.json()["error"]["type"] == "invalid_request_error"
    for path in ("/v1/completions", "/v1/chat/completions"):
        body = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}
        response = httpx.post(server.url + path, json=body)
        assert response.status_code == 400
        assert "/v1/embeddings" in response.json()["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 200  # and it keeps serving


def test_a_chat_as_input(embedder):
    """vLLM's test_chat_request: a chat embeds as its rendered prompt, without added special tokens."""
    server, _, _ = embedder
    messages = [
        {"role": "user", "content": "The cat sat on the mat."},
        {"role": "assistant", "content": "A feline was resting on a rug."},
        {"role": "user", "content": "Stars twinkle brightly in the night sky."},
    ]
    chat = httpx.post(server.url + "/v1/embeddings", json={"messages": messages, "encoding_format": "float"})
    assert chat.status_code == 200, chat.text
    prompt = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    body = {"input": prompt, "encoding_format": "float", "add_special_tokens": False}
    plain = httpx.post(server.url + "/v1/embeddings", json=body).json()
    assert chat.json()["usage"] == plain["usage"]
    np.testing.assert_allclose(chat.json()["data"][0]["embedding"], plain["data"][0]["embedding"], atol=1e-6)
    with_special = {"messages": messages, "add_special_tokens": True}
    response = httpx.post(server.url + "/v1/embeddings", json=with_special).json()
    assert response["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] + 2
    both = {"messages": messages, "continue_final_message": True, "add_generation_prompt": True}
    response = httpx.post(server.url + "/v1/embeddings", json=both)
    assert response.status_code == 400
    assert "Cannot set both `continue_final_message` and `add_generation_prompt`" in response.text
    response = httpx.post(server.url + "/v1/embeddings", json={"messages": messages, "input": "x"})
    assert response.status_code == 400


def test_score_of_an_embedding_model_is_cosine_similarity(embedder):
    server, model, _ = embedder
    response = httpx.post(server.url + "/score", json={"text_1": TEXTS_1[0], "text_2": TEXTS_2}).json()
    expected = st.util.cos_sim(model.encode(TEXTS_1[:1]), model.encode(TEXTS_2)).numpy()[0]
    np.testing.assert_allclose([d["score"] for d in response["data"]], expected, atol=1e-5)


def test_score_pairs_as_vllm(reranker):
    server, model, _ = reranker
    cases = [
        ({"text_1": TEXTS_1[0], "text_2": TEXTS_2[0]}, [(TEXTS_1[0], TEXTS_2[0])]),
        ({"text_1": TEXTS_1[0], "text_2": TEXTS_2}, [(TEXTS_1[0], t) for t in TEXTS_2]),
        ({"text_1": TEXTS_1, "text_2": TEXTS_2}, list(zip(TEXTS_1, TEXTS_2, strict=True))),
        ({"queries": TEXTS_1, "documents": TEXTS_2}, list(zip(TEXTS_1, TEXTS_2, strict=True))),
    ]
    for body, pairs in cases:
        for path in ("/score", "/v1/score"):
            response = httpx.post(server.url + path, json=body)
            assert response.status_code == 200, response.text
            score = response.json()
            assert score["object"] == "list" and score["id"]
            assert [d["index"] for d in score["data"]] == list(range(len(pairs)))
            np.testing.assert_allclose([d["score"] for d in score["data"]], model.predict(pairs), atol=1e-4)
    response = httpx.post(server.url + "/score", json={"text_1": TEXTS_1, "text_2": [*TEXTS_2, "x"]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "text_1"
    response = httpx.post(server.url + "/score", json={"text_1": TEXTS_1[0] * 30, "text_2": TEXTS_2})
    assert response.status_code == 400 and "Please reduce the length of the input prompt" in response.text
    body = {"text_1": TEXTS_1[0] * 30, "text_2": TEXTS_2, "truncate_prompt_tokens": 65}
    response = httpx.post(server.url + "/score", json=body)
    assert response.status_code == 400 and "Please request a smaller truncation size" in response.text


def test_rerank_as_jina_and_cohere(reranker):
    server, model, _ = reranker
    query = TEXTS_1[0]
    expected = model.predict([(query, d) for d in DOCUMENTS])
    order = list(np.argsort(-expected))
    results = None
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        response = httpx.post(server.url + path, json={"query": query, "documents": DOCUMENTS})
        assert response.status_code == 200, response.text
        rerank = response.json()
        assert [r["index"] for r in rerank["results"]] == order
        scores = [r["relevance_score"] for r in rerank["results"]]
        np.testing.assert_allclose(scores, expected[order], atol=1e-4)
        assert [r["document"]["text"] for r in rerank["results"]] == [DOCUMENTS[i] for i in order]
        assert rerank["usage"]["total_tokens"] > 0
        results = results or rerank["results"]
        assert rerank["results"] == results
    body = {"query": query, "documents": DOCUMENTS, "top_n": 2, "return_documents": False}
    top = httpx.post(server.url + "/rerank", json=body).json()["results"]
    assert [r["index"] for r in top] == order[:2] and all("document" not in r for r in top)


def test_use_activation(reranker):
    server, _, _ = reranker

    def scores(use_activation):
        body = {"query": TEXTS_1[0], "documents": DOCUMENTS, "use_activation": use_activation}
        results = httpx.post(server.url + "/rerank", json=body).json()["results"]
        return np.array([r["relevance_score"] for r in sorted(results, key=lambda r: r["index"])])

    default, with_it, without = scores(None), scores(True), scores(False)
    np.testing.assert_allclose(default, with_it)
    np.testing.assert_allclose(1 / (1 + np.exp(-without)), with_it, atol=1e-6)


def test_a_cross_encoder_neither_embeds_nor_generates(reranker):
    server, _, _ = reranker
    response = httpx.post(server.url + "/v1/embeddings", json={"input": "hi"})
    assert response.status_code == 400 and "/score" in response.json()["error"]["message"]
    response = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"})
    assert response.status_code == 400 and "/rerank" in response.json()["error"]["message"]


def test_a_generation_model_refuses_embeddings_and_scores(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="/v1/completions") as exc:
        client.embeddings.create(model="embedded", input="hi")
    assert exc.value.body["param"] == "model"
    headers = {"Authorization": f"Bearer {API_KEY}"}
    response = httpx.post(server.url + "/rerank", json={"query": "a", "documents": ["b"]}, headers=headers)
    assert response.status_code == 400 and "generates text" in response.text
    assert client.completions.create(model="embedded", prompt="In the", max_tokens=2).choices[0].text
