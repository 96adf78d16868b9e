"""Hardening: one client's request never fails or stalls another's, bad values are refused at the
edge, and no internals reach a client."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import httpx
import pytest

from infer.engine.async_engine import RequestFailed
from infer.sampling_params import MAX_STOP_STRING_LEN, MAX_STOP_STRINGS
from infer.server.engine_errors import engine_error
from tests.server.conftest import API_KEY, ServerProcess, metric

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
GREEDY = {"prompt": "In the beginning", "max_tokens": 12, "temperature": 0, "ignore_eos": True}

# bodies that once failed every request in the engine (or gave garbage), each now a 400 naming its field
REFUSED = [
    ({"prompt": "hi", "seed": 2**70}, "seed"),
    ({"prompt": "hi", "seed": -(2**64)}, "seed"),
    ({"prompt": "hi", "seed": 2**64 - 1, "n": 2}, "seed"),
    ({"prompt": "hi", "top_k": 2**63}, "top_k"),
    ({"prompt": "hi", "stop_token_ids": [100000], "min_tokens": 1}, "stop_token_ids"),
    ({"prompt": "hi", "stop_token_ids": [2**70]}, "stop_token_ids"),
    ({"prompt": "hi", "priority": 2**70}, "priority"),
    ({"prompt": "hi", "temperature": "inf"}, "temperature"),
    ({"prompt": "hi", "top_p": "NaN"}, "top_p"),
    ({"prompt": "hi", "stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
    ({"prompt": "hi", "stop": ["x" * (MAX_STOP_STRING_LEN + 1)]}, "stop"),
    ({"messages": MSG, "chat_template_kwargs": {"chat_template": "{{ 'x' * 10 }}"}}, "trust-request-chat"),
    ({"messages": MSG, "chat_template": "{{ 'x' }}"}, "trust-request-chat"),
]
# raw bodies: JSON that Python's json accepts but no request may carry
RAW_REFUSED = [
    (CMPL, b'{"prompt": "a\\ud800b"}', "Unicode"),
    (CMPL, b'{"prompt": "hi", "temperature": Infinity}', "temperature"),
    (CMPL, b'{"prompt": "hi", "temperature": 1e400}', "temperature"),
    (CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "Unicode"),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi", "name": "\\udfff"}]}', "Unicode"),
    (CMPL, b'{"prompt": "hi", "model": "\\ud800"}', "Unicode"),
]


def _bystander(server, result: dict) -> threading.Thread:
    """A greedy stream of 300 tokens, running while the test sends its bad requests."""

    def run():
        body = {"prompt": "And God said", "max_tokens": 300, "ignore_eos": True, "temperature": 0}
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", server.url + CMPL, json=body, headers=AUTH, timeout=120) as resp:
            result["status"] = resp.status_code
            events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
        result["done"] = events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        result["usage"] = chunks[-1]["usage"]
        result["finish"] = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _check_error(resp: httpx.Response, status: int, fragment: str) -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert fragment in error["message"] and set(error) == {"message", "type", "param", "code"}, error


def test_bad_values_are_refused_while_a_bystander_streams(server):
    result: dict = {}
    thread = _bystander(server, result)
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        for body, fragment in REFUSED:
            _check_error(http.post(CHAT if "messages" in body else CMPL, json=body), 400, fragment)
        for route, raw, fragment in RAW_REFUSED:
            resp = http.post(route, content=raw, headers={"content-type": "application/json"})
            _check_error(resp, 400, fragment)
            assert "Traceback" not in resp.text and "Error:" not in resp.text
    thread.join(120)
    assert result["status"] == 200 and result["done"] and result["finish"] == "length"
    assert result["usage"]["completion_tokens"] == 300
    text = server.metrics()
    assert metric(text, "num_requests_running") == metric(text, "num_requests_waiting") == 0


def test_edge_values_that_are_accepted(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        greedy = http.post(CMPL, json=GREEDY).json()["choices"][0]["text"]
        # a temperature that would overflow is greedy; a top_p that rounds to 0 keeps the top token
        for extra in ({"temperature": 1e-50}, {"temperature": 1.0, "top_p": 1e-300, "seed": 3}):
            resp = http.post(CMPL, json=GREEDY | extra)
            assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == greedy, extra
        # the largest seed with n=2: choice 1 wraps around within int64
        resp = http.post(CMPL, json={"prompt": "hi", "max_tokens": 4, "seed": 2**63 - 1, "n": 2})
        assert resp.status_code == 200 and len(resp.json()["choices"]) == 2
        resp = http.post(CMPL, json=GREEDY | {"stop": ["zzz" + str(i) for i in range(MAX_STOP_STRINGS)]})
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == greedy


@pytest.mark.slow  # 16 streams of 150 tokens each
def test_streaming_n_beyond_the_seats_starts_at_once(server):
    """n=16 on 8 seats: the first bytes come while choices still wait for a seat, not after 8 finished."""
    body = {"prompt": "In the beginning", "max_tokens": 150, "ignore_eos": True, "n": 16, "stream": True}
    waiting_at_first_byte = None
    finished = set()
    with httpx.stream("POST", server.url + CMPL, json=body, headers=AUTH, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            if waiting_at_first_byte is None:
                waiting_at_first_byte = metric(server.metrics(), "num_requests_waiting")
            choice = json.loads(line[6:])["choices"][0]
            if choice["finish_reason"]:
                finished.add(choice["index"])
    assert waiting_at_first_byte >= 1
    assert finished == set(range(16))


def test_server_info_needs_the_key_and_no_path_leaks(server):
    _check_error(httpx.get(server.url + "/server_info"), 401, "API key")
    assert httpx.get(server.url + "/server_info", headers=AUTH).status_code == 200
    card = httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"][0]
    assert "/" not in card["root"]


def test_a_failed_request_is_a_500_without_internals():
    error = engine_error(RequestFailed("cmpl-1-0", "IndexError: index 100000 is out of bounds"), "prompt")
    assert error.status == 500 and "cmpl-1-0" in error.message and "IndexError" not in error.message
    error = engine_error(RuntimeError("/secret/path/model.safetensors"), "prompt")
    assert error.status == 500 and "/secret" not in error.message


@pytest.fixture(scope="module")
def small_server(model_args, tmp_path_factory):
    """A server with a small body bound and header timeout, that trusts request templates (and caps what
    they render)."""
    args = [*model_args, "--max-request-bytes", "65536", "--header-timeout", "2"]
    args += ["--trust-request-chat-template"]
    proc = ServerProcess(args, tmp_path_factory.mktemp("small") / "server.log").start()
    yield proc
    proc.stop()


@pytest.mark.slow  # a server of its own
def test_bodies_over_the_bound_get_413_before_they_are_read(small_server):
    big = {"prompt": "x" * 70_000, "max_tokens": 1}
    with httpx.Client(base_url=small_server.url, timeout=60) as http:
        _check_error(http.post(CMPL, json=big), 413, "--max-request-bytes")

        def chunks():  # no Content-Length: counted as it arrives
            yield b'{"prompt": "'
            for _ in range(100):
                yield b"y" * 1000
            yield b'"}'

        resp = http.post(CMPL, content=chunks(), headers={"content-type": "application/json"})
        _check_error(resp, 413, "--max-request-bytes")
        assert http.get("/health").status_code == 200
        resp = http.post(CMPL, json={"prompt": "x" * 60_000, "max_tokens": 1})
        _check_error(resp, 400, "max_model_len")  # under the bound: read, tokenized, refused by length


@pytest.mark.slow  # a server of its own
def test_a_body_over_the_bound_sent_in_one_go_gets_its_413(small_server):
    """urllib sends the whole body before it reads the answer, with `Connection: close`: the server reads
    the rest of the body after its 413, so that the client reads it instead of a reset connection."""
    prompt = json.dumps({"prompt": "x" * 20_000_000}).encode()
    chunks = [prompt[i : i + 2**20] for i in range(0, len(prompt), 2**20)]
    for data in (prompt, iter(chunks)):  # with a Content-Length, then chunked
        request = urllib.request.Request(
            small_server.url + CMPL, data=data, headers={"Content-Type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, timeout=60)
        assert err.value.code == 413
        error = json.loads(err.value.read())["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert "--max-request-bytes" in error["message"]
    assert httpx.get(small_server.url + "/health").status_code == 200


@pytest.mark.slow  # a server of its own
def test_incomplete_headers_are_closed_at_the_header_timeout(small_server):
    """A request line sent in part and then nothing (slowloris), or nothing at all, is closed after
    --header-timeout (2 s), well before the 60 s this test waits; a complete request is answered."""
    for sent in (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-", b""):
        with socket.create_connection(("127.0.0.1", small_server.port), timeout=60) as sock:
            sock.sendall(sent)
            assert sock.recv(1024) == b""  # closed, not answered: nothing came that could be
    with socket.create_connection(("127.0.0.1", small_server.port), timeout=60) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(1024).startswith(b"HTTP/1.1 200")


@pytest.mark.slow  # a server of its own
def test_an_idle_connection_outlives_the_clients_keep_alive(small_server):
    """httpx (and so the openai client) reuses a connection idle up to 5 s: the server keeps it longer,
    or a request sent as the server closes it is reset (a ReadError on a POST, not retried)."""
    with socket.create_connection(("127.0.0.1", small_server.port), timeout=60) as sock:
        for _ in range(2):
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(1024).startswith(b"HTTP/1.1 200")
            time.sleep(5.5)


@pytest.mark.slow  # a server of its own
def test_request_templates_when_trusted_are_bounded(small_server):
    with httpx.Client(base_url=small_server.url, timeout=60) as http:
        own = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
        body = {"messages": MSG, "max_tokens": 2, "chat_template": own}
        resp = http.post(CHAT, json=body)
        assert resp.status_code == 200 and resp.json()["usage"]["prompt_tokens"] > 0
        for template in (
            "{{ 'x' * 10**9 }}",
            "{{ 10**100000000 }}",
            "{% for i in range(99999) %}{{ 'y' * 9999 }}{% endfor %}",
        ):
            resp = http.post(CHAT, json={"messages": MSG, "chat_template": template})
            _check_error(resp, 400, "template")
        assert http.get("/health").status_code == 200
