"""--scheduling-policy slo over HTTP: objectives in the body (the official client's extra_body), class
defaults from --slo-config, --slo-reject-late's 429, and the 400 where the server does not schedule by
objectives."""

from __future__ import annotations

import httpx
import openai
import pytest

from infer.core.slo import Objectives, SloClasses
from tests.server.conftest import API_KEY, ServerProcess

SLO_CONFIG = """
classes:
  - {name: short, prompt_tokens: [0, 64], max_tokens: [0, 16], ttft_ms: 60000, tpot_ms: 5000}
  - {name: rest, ttft_ms: 90000}
"""


@pytest.fixture(scope="module")
def slo_server(model_args, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("slo")
    (tmp / "slo.yaml").write_text(SLO_CONFIG)
    args = [*model_args, "--scheduling-policy", "slo", "--slo-config", str(tmp / "slo.yaml"),
            "--slo-reject-late", "--max-batch-size", "4"]  # fmt: skip
    proc = ServerProcess(args, tmp / "server.log").start()
    yield proc
    proc.stop()


@pytest.mark.slow  # a server of its own
def test_objectives_in_the_body_and_by_class(slo_server):
    client = openai.OpenAI(base_url=slo_server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    for extra in ({"ttft_slo_ms": 60000, "tpot_slo_ms": 1000}, {}):  # its own objectives, then its class's
        out = client.completions.create(
            model=model, prompt="In the beginning", max_tokens=8, temperature=0, extra_body=extra
        )
        assert out.usage.completion_tokens == 8 and out.choices[0].finish_reason == "length"
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
        extra_body={"ignore_eos": True, "ttft_slo_ms": 60000},
    )  # fmt: skip
    assert sum(1 for c in stream if c.choices and c.choices[0].delta.content) >= 1


@pytest.mark.slow  # a server of its own
def test_a_request_that_cannot_make_its_deadline_is_refused_with_a_reason(slo_server):
    body = {"prompt": "In the beginning", "max_tokens": 4, "ttft_slo_ms": 0.001}
    resp = httpx.post(slo_server.url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 429, resp.text
    error = resp.json()["error"]
    assert error["code"] == "slo_unattainable" and "time-to-first-token objective" in error["message"]
    assert httpx.get(slo_server.url + "/health").status_code == 200


@pytest.mark.slow  # a server of its own
def test_bad_objectives_are_400s(slo_server, server):
    for body, param in (({"ttft_slo_ms": 0}, "ttft_slo_ms"), ({"tpot_slo_ms": "inf"}, "tpot_slo_ms")):
        resp = httpx.post(slo_server.url + "/v1/completions", json={"prompt": "hi", **body}, timeout=60)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    resp = httpx.post(  # the shared server schedules by priority: objectives would be silently ignored
        server.url + "/v1/completions",
        json={"prompt": "hi", "max_tokens": 2, "ttft_slo_ms": 500},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    assert resp.status_code == 400 and "--scheduling-policy slo" in resp.json()["error"]["message"]


def test_classes_match_by_prompt_and_output_length_and_bad_files_say_why():
    siso = {"name": "siso", "prompt_tokens": [0, 256], "max_tokens": [0, 128], "ttft_ms": 500}
    lilo = {"name": "lilo", "prompt_tokens": [257, None], "max_tokens": [129, None], "tpot_ms": 80}
    classes = SloClasses.from_dict({"classes": [siso, lilo]})
    assert classes.objectives_for(256, 128) == Objectives(ttft_s=0.5)
    assert classes.objectives_for(257, 129) == Objectives(tpot_s=0.08)
    assert classes.objectives_for(257, 64) is None  # no class: no objectives
    for doc, fragment in (
        ({}, "needs `classes:`"),
        ({"classes": [{"name": "x", "ttft": 5}]}, "unknown keys"),
        ({"classes": [{"name": "x", "ttft_ms": -1}]}, "ttft_ms and tpot_ms"),
        ({"classes": [{"name": "x", "prompt_tokens": [10, 5]}]}, "prompt_tokens"),
    ):
        with pytest.raises(ValueError, match=fragment):
            SloClasses.from_dict(doc)
