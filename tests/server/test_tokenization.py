"""vLLM's /tokenize and /detokenize: text and chat messages round-trip, the ids are those the generating
routes run on (their usage counts them), add_special_tokens and add_generation_prompt do what vLLM's do,
and bad input is an OpenAI-shaped 400 behind the API key like every /v1 route."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import API_KEY

TEXT = "And the LORD said unto Moses, Go up."
MESSAGES = [
    {"role": "system", "content": "Answer in the words of the King James Bible."},
    {"role": "user", "content": "Recite Genesis 1:1"},
]


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c


def tokenize(http, **body) -> dict:
    resp = http.post("/tokenize", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def detokenize(http, tokens: list[int]) -> str:
    resp = http.post("/detokenize", json={"model": "embedded", "tokens": tokens})
    assert resp.status_code == 200, resp.text
    assert set(resp.json()) == {"prompt"}
    return resp.json()["prompt"]


def test_text_round_trips_and_counts_as_a_completion_does(http, client, model):
    plain = tokenize(http, model=model, prompt=TEXT, add_special_tokens=False)
    assert set(plain) == {"count", "max_model_len", "tokens"}  # vLLM's TokenizeResponse
    assert plain["count"] == len(plain["tokens"]) > 0
    assert plain["max_model_len"] == client.models.list().data[0].max_model_len
    assert detokenize(http, plain["tokens"]) == TEXT
    # by default special tokens are added (vLLM's default for a prompt), as a completion adds them
    default = tokenize(http, prompt=TEXT)
    assert default == tokenize(http, prompt=TEXT, add_special_tokens=True)
    assert default["tokens"][default["count"] - plain["count"] :] == plain["tokens"]
    usage = client.completions.create(model=model, prompt=TEXT, max_tokens=1).usage
    assert usage.prompt_tokens == default["count"]
    with_strs = tokenize(http, prompt=TEXT, return_token_strs=True)
    assert len(with_strs["token_strs"]) == default["count"]
    assert all(isinstance(s, str) for s in with_strs["token_strs"])


def test_chat_messages_round_trip_and_count_as_a_chat_completion_does(http, client, model):
    chat = tokenize(http, model=model, messages=MESSAGES)
    usage = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1).usage
    assert usage.prompt_tokens == chat["count"] == len(chat["tokens"])
    text = detokenize(http, chat["tokens"])  # the rendered template, its special tokens as text
    assert all(m["content"] in text for m in MESSAGES)
    assert tokenize(http, prompt=text, add_special_tokens=False)["tokens"] == chat["tokens"]
    # the template writes the special tokens: add_special_tokens is off for messages unless asked
    assert chat == tokenize(http, messages=MESSAGES, add_special_tokens=False)
    added = tokenize(http, messages=MESSAGES, add_special_tokens=True)
    assert added["tokens"][added["count"] - chat["count"] :] == chat["tokens"]
    # without the generation prompt: the same conversation, minus the assistant's header
    bare = tokenize(http, messages=MESSAGES, add_generation_prompt=False)
    assert bare["count"] < chat["count"] and chat["tokens"][: bare["count"]] == bare["tokens"]


def _error(resp: httpx.Response, status: int, fragment: str) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and fragment in error["message"], error
    return error


def test_bad_input_is_an_openai_400(http):
    both = {"prompt": TEXT, "messages": MESSAGES}
    _error(http.post("/tokenize", json=both), 400, "either `prompt`")
    _error(http.post("/tokenize", json={"add_special_tokens": True}), 400, "either `prompt`")
    _error(http.post("/tokenize", json={"prompt": 5}), 400, "prompt: Input should be a valid string")
    _error(http.post("/tokenize", json={"messages": []}), 400, "messages")
    _error(http.post("/tokenize", json={"messages": [{"content": "hi"}]}), 400, "messages.0.role")
    cont = {"messages": MESSAGES, "continue_final_message": True}  # add_generation_prompt is true
    _error(http.post("/tokenize", json=cont), 400, "Cannot set both `continue_final_message`")
    own = {"messages": MESSAGES, "chat_template": "{{ messages }}"}
    _error(http.post("/tokenize", json=own), 400, "--trust-request-chat-template")
    _error(http.post("/tokenize", json={"prompt": "hi", "model": "other"}), 404, "does not exist")
    error = _error(http.post("/detokenize", json={"tokens": [1, 10**9]}), 400, "token ids must be in")
    assert error["param"] == "tokens"
    _error(http.post("/detokenize", json={"tokens": [-1]}), 400, "tokens.0")
    _error(http.post("/detokenize", json={"tokens": "1 2"}), 400, "tokens")
    _error(http.post("/detokenize", json={}), 400, "tokens: Field required")


def test_behind_the_api_key(server):
    for route, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        _error(httpx.post(server.url + route, json=body), 401, "missing API key")
        wrong = {"Authorization": "Bearer nope"}
        _error(httpx.post(server.url + route, json=body, headers=wrong), 401, "incorrect API key")
