"""The Responses API (/v1/responses) through the official client: the same tokens as the chat request it
amounts to, OpenAI's streaming events, the store (retrieve, delete, previous_response_id), text.format,
logprobs, truncation, and what it refuses."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import openai
import pytest

from infer.engine.llm_engine import StepOutput
from infer.server.protocol import ResponsesRequest
from infer.server.responses import ResponseStore, Stored, _Response
from tests.server.conftest import API_KEY
from tests.server.test_openai_api import COMPACT, PERSON

IGNORE_EOS = {"ignore_eos": True}
STORY = "Tell me a story about a cat."


def _chat(client, model, messages, max_tokens):
    resp = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, extra_body=IGNORE_EOS
    )
    return resp.choices[0].message.content, resp.usage


def test_a_response_is_the_chat_completion_it_amounts_to(client, model):
    """A string input is one user message, instructions a system message before it; items may hold text
    parts and the developer role (a system message to the template). Tokens and usage equal chat's;
    cut short by max_output_tokens, the response is incomplete, as OpenAI's."""
    resp = client.responses.create(
        model=model, input=STORY, max_output_tokens=12, temperature=0, extra_body=IGNORE_EOS
    )
    text, usage = _chat(client, model, [{"role": "user", "content": STORY}], 12)
    assert resp.object == "response" and resp.output_text == text
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert (resp.usage.input_tokens, resp.usage.output_tokens) == (usage.prompt_tokens, 12)
    assert resp.usage.total_tokens == usage.prompt_tokens + 12
    [item] = resp.output
    assert item.type == "message" and item.role == "assistant" and item.status == "incomplete"
    assert [part.type for part in item.content] == ["output_text"]

    items = [
        {"role": "developer", "content": "Answer in one line."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": STORY}]},
    ]
    resp = client.responses.create(
        model=model, instructions="Be kind.", input=items, max_output_tokens=8, temperature=0,
        extra_body=IGNORE_EOS,
    )  # fmt: skip
    messages = [
        {"role": "system", "content": "Be kind."},
        {"role": "system", "content": "Answer in one line."},
        {"role": "user", "content": STORY},
    ]
    text, usage = _chat(client, model, messages, 8)
    assert (resp.output_text, resp.usage.input_tokens) == (text, usage.prompt_tokens)
    assert resp.instructions == "Be kind."


def test_streaming_sends_openais_events(client, model):
    """The events in OpenAI's order, numbered 0..n-1; the deltas add up to the text of the same response
    unstreamed; a response that ends on its own (a choice constraint) completes."""
    kwargs = dict(model=model, input=STORY, max_output_tokens=10, temperature=0, extra_body=IGNORE_EOS)
    full = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-4].text == full.output_text
    final = events[-1].response
    assert final.id == events[0].response.id and final.output_text == full.output_text
    assert final.usage.output_tokens == 10 and events[0].response.status == "in_progress"

    colors = ["red", "green", "blue"]
    choice = dict(model=model, input="Pick a color.", extra_body={"structured_outputs": {"choice": colors}})
    events = list(client.responses.create(**choice, stream=True))
    assert events[-1].type == "response.completed" and events[-1].response.status == "completed"
    assert events[-1].response.output_text in colors


