"""The OpenAI API through the official client: completions and chat, streamed and not, exact usage, stop
strings, seeds, n, logprobs, logit_bias and penalties, structured outputs, echo, prefix-cache usage,
priority (/metrics: test_metrics.py)."""

from __future__ import annotations

import asyncio
import json
import random
import re
from dataclasses import replace

import httpx
import openai
import pytest

from infer.engine.llm import LLM
from infer.sampling_params import SamplingParams
from infer.structured_outputs.constraint import StructuredOutputs
from tests.server.conftest import API_KEY, metric

IGNORE_EOS = {"ignore_eos": True}
MESSAGES = [{"role": "user", "content": "Tell me a story about a cat."}]


def test_models_and_health(server, client, model):
    assert model == "embedded"
    card = client.models.list().data[0]
    assert card.owned_by == "infer" and card.max_model_len >= 256
    assert set(server.health_statuses) <= {200, 503} and server.health_statuses[-1] == 200
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("not-this-one")


def test_server_info_reports_the_effective_configuration(server):
    info = httpx.get(server.url + "/server_info", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert info["engine"]["policy"] == "priority" and info["engine"]["kv_cache_backend"] == "paged"
    assert "api_key_owners" not in info["server"] and info["kv_capacity_tokens"] > 0


def test_completion_usage_is_exact(client, model):
    prompt = [5, 17, 42, 99, 7, 3, 64]
    resp = client.completions.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0, extra_body=IGNORE_EOS
    )
    (choice,) = resp.choices
    assert choice.finish_reason == "length" and choice.index == 0
    assert resp.object == "text_completion" and resp.model == model
    assert resp.usage.prompt_tokens == len(prompt)
    assert resp.usage.completion_tokens == 12
    assert resp.usage.total_tokens == len(prompt) + 12
    assert resp.usage.prompt_tokens_details.cached_tokens >= 0


def test_add_special_tokens_and_null_penalties(client, model):
    """vLLM's add_special_tokens: a text prompt gets the tokenizer's BOS unless false; a chat prompt (whose
    template writes it) only if true. Fields sent as null take their defaults, as OpenAI reads them."""
    kwargs = dict(model=model, max_tokens=1)
    usage = lambda **kw: client.completions.create(prompt="Hello there", **kwargs, **kw).usage.prompt_tokens
    assert usage() == usage(extra_body={"add_special_tokens": False}) + 1
    chat = lambda **kw: client.chat.completions.create(messages=MESSAGES, **kwargs, **kw).usage.prompt_tokens
    assert chat(extra_body={"add_special_tokens": True}) == chat() + 1
    nulls = {"presence_penalty": None, "frequency_penalty": None, "repetition_penalty": None, "n": None}
    nulls |= {"temperature": None, "top_p": None, "stream": None, "logprobs": None, "max_tokens": None}
    resp = client.completions.create(prompt="Hi", model=model, extra_body=nulls)  # every default
    assert resp.usage.completion_tokens <= 16 and len(resp.choices) == 1 and resp.choices[0].logprobs is None
    chat = client.chat.completions.create(
        messages=MESSAGES, model=model, extra_body={**nulls, "max_tokens": 3}
    )
    assert chat.usage.completion_tokens <= 3


def test_completion_default_max_tokens_is_16(client, model):
    resp = client.completions.create(model=model, prompt="Once upon a time", extra_body=IGNORE_EOS)
    assert resp.usage.completion_tokens == 16


def test_batch_of_prompts_times_n(client, model):
    prompts = ["The cat sat", "A long time ago"]
    single = [
        client.completions.create(model=model, prompt=p, max_tokens=1).usage.prompt_tokens for p in prompts
    ]
    resp = client.completions.create(model=model, prompt=prompts, n=2, max_tokens=5, extra_body=IGNORE_EOS)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in resp.choices)
    assert resp.usage.prompt_tokens == sum(single)
    assert resp.usage.completion_tokens == 4 * 5
    ids = client.completions.create(
        model=model, prompt=[[1, 2, 3], [4, 5]], max_tokens=2, extra_body=IGNORE_EOS
    )
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 5


