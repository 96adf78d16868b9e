"""vLLM's request fields that change what a response carries, as vLLM 0.32 serves them: return_token_ids
(the prompt's and the output's ids), return_tokens_as_token_ids (logprobs name tokens "token_id:N"),
chat's continue_final_message (the prompt ends inside the last message) and echo (the last message leads
the reply), spaces_between_special_tokens. Through the official client (extra_body) and raw JSON where the
client drops a field."""

from __future__ import annotations

import httpx
import pytest

from infer.models.loader import EMBEDDED_MODEL
from tests.server.conftest import API_KEY

IGNORE_EOS = {"ignore_eos": True}
PROMPT = "And God said, Let there be light"
QUESTION = "Recite Genesis 1:1"
PREFIX = "In the beginning"  # the assistant's reply so far, for the model to continue


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c


def _ids(http, **body) -> list[int]:
    resp = http.post("/tokenize", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()["tokens"]


def _text(http, ids: list[int]) -> str:
    return http.post("/detokenize", json={"tokens": ids}).json()["prompt"]


def _extra(obj, name: str):
    """A field of vLLM's that the openai client keeps beside its own (pydantic's extra)."""
    return (obj.model_extra or {}).get(name)


def test_return_token_ids_on_completions(http, client, model):
    """prompt_token_ids are the prompt's ids (/tokenize's), token_ids the output's (as many as usage
    counts, decoding to the text); a stream sends the prompt's with each choice's first chunk and each
    chunk's new ids. With echo the prompt's text is left out (vLLM's), its logprobs are not."""
    prompt_ids = _ids(http, prompt=PROMPT)
    kwargs = dict(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    extra = {**IGNORE_EOS, "return_token_ids": True}
    resp = client.completions.create(**kwargs, n=2, extra_body=extra)
    for choice in resp.choices:
        assert _extra(choice, "prompt_token_ids") == prompt_ids
        token_ids = _extra(choice, "token_ids")
        assert len(token_ids) == 8 and _text(http, token_ids) == choice.text
    assert resp.usage.completion_tokens == 16
    chunks = list(client.completions.create(**kwargs, stream=True, extra_body=extra))
    assert _extra(chunks[0].choices[0], "prompt_token_ids") == prompt_ids
    assert all(_extra(c.choices[0], "prompt_token_ids") is None for c in chunks[1:])
    assert [t for c in chunks for t in _extra(c.choices[0], "token_ids")] == token_ids

    plain = client.completions.create(**kwargs, extra_body=IGNORE_EOS)
    assert _extra(plain.choices[0], "token_ids") is None  # only when asked for
    echoed = client.completions.create(**kwargs, echo=True, logprobs=0, extra_body=extra).choices[0]
    assert echoed.text == plain.choices[0].text and _extra(echoed, "prompt_token_ids") == prompt_ids
    assert len(echoed.logprobs.tokens) == len(prompt_ids) + 8
    first = list(client.completions.create(**kwargs, echo=True, stream=True, extra_body=extra))[0]
    assert first.choices[0].text == _text(http, token_ids[:1]) and _extra(first.choices[0], "token_ids")
    only = client.completions.create(**{**kwargs, "max_tokens": 0}, echo=True, extra_body=extra).choices[0]
    assert (only.text, _extra(only, "token_ids"), _extra(only, "prompt_token_ids")) == ("", [], prompt_ids)


def test_return_token_ids_on_chat(http, client, model):
    """The prompt's ids (the template's, as /tokenize renders it) beside the choices, and in a stream on
    each choice's role chunk; each choice's token_ids, in a stream each chunk's new ones."""
    messages = [{"role": "user", "content": QUESTION}]
    prompt_ids = _ids(http, messages=messages)
    kwargs = dict(model=model, messages=messages, max_tokens=8, temperature=0)
    extra = {**IGNORE_EOS, "return_token_ids": True}
    resp = client.chat.completions.create(**kwargs, extra_body=extra)
    assert _extra(resp, "prompt_token_ids") == prompt_ids
    token_ids = _extra(resp.choices[0], "token_ids")
    assert len(token_ids) == resp.usage.completion_tokens == 8
    assert _text(http, token_ids) == resp.choices[0].message.content
    chunks = list(client.chat.completions.create(**kwargs, n=2, stream=True, extra_body=extra))
    roles = [c for c in chunks if c.choices and c.choices[0].delta.role]
    assert [c.choices[0].index for c in roles] == [0, 1]
    assert all(_extra(c, "prompt_token_ids") == prompt_ids for c in roles)
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks[2:] if c.choices[0].index == index]
        assert [t for c in mine for t in _extra(c, "token_ids")] == token_ids


def test_return_tokens_as_token_ids(http, client, model):
    """Logprobs name each token "token_id:N", N the sampled id (return_token_ids' own), its alternatives
    too and an echoed prompt's tokens (/tokenize's ids); text_offset stays an offset into the text. Chat:
    the sampled entry's bytes are its text's, as vLLM's."""
    kwargs = dict(model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    named = {**IGNORE_EOS, "return_token_ids": True, "return_tokens_as_token_ids": True}
    resp = client.completions.create(**kwargs, echo=True, extra_body=named).choices[0]
    ids = _ids(http, prompt=PROMPT) + _extra(resp, "token_ids")
    assert resp.logprobs.tokens == [f"token_id:{t}" for t in ids]
    assert all(f"token_id:{t}" in top for t, top in zip(ids[1:], resp.logprobs.top_logprobs[1:], strict=True))
    assert all(key.startswith("token_id:") for top in resp.logprobs.top_logprobs[1:] for key in top)
    texts = client.completions.create(**kwargs, echo=True, extra_body=IGNORE_EOS).choices[0]
    assert resp.logprobs.text_offset == texts.logprobs.text_offset
    assert resp.logprobs.token_logprobs == texts.logprobs.token_logprobs
    streamed = client.completions.create(**kwargs, stream=True, extra_body=named)
    assert [t for c in streamed for t in c.choices[0].logprobs.tokens] == [f"token_id:{t}" for t in ids[-6:]]

    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body=named,
    )
    content = chat.choices[0].logprobs.content
    for entry, token_id in zip(content, _extra(chat.choices[0], "token_ids"), strict=True):
        assert entry.token == f"token_id:{token_id}"
        assert bytes(entry.bytes).decode() == _text(http, [token_id])
        assert all(bytes(top.bytes).decode() == top.token.strip() for top in entry.top_logprobs)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the likeliest


def _hand_rendered(question: str, prefix: str) -> str:
    """The served model's chat template, rendered by hand with the last (assistant) message left open."""
    if (EMBEDDED_MODEL / "config.json").is_file():
        return f"<|bos|><|user|>\n{question}<|end|>\n<|assistant|>\n{prefix}"
    return f"user: {question}\nassistant: {prefix}"  # conftest's stand-in template


def test_continue_final_message(http, client, model):
    """The prompt ends inside the assistant's message (no end of turn, no new header): its ids are those
    of the template rendered by hand, as /tokenize gives them, and the reply continues it as a completion
    of those ids does. With add_generation_prompt left true it is vLLM's 400."""
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": PREFIX}]
    open_ids = _ids(http, prompt=_hand_rendered(QUESTION, PREFIX), add_special_tokens=False)
    cont = {"continue_final_message": True, "add_generation_prompt": False}
    assert _ids(http, messages=messages, **cont) == open_ids
    closed = _ids(http, messages=messages, add_generation_prompt=False)
    assert closed[: len(open_ids)] == open_ids and len(closed) > len(open_ids)  # the end of turn is gone
    kwargs = dict(model=model, max_tokens=10, temperature=0)
    resp = client.chat.completions.create(
        messages=messages, **kwargs, extra_body={**IGNORE_EOS, **cont, "return_token_ids": True}
    )
    assert _extra(resp, "prompt_token_ids") == open_ids and resp.usage.prompt_tokens == len(open_ids)
    same = client.completions.create(prompt=open_ids, **kwargs, extra_body=IGNORE_EOS).choices[0].text
    assert resp.choices[0].message.content == same and resp.choices[0].message.role == "assistant"
    echoed = client.chat.completions.create(
        messages=messages, **kwargs, extra_body={**IGNORE_EOS, **cont, "echo": True}
    )
    assert echoed.choices[0].message.content == PREFIX + same  # what vLLM's echo is for

    body = {"model": model, "messages": messages, "continue_final_message": True}
    for route in ("/v1/chat/completions", "/tokenize"):
        error = http.post(route, json=body).json()["error"]
        assert (
            error["message"]
            == "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )
        assert error["param"] == "continue_final_message"


def test_chat_echo(http, client, model):
    """The last message's content leads the reply when it has the reply's role (the assistant's; without
    a generation prompt, the last message's own), streamed as one chunk after the role's. Not streamed,
    echo also asks for the prompt's logprobs, as vLLM's does."""
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": PREFIX}]
    kwargs = dict(model=model, messages=messages, max_tokens=6, temperature=0)
    plain = client.chat.completions.create(**kwargs, extra_body=IGNORE_EOS).choices[0].message.content
    resp = client.chat.completions.create(**kwargs, extra_body={**IGNORE_EOS, "echo": True})
    assert resp.choices[0].message.content == PREFIX + plain
    prompt_logprobs = _extra(resp, "prompt_logprobs")
    assert len(prompt_logprobs) == resp.usage.prompt_tokens and prompt_logprobs[0] is None
    assert all(len(row) == 1 for row in prompt_logprobs[1:])  # the token itself: top_logprobs 0
    chunks = list(
        client.chat.completions.create(**kwargs, stream=True, extra_body={**IGNORE_EOS, "echo": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[1].choices[0].delta.content == PREFIX
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == PREFIX + plain

    asked = [{"role": "user", "content": QUESTION}]  # the last message is the user's: nothing to echo
    reply = client.chat.completions.create(
        **{**kwargs, "messages": asked}, extra_body={**IGNORE_EOS, "echo": True}
    )
    assert not reply.choices[0].message.content.startswith(QUESTION)
    raw = http.post(
        "/v1/chat/completions",
        json={**kwargs, "messages": asked, "echo": True, "add_generation_prompt": False, **IGNORE_EOS},
    ).json()["choices"][0]["message"]
    assert raw["role"] == "user" and raw["content"].startswith(QUESTION)  # vLLM's reply role


def test_spaces_between_special_tokens(http, client, model):
    """Accepted (no longer a 400); with special tokens shown and forced, the text is the tokens' own: the
    byte-level decoder puts nothing between them either way (tests/engine/test_tokenizer.py has a
    decoder that does, against vLLM's rule)."""
    (bos,) = _ids(http, prompt="")
    kwargs = dict(model=model, prompt="Hi", max_tokens=3, temperature=0, logit_bias={str(bos): 100})
    for spaces in (True, False):
        extra = {**IGNORE_EOS, "skip_special_tokens": False, "spaces_between_special_tokens": spaces}
        assert client.completions.create(**kwargs, extra_body=extra).choices[0].text == _text(http, [bos] * 3)