def test_sse_framing_names_each_event(server):
    body = {"input": "Hello", "max_output_tokens": 3, "stream": True, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    names, datas = lines[0::2], lines[1::2]
    assert all(n.startswith("event: ") for n in names) and all(d.startswith("data: ") for d in datas)
    assert [n.removeprefix("event: ") for n in names] == [json.loads(d[6:])["type"] for d in datas]
    assert "data: [DONE]" not in lines


def test_the_store_retrieve_delete_and_previous_response_id(client, model):
    """A stored response reads back whole and continues: previous_response_id puts its input and output
    before the new input (not its instructions, as OpenAI). Deleted, or never stored: a 404."""
    kwargs = dict(model=model, max_output_tokens=6, temperature=0, extra_body=IGNORE_EOS)
    first = client.responses.create(input="Hi there.", instructions="Be brief.", **kwargs)
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    second = client.responses.create(input="And then?", previous_response_id=first.id, **kwargs)
    messages = [
        {"role": "user", "content": "Hi there."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"},
    ]
    text, usage = _chat(client, model, messages, 6)
    assert (second.output_text, second.usage.input_tokens) == (text, usage.prompt_tokens)
    assert second.previous_response_id == first.id
    third = client.responses.create(input="Why?", previous_response_id=second.id, **kwargs)
    text, _ = _chat(client, model, [*messages, {"role": "assistant", "content": text}, _user("Why?")], 6)
    assert third.output_text == text

    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(input="Again?", previous_response_id=first.id, **kwargs)
    assert err.value.body["param"] == "previous_response_id"
    assert client.responses.retrieve(second.id).id == second.id  # its own copy of the conversation
    unstored = client.responses.create(input="Hi there.", store=False, **kwargs)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def test_the_store_evicts_the_oldest_beyond_its_bound():
    store = ResponseStore(max_bytes=100)
    for i in range(4):
        assert store.put(Stored(f"r{i}", "", b"{}", [], "", 30))
    assert list(store.entries) == ["r1", "r2", "r3"] and store.num_bytes == 90
    assert not store.put(Stored("big", "", b"{}", [], "", 101)) and "big" not in store.entries
    store.delete("r2", "")
    assert list(store.entries) == ["r1", "r3"] and store.num_bytes == 60
    assert not ResponseStore(max_bytes=0).put(Stored("x", "", b"{}", [], "", 1))


@pytest.mark.parametrize(
    "fields",
    [
        {"instructions": "x" * 300_000},
        {"metadata": {"k": "x" * 300_000}},
    ],
)
def test_the_store_counts_what_a_stored_response_holds(fields):
    """A stored response holds its instructions and metadata (and logprobs), which the client sizes: the
    bound counts them. It counted only the input and output texts, so 4 MiB of instructions or metadata
    per response, at ~1 KB counted each, let 64 MiB of store hold ~250 GB."""
    store = ResponseStore(max_bytes=500_000)
    state = SimpleNamespace(args=SimpleNamespace(model_name="m", tool_call_parser=None))
    body = ResponsesRequest(input="Hi", **fields)
    last = StepOutput("r", "", [], True, "stop", 3, 1, 0)
    for i in range(2):
        _Response(state, store, body, f"resp-{i}", [_user("Hi")], "")._finish([], "out", [], last)
    assert list(store.entries) == ["resp-1"] and store.num_bytes > 300_000
    assert json.loads(store.get("resp-1", "").body)["id"] == "resp-1"
    small = ResponseStore(max_bytes=100_000)  # one that cannot hold it at all: the response says so
    response = _Response(state, small, body, "resp-2", [_user("Hi")], "")._finish([], "out", [], last)
    assert response["store"] is False and not small.entries


def test_text_format_and_logprobs(client, model):
    """text.format constrains the output as chat's response_format; with the logprobs include, each
    output token has its logprob and top_logprobs, in the response and in the stream's deltas."""
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    resp = client.responses.create(
        model=model,
        input=STORY,
        max_output_tokens=60,
        temperature=0,
        text={"format": fmt},
        extra_body=COMPACT,
    )
    person = json.loads(resp.output_text)
    assert set(person) == {"name", "age"} and resp.status == "completed"
    assert resp.text.format.type == "json_schema" and resp.text.format.name == "person"
    chat = client.chat.completions.create(
        model=model, messages=[_user(STORY)], max_tokens=60, temperature=0, extra_body=COMPACT,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
    )  # fmt: skip
    assert resp.output_text == chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(
            model=model, input=STORY, text={"format": {"type": "json_schema", "name": "x"}}
        )
    assert err.value.body["param"] == "text.format" and "needs schema" in err.value.body["message"]

    kwargs = dict(model=model, input=STORY, max_output_tokens=5, temperature=0, extra_body=IGNORE_EOS)
    kwargs.update(include=["message.output_text.logprobs"], top_logprobs=2)
    resp = client.responses.create(**kwargs)
    logprobs = resp.output[0].content[0].logprobs
    assert len(logprobs) == 5 and all(len(lp.top_logprobs) == 2 for lp in logprobs)
    assert all(lp.logprob <= 0 and lp.top_logprobs[0].logprob >= lp.logprob for lp in logprobs)
    streamed = [
        lp
        for e in client.responses.create(**kwargs, stream=True)
        if e.type.endswith("delta")
        for lp in e.logprobs
    ]
    assert [(lp.token, lp.logprob) for lp in streamed] == [(lp.token, lp.logprob) for lp in logprobs]
    plain = client.responses.create(**{**kwargs, "include": None})
    assert plain.output[0].content[0].logprobs is None


def test_truncation_auto_keeps_the_conversations_end(client, model):
    context = client.models.list().data[0].model_extra["max_model_len"]
    long_input = "cat " * (context + 100)
    kwargs = dict(model=model, input=long_input, max_output_tokens=8, temperature=0)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(**kwargs)
    resp = client.responses.create(**kwargs, truncation="auto", extra_body=IGNORE_EOS)
    assert resp.usage.input_tokens == context - 8 and resp.usage.output_tokens == 8
    assert resp.truncation == "auto"


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tools": [{"type": "function", "parameters": {}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"background": True}, "background"),
        ({"n": 2}, "n"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"return_token_ids": True}, "return_token_ids"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"include": ["nonsense"]}, "include"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ],
)
def test_what_responses_refuse(server, fields, param):
    """Each a 400 naming what to send instead; the server keeps serving."""
    body = {"input": "Hi", "max_output_tokens": 2, **fields}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(server.url + "/v1/responses", json=body, headers=headers, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert param in (error["param"] or "") or param in error["message"], error
    ok = httpx.post(
        server.url + "/v1/responses", json={"input": "Hi", "max_output_tokens": 2}, headers=headers
    )
    assert ok.status_code == 200 and ok.json()["status"] in ("completed", "incomplete")


def test_duplicate_tool_names_are_named(server):
    tool = {"type": "function", "name": "f", "parameters": {}}
    body = {"input": "Hi", "tools": [tool, {**tool, "description": "another f"}]}
    r = httpx.post(server.url + "/v1/responses", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert "'f' is used by tools[0] and tools[1]" in r.json()["error"]["message"]
