"""--reasoning-parser through the server and the official client: the model's thinking comes back as
`reasoning_content` (and vLLM's `reasoning`), streamed as its own deltas, and
`chat_template_kwargs.enable_thinking: false` makes the output the answer. The embedded model never
closes a thinking it never opened, so its free output is all thinking (as vLLM reads an output cut
short before `</think>`); the split of a thinking from its answer is tested on text in
test_reasoning_parsers.py."""

from __future__ import annotations

import openai
import pytest

from tests.server.conftest import API_KEY, ServerProcess

ASK = [{"role": "user", "content": "In the beginning"}]


@pytest.fixture(scope="module")
def thinking_server(model_args, tmp_path_factory):
    args = [*model_args, "--api-key", API_KEY, "--reasoning-parser", "qwen3"]
    proc = ServerProcess(args, tmp_path_factory.mktemp("thinking_server") / "server.log").start(timeout=300)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def thinker(thinking_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=thinking_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _create(client, **kwargs):
    kwargs = {"model": "embedded", "messages": ASK, "max_tokens": 16, "temperature": 0, **kwargs}
    return client.chat.completions.create(**kwargs)


def test_thinking_is_reasoning_content_and_streams_as_its_own_deltas(thinker):
    answered = _create(thinker, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    text = answered.choices[0].message.content
    assert text and "</think>" not in text
    assert answered.choices[0].message.model_extra.get("reasoning_content") is None

    message = _create(thinker).choices[0].message
    assert message.content is None
    assert message.model_extra["reasoning_content"] == message.model_extra["reasoning"] == text

    chunks = list(_create(thinker, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    thoughts = [d.model_extra.get("reasoning_content") for d in deltas]
    assert "".join(t or "" for t in thoughts) == text and sum(bool(t) for t in thoughts) > 1
    assert all(d.model_extra.get("reasoning") == d.model_extra.get("reasoning_content") for d in deltas)
    assert not any(d.content for d in deltas)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_a_constrained_output_is_the_answer(thinker):
    """Structured outputs constrain the output from its first token here, thinking included: what they
    make is the answer, read as such."""
    text = "<think>x</think>y"
    resp = _create(thinker, extra_body={"structured_outputs": {"choice": [text]}}, max_tokens=60)
    assert resp.choices[0].message.content == text