def _stream_text(stream) -> tuple[dict[int, str], dict[int, str], object]:
    texts, reasons, usage = {}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == []  # the usage chunk comes alone, last
            usage = chunk.usage
        for c in chunk.choices:
            piece = c.text if hasattr(c, "text") else (c.delta.content or "")
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason is not None:
                assert c.index not in reasons, "finish_reason sent twice"
                reasons[c.index] = c.finish_reason
    return texts, reasons, usage


def _counts(usage) -> tuple[int, int, int]:
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


def test_completion_stream_equals_non_stream(client, model):
    kwargs = dict(
        model=model, prompt="The meaning of life is", max_tokens=24, temperature=0, extra_body=IGNORE_EOS
    )
    full = client.completions.create(**kwargs)
    texts, reasons, usage = _stream_text(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert texts == {0: full.choices[0].text} and reasons == {0: "length"}
    assert _counts(usage) == _counts(full.usage)  # cached_tokens differ: the second run hits the cache


def test_chat_stream_equals_non_stream(client, model):
    kwargs = dict(model=model, messages=MESSAGES, max_tokens=20, temperature=0, extra_body=IGNORE_EOS)
    full = client.chat.completions.create(**kwargs)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens == 20 and full.choices[0].finish_reason == "length"
    stream = client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    texts, reasons, usage = _stream_text(chunks)
    assert texts == {0: full.choices[0].message.content} and reasons == {0: "length"}
    assert _counts(usage) == _counts(full.usage)  # cached_tokens differ: the second run hits the cache


def test_sse_framing_ends_with_done(server):
    body = {"prompt": "Hello", "max_tokens": 3, "stream": True, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]" and events.count("data: [DONE]") == 1


def test_chat_max_completion_tokens_and_default(client, model):
    resp = client.chat.completions.create(
        model=model, messages=MESSAGES, max_completion_tokens=5, extra_body=IGNORE_EOS
    )
    assert resp.usage.completion_tokens == 5 and resp.choices[0].finish_reason == "length"
    # No max_tokens: the reply may use the rest of the context (vLLM's default), and no more.
    resp = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0)
    max_len = client.models.list().data[0].max_model_len
    if resp.choices[0].finish_reason == "length":
        assert resp.usage.total_tokens == max_len
    else:
        assert resp.choices[0].finish_reason == "stop" and resp.usage.total_tokens < max_len


def _clean_window(text: str) -> int | None:
    """Index of a 2-character stop string without replacement characters (undecodable bytes)."""
    for i in range(len(text) - 1):
        if "\ufffd" not in text[i : i + 2] and text[i : i + 2].strip():
            return i
    return None


