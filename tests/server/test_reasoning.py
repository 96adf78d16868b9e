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
from tests.server.test_openai_api import COMPACT

pytestmark = pytest.mark.slow  # a server of its own, with a reasoning parser

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


def test_structured_outputs_hold_for_the_answer_after_the_thinking(thinker):
    """vLLM's: the grammar starts after `</think>`. The embedded model never closes its thinking, so the
    constraint never starts: the output is the free one, all thinking. With enable_thinking false the
    grammar holds from the first token, and its text is the answer."""
    text = "<think>x</think>y"
    constrained = {"structured_outputs": {"choice": [text]}}
    free = _create(thinker).choices[0]
    thought = _create(thinker, extra_body=constrained).choices[0]
    assert thought.message.model_extra["reasoning_content"] == free.message.model_extra["reasoning_content"]
    assert thought.message.content is None and thought.finish_reason == "length"
    off = {**constrained, "chat_template_kwargs": {"enable_thinking": False}}
    answered = _create(thinker, extra_body=off, max_tokens=60).choices[0]
    assert answered.message.content == text and answered.message.model_extra["reasoning_content"] is None


def test_responses_carry_the_thinking_as_a_reasoning_item(thinker):
    text = _create(thinker).choices[0].message.model_extra["reasoning_content"]
    kwargs = {"model": "embedded", "input": ASK[0]["content"], "max_output_tokens": 16, "temperature": 0}
    resp = thinker.responses.create(**kwargs)
    [item] = resp.output  # all thinking: no answer came
    assert item.type == "reasoning" and item.content[0].text == text and item.status == "incomplete"
    assert resp.usage.output_tokens_details.reasoning_tokens == resp.usage.output_tokens == 16

    events = list(thinker.responses.create(**kwargs, stream=True))
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == text and len(deltas) > 1
    assert not [e for e in events if e.type == "response.output_text.delta"]
    final = events[-1].response
    assert events[-1].type == "response.incomplete" and final.output[0].content[0].text == text
    assert final.usage.output_tokens_details.reasoning_tokens == 16

    off = thinker.responses.create(**kwargs, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert [i.type for i in off.output] == ["message"] and off.output_text == text
    assert off.usage.output_tokens_details.reasoning_tokens == 0


def test_a_forced_call_comes_after_the_thinking(thinker):
    """tool_choice "required" is a grammar on the answer: the embedded model, thinking, never reaches
    `</think>`, so no call comes and the thinking is the free output's; told not to think, it calls."""
    city = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
    }
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": city}}]
    forced = {"tools": tools, "tool_choice": "required"}
    free = _create(thinker).choices[0].message.model_extra["reasoning_content"]
    thought = _create(thinker, **forced).choices[0]
    assert thought.message.model_extra["reasoning_content"] == free
    assert thought.message.tool_calls is None and thought.finish_reason == "length"
    chunks = list(_create(thinker, **forced, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == free
    assert not any(d.tool_calls for d in deltas)
    off = {**COMPACT, "chat_template_kwargs": {"enable_thinking": False}}
    called = _create(thinker, **forced, max_tokens=60, extra_body=off).choices[0]
    assert called.message.tool_calls[0].function.name == "get_weather"
    assert called.message.model_extra.get("reasoning_content") is None
    kwargs = {"model": "embedded", "input": ASK[0]["content"], "max_output_tokens": 16, "temperature": 0}
    function = {"type": "function", "name": "get_weather", "parameters": city}
    resp = thinker.responses.create(**kwargs, tools=[function], tool_choice="required")
    assert [item.type for item in resp.output] == ["reasoning"] and resp.output[0].content[0].text == free
