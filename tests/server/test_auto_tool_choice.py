"""tool_choice "auto" with --enable-auto-tool-choice --tool-call-parser hermes, through the official
client: the calls the model writes come back as `tool_calls`, streamed and not, and an agent's history
(the assistant's calls, the tool's answer) goes back through the chat template.

The embedded model writes no calls of its own: `structured_outputs.choice` makes it write a given text,
so the test asserts the protocol, not the model's judgement."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from tests.server.conftest import API_KEY, ServerProcess

pytestmark = pytest.mark.slow  # a server of its own, with a tool-call parser

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TWO_CALLS = CALL + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
# Qwen2.5's way of writing calls and tool answers, as its chat template does (a compact version of it)
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n"
    "</tools><|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant"
    "{% if message.content %}\n{{ message.content }}{% endif %}"
    "{% for call in message.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}\n'
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def agent_server(model_args, tmp_path_factory):
    args = [
        *model_args,
        "--api-key",
        API_KEY,
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--trust-request-chat-template",
    ]
    proc = ServerProcess(args, tmp_path_factory.mktemp("agent_server") / "server.log").start(timeout=300)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def agent(agent_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=agent_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _says(text: str, **kwargs) -> dict:
    """Request arguments under which the model writes `text`."""
    extra = {"structured_outputs": {"choice": [text]}, **kwargs.pop("extra_body", {})}
    return {"model": "embedded", "temperature": 0, "max_tokens": 200, "extra_body": extra, **kwargs}


def _streamed(agent, **kwargs):
    chunks = list(agent.chat.completions.create(stream=True, **kwargs))
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(chunk)
    return chunks, state.current_completion_snapshot.choices[0]


def test_a_call_the_model_writes_is_a_tool_call(agent):
    text = "Let me check. " + CALL
    resp = agent.chat.completions.create(messages=ASK, tools=[WEATHER], **_says(text))
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check. "
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}

    chunks, streamed = _streamed(agent, messages=ASK, tools=[WEATHER], **_says(text))
    assert streamed.finish_reason == "tool_calls" and streamed.message.content == "Let me check. "
    [scall] = streamed.message.tool_calls
    assert (scall.function.name, scall.function.arguments) == (call.function.name, call.function.arguments)
    contents = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "<tool" not in contents and "{" not in contents  # no part of the call leaked as content
    names = [tc.function.name for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert [n for n in names if n] == ["get_weather"]  # the name once


def test_two_calls(agent):
    resp = agent.chat.completions.create(messages=ASK, tools=[WEATHER], **_says(TWO_CALLS))
    calls = resp.choices[0].message.tool_calls
    assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Paris"}, {"city": "Zürich"}]
    assert len({c.id for c in calls}) == 2 and resp.choices[0].message.content is None
    _, streamed = _streamed(agent, messages=ASK, tools=[WEATHER], **_says(TWO_CALLS))
    streamed_arguments = [c.function.arguments for c in streamed.message.tool_calls]
    assert streamed_arguments == [c.function.arguments for c in calls]


@pytest.mark.parametrize(
    "text, max_tokens",
    [
        (CALL.replace("}}", "}"), 200),  # a brace short
        ("<tool_call>\nnot a call at all\n</tool_call>", 200),
        (CALL, 8),  # cut by max_tokens
    ],
)
def test_malformed_or_cut_calls_are_text(agent, text, max_tokens):
    resp = agent.chat.completions.create(messages=ASK, tools=[WEATHER], **_says(text, max_tokens=max_tokens))
    choice = resp.choices[0]
    assert not choice.message.tool_calls
    assert choice.finish_reason == ("length" if max_tokens < 200 else "stop")
    assert text.startswith(choice.message.content)


def test_without_tools_or_with_tool_choice_none_calls_stay_text(agent):
    for kwargs in ({}, {"tools": [WEATHER], "tool_choice": "none"}):
        resp = agent.chat.completions.create(messages=ASK, **kwargs, **_says(CALL))
        assert resp.choices[0].message.content == CALL and not resp.choices[0].message.tool_calls


def test_an_agent_loop_round_trip(agent, agent_server):
    """call -> the tool's answer -> the final answer: the assistant's calls and the tool's message go back
    through the chat template, the arguments as an object (not the JSON text OpenAI's format carries)."""
    template = {"chat_template": HERMES_TEMPLATE}
    first = agent.chat.completions.create(messages=ASK, tools=[WEATHER], **_says(CALL, extra_body=template))
    message = first.choices[0].message
    [call] = message.tool_calls
    history = [
        *ASK,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    answer = "It is sunny in Paris."
    kwargs = _says(answer, extra_body=template)
    final = agent.chat.completions.create(messages=history, tools=[WEATHER], **kwargs)
    assert final.choices[0].message.content == answer and final.choices[0].finish_reason == "stop"

    http = httpx.Client(base_url=agent_server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    body = {"model": "embedded", "messages": history, "tools": [WEATHER], **template}
    tokens = http.post("/tokenize", json=body).json()["tokens"]
    prompt = http.post("/detokenize", json={"model": "embedded", "tokens": tokens}).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt


def test_arguments_that_are_not_json_in_the_history_are_a_400(agent):
    history = [
        *ASK,
        {"role": "assistant", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{city"}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="arguments is not JSON"):
        agent.chat.completions.create(model="embedded", messages=history, tools=[WEATHER], max_tokens=2)


def test_enable_auto_tool_choice_needs_a_parser(model_args, tmp_path):
    proc = ServerProcess([*model_args, "--enable-auto-tool-choice"], tmp_path / "server.log")
    with pytest.raises(RuntimeError, match="--tool-call-parser"):
        proc.start(timeout=60)


# the Responses API: function tools, function_call output items, function_call_output input items

RESPONSES_WEATHER = {"type": "function", **WEATHER["function"]}


def _respond(agent, text: str, **kwargs):
    extra = {"structured_outputs": {"choice": [text]}, **kwargs.pop("extra_body", {})}
    kwargs = {"model": "embedded", "input": ASK[0]["content"], "tools": [RESPONSES_WEATHER], **kwargs}
    return agent.responses.create(temperature=0, max_output_tokens=200, extra_body=extra, **kwargs)


def test_responses_function_calls(agent):
    resp = _respond(agent, "Let me check. " + TWO_CALLS)
    assert resp.status == "completed"
    message, *calls = resp.output
    assert message.type == "message" and message.content[0].text == "Let me check. "
    assert [c.type for c in calls] == ["function_call", "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Zürich"}),
    ]
    assert all(c.call_id.startswith("call_") and c.status == "completed" for c in calls)
    assert resp.tools[0].name == "get_weather"

    events = list(_respond(agent, "Let me check. " + TWO_CALLS, stream=True))
    done = events[-1].response
    assert events[-1].type == "response.completed"
    assert [(i.type, getattr(i, "arguments", None)) for i in done.output] == [
        (i.type, getattr(i, "arguments", None)) for i in resp.output
    ]
    texts = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert texts == "Let me check. "  # no part of a call as text
    for index, call in enumerate(done.output[1:], start=1):
        deltas = [
            e.delta
            for e in events
            if e.type == "response.function_call_arguments.delta" and e.output_index == index
        ]
        assert "".join(deltas) == call.arguments
        added = [e.item for e in events if e.type == "response.output_item.added" and e.output_index == index]
        assert added[0].name == "get_weather" and added[0].call_id == call.call_id
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(len(events)))


def test_responses_round_trip(agent, agent_server):
    """call -> function_call_output -> answer, the history given whole or through previous_response_id;
    either renders as chat's history with the same calls (the same prompt tokens)."""
    template = {"chat_template_kwargs": {"chat_template": HERMES_TEMPLATE}}
    first = _respond(agent, CALL, extra_body=template)
    [call] = first.output
    answer = "It is sunny in Paris."
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    whole = [
        {"role": "user", "content": ASK[0]["content"]},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        result,
    ]
    given = _respond(agent, answer, input=whole, extra_body=template)
    chained = _respond(agent, answer, input=[result], previous_response_id=first.id, extra_body=template)
    for resp in (given, chained):
        assert resp.output[0].content[0].text == answer and resp.status == "completed"
    assert given.usage.input_tokens == chained.usage.input_tokens

    http = httpx.Client(base_url=agent_server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    function = {"name": call.name, "arguments": call.arguments}
    history = [
        *ASK,
        {"role": "assistant", "tool_calls": [{"id": call.call_id, "type": "function", "function": function}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"},
    ]  # fmt: skip
    body = {"model": "embedded", "messages": history, "tools": [WEATHER], "chat_template": HERMES_TEMPLATE}
    assert http.post("/tokenize", json=body).json()["count"] == given.usage.input_tokens


def test_responses_forced_call(agent):
    tool = {**RESPONSES_WEATHER, "parameters": {**WEATHER["function"]["parameters"]}}
    tool["parameters"]["properties"] = {"city": {"type": "string", "maxLength": 12}}
    choice = {"type": "function", "name": "get_weather"}
    compact = {"disable_any_whitespace": True, "disable_additional_properties": True}
    kwargs = dict(
        model="embedded", input="Weather in Paris?", tools=[tool], tool_choice=choice, max_output_tokens=60,
        temperature=0, extra_body={"structured_outputs": compact},
    )  # fmt: skip
    resp = agent.responses.create(**kwargs)
    [call] = resp.output
    assert (
        call.type == "function_call"
        and call.name == "get_weather"
        and set(json.loads(call.arguments)) == {"city"}
    )
    events = list(agent.responses.create(**kwargs, stream=True))
    [streamed] = events[-1].response.output
    assert (streamed.name, streamed.arguments) == (call.name, call.arguments)