def test_stop_strings(client, model):
    kwargs = dict(model=model, prompt="In the morning the", max_tokens=24, temperature=0)
    base = client.completions.create(**kwargs, extra_body=IGNORE_EOS).choices[0].text
    start = max(1, len(base) // 3)  # some text must come before the stop string
    i = _clean_window(base[start:])
    if i is None:
        pytest.skip(f"no usable stop string in {base!r}")
    stop = base[start + i : start + i + 2]
    expected = base[: base.index(stop)]
    resp = client.completions.create(**kwargs, stop=[stop, "\x00never"], extra_body=IGNORE_EOS)
    assert resp.choices[0].text == expected and resp.choices[0].finish_reason == "stop"
    texts, reasons, _ = _stream_text(
        client.completions.create(**kwargs, stop=stop, stream=True, extra_body=IGNORE_EOS)
    )
    assert texts == {0: expected} and reasons == {0: "stop"}
    kept = {**IGNORE_EOS, "include_stop_str_in_output": True}  # vLLM's: the text ends with the stop string
    resp = client.completions.create(**kwargs, stop=[stop, "\x00never"], extra_body=kept)
    assert resp.choices[0].text == expected + stop and resp.choices[0].finish_reason == "stop"
    texts, _, _ = _stream_text(client.completions.create(**kwargs, stop=stop, stream=True, extra_body=kept))
    assert texts == {0: expected + stop}


def test_skip_special_tokens(server, client, model):
    """vLLM's skip_special_tokens (default true): false shows special tokens' text (BOS, forced here)."""
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        (bos,) = http.post("/tokenize", json={"prompt": ""}).json()["tokens"]
        shown = http.post("/detokenize", json={"tokens": [bos] * 3}).json()["prompt"]
    kwargs = dict(model=model, prompt="Hi", max_tokens=3, temperature=0, logit_bias={str(bos): 100})
    assert client.completions.create(**kwargs, extra_body=IGNORE_EOS).choices[0].text == ""
    resp = client.completions.create(**kwargs, extra_body={**IGNORE_EOS, "skip_special_tokens": False})
    assert resp.choices[0].text == shown != ""


def test_seed_reproduces_and_n_offsets_it(client, model):
    kwargs = dict(
        model=model, prompt="Once upon a time", max_tokens=16, temperature=1.0, extra_body=IGNORE_EOS
    )
    a = client.completions.create(**kwargs, seed=1234).choices[0].text
    b = client.completions.create(**kwargs, seed=1234).choices[0].text
    assert a == b
    both = client.completions.create(**kwargs, seed=1234, n=2)
    assert both.choices[0].text == a  # choice j samples with seed + j
    assert both.choices[1].text == client.completions.create(**kwargs, seed=1235).choices[0].text
    others = {client.completions.create(**kwargs, seed=s).choices[0].text for s in (1, 2, 3, 4)}
    assert len(others) >= 2


def test_chat_n(client, model):
    resp = client.chat.completions.create(
        model=model, messages=MESSAGES, n=3, max_tokens=4, seed=7, extra_body=IGNORE_EOS
    )
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert resp.usage.completion_tokens == 12


def test_min_tokens(client, model):
    resp = client.completions.create(
        model=model, prompt="Hi", max_tokens=10, temperature=0, extra_body={"min_tokens": 10}
    )
    assert resp.usage.completion_tokens == 10


def test_logit_bias_and_allowed_token_ids_reach_the_sampler(server, client, model):
    """OpenAI's logit_bias (token ids as JSON strings): +100 on one token makes greedy repeat it; so does
    vLLM's allowed_token_ids with that token alone."""
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        token = http.post("/tokenize", json={"prompt": " the", "add_special_tokens": False}).json()["tokens"][
            -1
        ]
        expected = http.post("/detokenize", json={"tokens": [token] * 6}).json()["prompt"]
    kwargs = dict(
        model=model, max_tokens=6, temperature=0, logit_bias={str(token): 100}, extra_body=IGNORE_EOS
    )
    assert client.completions.create(prompt="Once upon a time", **kwargs).choices[0].text == expected
    chat = client.chat.completions.create(messages=MESSAGES, **kwargs)
    assert chat.choices[0].message.content == expected
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(prompt="Hi", **{**kwargs, "logit_bias": {"99999999": 5}})
    assert err.value.body["param"] == "logit_bias"
    only = dict(
        model=model, max_tokens=6, temperature=0, extra_body={**IGNORE_EOS, "allowed_token_ids": [token]}
    )
    assert client.completions.create(prompt="Once upon a time", **only).choices[0].text == expected  # vLLM's


@pytest.mark.slow  # loads the model in-process beside the server
def test_penalties_match_the_engine(client, model, model_args):
    """presence / frequency (OpenAI's) and repetition_penalty (vLLM's) through the API give the engine's
    own output for them, streamed or not (the engine's against transformers: tests/engine)."""
    path = model_args[model_args.index("--model") + 1] if "--model" in model_args else None
    penalties = dict(presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.3)
    prompt = "Once upon a time there was a little"
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(path, dtype="float32", num_kv_blocks=64) as llm:
        plain, expected = (r.text for r in llm.generate([prompt] * 2, [params, replace(params, **penalties)]))
    assert expected != plain
    kwargs = dict(
        model=model,
        prompt=prompt,
        max_tokens=24,
        temperature=0,
        presence_penalty=penalties["presence_penalty"],
        frequency_penalty=penalties["frequency_penalty"],
        extra_body={**IGNORE_EOS, "repetition_penalty": penalties["repetition_penalty"]},
    )
    assert client.completions.create(**kwargs).choices[0].text == expected
    stream = client.completions.create(**kwargs, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected


def test_completion_logprobs(client, model):
    resp = client.completions.create(
        model=model, prompt="The sky is", max_tokens=5, temperature=0, logprobs=3, extra_body=IGNORE_EOS
    )
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    for logprob, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and 1 <= len(top) <= 3
        # greedy: the sampled token is the most likely (top keys are token texts, which may collide)
        assert logprob >= max(top.values()) - 1e-4
    assert lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs(client, model):
    resp = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body=IGNORE_EOS,
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4)
    stream = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        stream=True,
        extra_body=IGNORE_EOS,
    )
    streamed = [e for chunk in stream for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]


