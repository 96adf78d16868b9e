"""Tool calls on chat completions (infer.server.tools): a named tool_choice or "required" constrains the
output to the calls' JSON, returned as `tool_calls`, streamed and not; "auto" and "none" leave text."""

from __future__ import annotations

import json

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from tests.server.test_openai_api import COMPACT

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}
NOTE_NAME = "write_note"
NOTE = {  # arguments of many tokens: they take many chunks to stream
    "type": "function",
    "function": {
        "name": NOTE_NAME,
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string", "minLength": 40, "maxLength": 80}},
            "required": ["text"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _create(client, model, **kwargs):
    kwargs = {"max_tokens": 60, "temperature": 0, "extra_body": COMPACT, **kwargs}
    return client.chat.completions.create(model=model, messages=ASK, **kwargs)


def test_a_named_tool_choice_calls_that_function(client, model):
    """The arguments follow the function's parameters; they are the text the same grammar gives under
    response_format (same prompt: the tools reach the template either way)."""
    choice = {"type": "function", "function": {"name": "get_weather"}}
    resp = _create(client, model, tools=[WEATHER, TIME], tool_choice=choice)
    message = resp.choices[0].message
    assert message.content is None and resp.choices[0].finish_reason == "stop"
    [call] = message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city"} and isinstance(arguments["city"], str)
    schema = {"name": "args", "schema": WEATHER["function"]["parameters"]}
    plain = _create(
        client, model, tools=[WEATHER, TIME], tool_choice="none",
        response_format={"type": "json_schema", "json_schema": schema},
    )  # fmt: skip
    assert plain.choices[0].message.content == call.function.arguments

    chunks = list(_create(client, model, tools=[WEATHER, TIME], tool_choice=choice, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    first = deltas[0].tool_calls[0]
    assert first.index == 0 and first.id.startswith("call_") and first.function.name == "get_weather"
    assert "".join(d.tool_calls[0].function.arguments or "" for d in deltas) == call.function.arguments
    assert all(d.tool_calls[0].id in (None, first.id) for d in deltas)
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def _tool_call_entries(chunks) -> list:
    return [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]


def _accumulated(chunks):
    """The stream as the openai client accumulates it, and how many argument deltas it saw."""
    state = ChatCompletionStreamState()
    num_argument_events = 0
    for chunk in chunks:
        events = state.handle_chunk(chunk)
        num_argument_events += sum(e.type == "tool_calls.function.arguments.delta" for e in events)
    # the snapshot: get_final_completion refuses a "length" finish, which it could not parse
    return state.current_completion_snapshot.choices[0], num_argument_events


def _same_calls(streamed, plain) -> bool:
    names_and_arguments = [(tc.function.name, tc.function.arguments) for tc in plain.message.tool_calls]
    return [(tc.function.name, tc.function.arguments) for tc in streamed.message.tool_calls or ()] == (
        names_and_arguments
    ) and streamed.finish_reason == plain.finish_reason


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "write_note"}}]
)
def test_calls_stream_as_they_are_generated(client, model, tool_choice):
    """The calls arrive as they are generated (a call's arguments in many chunks), each call's index,
    id and name once, in its first chunk, never as content; the stream accumulates (the openai
    client's accumulation) to the calls of the same greedy response not streamed. This small model,
    left free to call several times under "required", repeats its call until max_tokens, which then
    cuts the last call short (finish_reason "length", in both)."""
    kwargs = dict(tools=[NOTE], tool_choice=tool_choice, max_tokens=120)
    plain = _create(client, model, **kwargs).choices[0]
    chunks = list(_create(client, model, **kwargs, stream=True))
    streamed, num_argument_events = _accumulated(chunks)
    assert _same_calls(streamed, plain), (streamed, plain)
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    assert plain.message.content is None and streamed.message.content in (None, "")

    entries = _tool_call_entries(chunks)
    firsts = [tc for tc in entries if tc.id is not None]
    calls = plain.message.tool_calls
    assert [tc.index for tc in firsts] == list(range(len(calls)))
    assert [tc.function.name for tc in firsts] == [call.function.name for call in calls]
    assert len({tc.id for tc in firsts}) == len(calls) and all(tc.id.startswith("call_") for tc in firsts)
    for index in range(len(calls)):  # the first entry of a call is the one with its id and name
        of_call = [tc for tc in entries if tc.index == index]
        assert of_call[0].id is not None and all(tc.function.name is None for tc in of_call[1:])
    first_arguments = [tc for tc in entries if tc.index == 0 and tc.function.arguments]
    assert len(first_arguments) > 1 and num_argument_events > 1
    if tool_choice == "required":
        assert len(calls) >= 2 and plain.finish_reason == "length"


def test_required_calls_one_of_the_tools(client, model):
    """With parallel_tool_calls false, one call from the list of tools, finish_reason "tool_calls",
    streamed and not."""
    kwargs = dict(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False, max_tokens=120)
    choice = _create(client, model, **kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    key = {"get_weather": "city", "get_time": "zone"}[call.function.name]
    assert set(json.loads(call.function.arguments)) == {key} and call.id.startswith("call_")

    chunks = list(_create(client, model, **kwargs, stream=True))
    assert _same_calls(_accumulated(chunks)[0], choice)
    assert {tc.index for tc in _tool_call_entries(chunks)} == {0}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_calls_cut_short_before_a_name_are_none(client, model):
    """Cut by max_tokens before a call's name is complete, "required" output holds no call: no
    tool_calls, and its partial JSON is not content (vLLM's), streamed or not."""
    kwargs = dict(tools=[WEATHER], tool_choice="required", max_tokens=3, extra_body={"ignore_eos": True})
    choice = _create(client, model, **kwargs).choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert not choice.message.content
    chunks = list(_create(client, model, stream=True, **kwargs))
    assert not _tool_call_entries(chunks)
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_echo_beside_calls_is_the_same_streamed_or_not(client, model):
    """vLLM's echo repeats the last message when it is the reply's (the assistant's) ahead of the reply:
    streamed, as a content chunk before the calls; not streamed, as the content beside them (it was
    dropped: content null)."""
    prefix = "Let me look that up."
    kwargs = dict(
        model=model,
        messages=[*ASK, {"role": "assistant", "content": prefix}],
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=30,
        temperature=0,
        extra_body={**COMPACT, "echo": True},
    )
    message = client.chat.completions.create(**kwargs).choices[0].message
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == prefix and message.content == prefix
    assert message.tool_calls[0].function.arguments == "".join(
        tc.function.arguments or "" for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()
    )


def test_auto_and_none_leave_text(client, model):
    """The structured-outputs options (COMPACT, sent by _create) have no grammar to apply to: free text,
    the same as without them."""
    for tool_choice in ("auto", "none", None):
        kwargs = {"tool_choice": tool_choice} if tool_choice else {}
        resp = _create(client, model, tools=[WEATHER], max_tokens=8, **kwargs)
        assert resp.choices[0].message.tool_calls is None and resp.choices[0].message.content is not None
        plain = _create(client, model, tools=[WEATHER], max_tokens=8, extra_body={}, **kwargs)
        assert resp.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize(
    "kwargs, fragment, param",
    [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "not among",
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "needs tools", "tool_choice"),
        ({"tools": []}, "empty array", "tools"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "name", "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]", "tools"),
        ({"tools": [WEATHER, TIME, WEATHER]}, "'get_weather' is used by tools[0] and tools[2]", "tools"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "send one",
            "response_format",
        ),
    ],
)
def test_bad_tools_are_400s(client, model, kwargs, fragment, param):
    with pytest.raises(openai.BadRequestError, match=None) as err:
        _create(client, model, max_tokens=4, **kwargs)
    assert fragment in err.value.body["message"] and err.value.body["param"] == param
