"""Qwen3-Reranker served with vLLM's `--hf-overrides` on a real server: /rerank, /score and /v1/models,
scores against transformers' yes/no logits (tests/models/test_qwen3_reranker.py's reference), and
pooling requests counted in /metrics."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.models.pooling_models import build_qwen3_reranker
from tests.models.test_qwen3_reranker import HF_OVERRIDES, QUERY, format_document, format_query, hf_scores
from tests.server.conftest import ServerProcess

pytestmark = pytest.mark.slow  # a server in a subprocess

DOCUMENTS = [
    "The capital of Brazil is Brasilia.",
    "The capital of France is Paris.",
    "Gravity is a force that attracts two bodies towards each other.",
    "Paris",
]


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    folder = build_qwen3_reranker(tmp_path_factory.mktemp("q") / "m", tie_word_embeddings=True)
    args = ["--model", str(folder), "--dtype", "float32", "--hf-overrides", json.dumps(HF_OVERRIDES)]
    server = ServerProcess(args, tmp_path_factory.mktemp("log") / "server.log").start()
    query, documents = format_query(QUERY), [format_document(d) for d in DOCUMENTS]
    yield server, query, documents, hf_scores(folder, [(query, d) for d in documents])
    server.stop()


def _counters(server) -> dict[tuple[str, str], float]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, s.labels.get("finished_reason", ""))] = s.value
    return out


def test_models_says_it_classifies(reranker):
    server, *_ = reranker
    card = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert card["task"] == "classify"
    response = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"})
    assert response.status_code == 400 and "/rerank" in response.json()["error"]["message"]


def test_rerank_orders_by_the_yes_no_score(reranker):
    server, query, documents, expected = reranker
    order = [int(i) for i in np.argsort(-expected)]
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = {"query": query, "documents": documents, "top_n": 3, "return_documents": True}
        response = httpx.post(server.url + path, json=body, timeout=60).json()
        assert [r["index"] for r in response["results"]] == order[:3]
        got = [r["relevance_score"] for r in response["results"]]
        np.testing.assert_allclose(got, expected[order[:3]], atol=1e-4)
        assert response["results"][0]["document"]["text"] == documents[order[0]]


def test_score_and_metrics_count_each_pair(reranker):
    server, query, documents, expected = reranker
    before = _counters(server)
    response = httpx.post(
        server.url + "/score", json={"text_1": query, "text_2": documents}, timeout=60
    ).json()
    np.testing.assert_allclose([d["score"] for d in response["data"]], expected, atol=1e-4)
    after = _counters(server)
    assert (
        after[("infer:request_success_total", "stop")] - before[("infer:request_success_total", "stop")] == 4
    )
    prompt_tokens = after[("infer:prompt_tokens_total", "")] - before[("infer:prompt_tokens_total", "")]
    assert prompt_tokens == response["usage"]["prompt_tokens"] > 0
    latencies = after[("infer:e2e_request_latency_seconds_count", "")]
    assert latencies - before[("infer:e2e_request_latency_seconds_count", "")] == 4