def test_echo(client, model):
    prompt = "Hello world"
    resp = client.completions.create(
        model=model, prompt=prompt, max_tokens=3, echo=True, extra_body=IGNORE_EOS
    )
    assert resp.choices[0].text.startswith(prompt)
    texts, _, _ = _stream_text(
        client.completions.create(
            model=model, prompt=prompt, max_tokens=3, echo=True, stream=True, extra_body=IGNORE_EOS
        )
    )
    assert texts[0].startswith(prompt)


def test_prefix_cache_hit_shows_in_usage(client, model):
    prompt = random.Random("prefix").sample(range(10, 250), 64)  # a prompt no other test sends
    first = client.completions.create(model=model, prompt=prompt, max_tokens=2, extra_body=IGNORE_EOS)
    second = client.completions.create(model=model, prompt=prompt, max_tokens=2, extra_body=IGNORE_EOS)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 48 <= cached < 64 and cached % 16 == 0  # whole blocks, never the last token


@pytest.mark.slow  # 16 requests of many tokens each
def test_priority_serves_urgent_request_first(server, aclient, model):
    """8 running + 8 waiting low-priority requests; an urgent one (lower value) preempts and finishes
    before any of them. Under fcfs it would wait for a whole wave of 8 to finish."""
    finished: list[str] = []

    async def one(name: str, priority: int, max_tokens: int):
        await aclient.completions.create(
            model=model,
            prompt=f"Request {name}",
            max_tokens=max_tokens,
            extra_body={"priority": priority, **IGNORE_EOS},
        )
        finished.append(name)

    async def main():
        low = [asyncio.create_task(one(f"low{i}", 5, 64)) for i in range(16)]
        for _ in range(600):  # until the engine holds all of them (no timing is asserted)
            text = await asyncio.to_thread(server.metrics)
            if metric(text, "num_requests_running") + metric(text, "num_requests_waiting") >= 16:
                break
            await asyncio.sleep(0.02)
        await one("urgent", -5, 4)
        num_low_done = len(finished) - 1
        await asyncio.gather(*low)
        return num_low_done

    assert asyncio.run(main()) < 8
    assert len(finished) == 17


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "maximum": 120}},
    "required": ["name", "age"],
}
COMPACT = {"structured_outputs": {"disable_any_whitespace": True, "disable_additional_properties": True}}


def test_structured_outputs_through_the_client(client, model):
    """OpenAI's response_format (json_schema, json_object) with vLLM's structured_outputs options, vLLM's
    structured_outputs (choice, regex, grammar) and its older guided_* fields, streamed and not: each
    output follows its constraint and ends with it (finish_reason "stop"), equal to the engine's."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    kwargs = dict(model=model, max_tokens=60, temperature=0)
    chat = client.chat.completions.create(
        messages=MESSAGES, response_format=fmt, extra_body=COMPACT, **kwargs
    )
    person = json.loads(chat.choices[0].message.content)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int) and person["age"] <= 120
    assert chat.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        messages=MESSAGES, response_format=fmt, extra_body=COMPACT, stream=True, **kwargs
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        == chat.choices[0].message.content
    )
    anything = client.chat.completions.create(
        messages=MESSAGES, response_format={"type": "json_object"}, extra_body=COMPACT, **kwargs
    )
    assert isinstance(json.loads(anything.choices[0].message.content), dict)
    colors = ["red", "green", "blue"]
    for extra in ({"structured_outputs": {"choice": colors}}, {"guided_choice": colors}):
        resp = client.completions.create(
            prompt="The color is", extra_body=extra, n=3, **{**kwargs, "temperature": 1}
        )
        assert all(c.text in colors and c.finish_reason == "stop" for c in resp.choices)
    digits = client.completions.create(prompt="Count:", extra_body={"guided_regex": "[0-9]{3}"}, **kwargs)
    assert re.fullmatch("[0-9]{3}", digits.choices[0].text)
    grammar = 'root ::= "say " [a-z]+ "!"'
    text = "".join(
        c.choices[0].text
        for c in client.completions.create(
            prompt="Now", extra_body={"structured_outputs": {"grammar": grammar}}, stream=True, **kwargs
        )
    )
    with LLM(dtype="float32", num_kv_blocks=64) as llm:
        spec = StructuredOutputs(grammar=grammar)
        [expected] = llm.generate(
            ["Now"], SamplingParams(temperature=0, max_tokens=60, structured_outputs=spec)
        )
    assert text == expected.text and re.fullmatch("say [a-z]+!", text)


def test_structured_outputs_options_alone_apply_to_nothing(client, model):
    """structured_outputs' options, or an empty structured_outputs, with no constraint to apply to: free
    text, the same as without them (not a 400)."""
    kwargs = dict(model=model, prompt="The color is", max_tokens=8, temperature=0)
    plain = client.completions.create(**kwargs).choices[0].text
    for extra in (COMPACT, {"structured_outputs": {}}):
        assert client.completions.create(**kwargs, extra_body=extra).choices[0].text == plain


def test_a_grammar_that_would_fail_while_generating_is_refused_naming_its_field(client, model):
    """A regex that forces a million characters compiled, then exceeded llguidance's lexer limits once
    generating (a 400 without its field, after seconds and +170 MB): it is refused up front now."""
    for extra in (
        {"structured_outputs": {"regex": "((a{100}){100}){100}"}},
        {"guided_regex": "a{1000000}"},
    ):
        with pytest.raises(openai.BadRequestError, match="no text shorter than 1000000 characters") as err:
            client.completions.create(model=model, prompt="Pick", max_tokens=4, extra_body=extra)
        assert err.value.body["param"] == next(iter(extra))
    assert client.completions.create(model=model, prompt="Pick", max_tokens=2).choices[0].text is not None


def test_a_bad_grammar_is_a_400_naming_its_field(client, model):
    cases = [
        ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs", "unclosed group"),
        ({"guided_json": {"type": "foo"}}, "guided_json", "does not compile"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
            "response_format",
            "does not compile",
        ),
        (
            {"structured_outputs": {"choice": ["a"], "whitespace_pattern": " "}},
            "structured_outputs",
            "whitespace_pattern",
        ),
        (
            {"structured_outputs": {"regex": "a"}, "guided_choice": ["b"]},
            "structured_outputs",
            "both constrain",
        ),
    ]
    for extra, param, fragment in cases:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as err:
                client.completions.create(
                    model=model, prompt="hi", max_tokens=3, stream=stream, extra_body=extra
                )
            assert err.value.body["param"] == param and fragment in err.value.body["message"], err.value.body


def test_bad_words_match_the_engine(client, model):
    """vLLM's bad_words through the API, streamed and not: the engine's own output for them."""
    prompt, words = "And he said unto them,", ["unto", "and"]
    with LLM(dtype="float32", num_kv_blocks=64) as llm:
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        plain, expected = (
            r.text for r in llm.generate([prompt] * 2, [params, replace(params, bad_words=words)])
        )
    assert " and" in plain and " and" not in expected and " unto" not in expected
    kwargs = dict(
        model=model,
        prompt=prompt,
        max_tokens=24,
        temperature=0,
        extra_body={**IGNORE_EOS, "bad_words": words},
    )
    assert client.completions.create(**kwargs).choices[0].text == expected
    assert "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs)) == expected


def test_prompt_logprobs_and_echo_with_logprobs(server, client, model):
    """vLLM's prompt_logprobs (completions and chat), and OpenAI's echo with logprobs (the prompt's
    tokens first, the first one's logprob null), also with max_tokens 0 (the prompt alone: how
    evaluation harnesses score a text): the engine's own prompt logprobs."""
    prompt = "In the beginning God created the heaven"
    with LLM(dtype="float32", num_kv_blocks=64) as llm:
        ids = llm.engine.tokenizer.encode(prompt)
        [ref] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))
    expected = [None] + [round(e[1], 4) for e in ref.prompt_logprobs[1:]]
    http = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    choice = http.post("/v1/completions", json={**body, "prompt_logprobs": 2}).json()["choices"][0]
    rows = choice["prompt_logprobs"]
    assert rows[0] is None and len(rows) == len(ids)
    assert [round(row[str(t)]["logprob"], 4) for row, t in zip(rows[1:], ids[1:], strict=True)] == expected[
        1:
    ]
    assert all(row[str(t)]["rank"] >= 1 and len(row) <= 3 for row, t in zip(rows[1:], ids[1:], strict=True))
    scored = http.post("/v1/completions", json={**body, "echo": True, "logprobs": 1}).json()["choices"][0]
    assert scored["text"].startswith(prompt) and len(scored["logprobs"]["tokens"]) == len(ids) + 1
    got = [None if v is None else round(v, 4) for v in scored["logprobs"]["token_logprobs"][: len(ids)]]
    assert got == expected and scored["logprobs"]["top_logprobs"][0] is None
    offsets = scored["logprobs"]["text_offset"]
    assert offsets == sorted(offsets) and offsets[len(ids)] == len(prompt)  # special tokens take no text
    tops = scored["logprobs"]["top_logprobs"][1 : len(ids)]
    assert all(tok in top for tok, top in zip(scored["logprobs"]["tokens"][1:], tops, strict=False))
    only = http.post("/v1/completions", json={**body, "echo": True, "logprobs": 0, "max_tokens": 0}).json()
    assert only["choices"][0]["text"] == prompt and only["usage"]["completion_tokens"] == 0
    assert len(only["choices"][0]["logprobs"]["tokens"]) == len(ids)
    assert only["choices"][0]["finish_reason"] == "length"
    streamed = client.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == prompt
    chat = http.post(
        "/v1/chat/completions",
        json={"model": model, "messages": MESSAGES, "max_tokens": 2, "prompt_logprobs": 0},
    ).json()
    assert chat["prompt_logprobs"][0] is None and all(len(r) == 1 for r in chat["prompt_logprobs"][1:])
    for bad, param in [
        ({**body, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({**body, "max_tokens": 0}, "max_tokens"),
        ({**body, "prompt_logprobs": 21}, "prompt_logprobs"),
    ]:
        resp = http.post("/v1/completions", json=bad)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


def test_truncate_prompt_tokens_and_continuous_usage_stats(server, client, model):
    """vLLM's truncate_prompt_tokens (the prompt's last N tokens, or its first with truncation_side
    right; -1: as many as the context holds) and stream_options.continuous_usage_stats (the usage so
    far in every chunk)."""
    prompt = [5, 17, 42, 99, 7, 3, 64, 12, 250, 31]
    kwargs = dict(model=model, max_tokens=6, temperature=0, extra_body=IGNORE_EOS)
    for side, kept in (("left", prompt[-4:]), ("right", prompt[:4])):
        cut = client.completions.create(
            prompt=prompt,
            **{**kwargs, "extra_body": {**IGNORE_EOS, "truncate_prompt_tokens": 4, "truncation_side": side}},
        )
        assert cut.usage.prompt_tokens == 4
        assert cut.choices[0].text == client.completions.create(prompt=kept, **kwargs).choices[0].text
    chat = client.chat.completions.create(
        messages=MESSAGES, **{**kwargs, "extra_body": {"truncate_prompt_tokens": 3}}
    )
    assert chat.usage.prompt_tokens == 3
    context = client.models.list().data[0].model_extra["max_model_len"]
    whole = client.completions.create(
        prompt=[7] * (context + 50),
        **{**kwargs, "max_tokens": 1, "extra_body": {"truncate_prompt_tokens": -1}},
    )
    assert whole.usage.prompt_tokens == context - 1
    for bad in (0, context + 1):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(
                prompt=prompt, **{**kwargs, "extra_body": {"truncate_prompt_tokens": bad}}
            )
        assert err.value.body["param"] == "truncate_prompt_tokens"
    opts = {"include_usage": True, "continuous_usage_stats": True}
    for create, extra in (
        (client.completions.create, {"prompt": prompt}),
        (client.chat.completions.create, {"messages": MESSAGES}),
    ):
        chunks = list(create(stream=True, stream_options=opts, **extra, **kwargs))
        counts = [c.usage.completion_tokens for c in chunks if c.choices and c.usage is not None]
        assert counts and counts == sorted(counts) and chunks[-1].usage.completion_tokens == 6
