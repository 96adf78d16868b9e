"""The HTTP API fuzzed from its own OpenAPI schema (schemathesis), then what people send wrong that a schema
cannot generate: every answer is a 2xx or an OpenAI-shaped 4xx, never a 5xx, a hang or a dead server, and
afterwards the engine is idle; a bystander streaming beside the fuzz has every admitted request of its
completed whole.

The fuzzer runs a fixed number of examples per operation with a fixed seed, so that the default run is
short and repeatable; a longer hunt (the lead's, on an idle machine):

    INFER_FUZZ_EXAMPLES=2000 INFER_FUZZ_SEED=$RANDOM .venv/bin/python -m pytest tests/server/test_fuzz.py

The server is small on purpose (64-token context, 4 seats + 8 queued, 256 KiB bodies), so that most huge
values are refused on their merits and the accepted requests are short; lengths the server would accept
are capped at 8 before sending, so that one example never costs more than a few decode steps per choice,
and a chat message without content gets an empty one (most chat templates refuse a missing content: left
as generated, nearly every chat example stopped there, at a 400).
"""

from __future__ import annotations

import json
import os
import threading
from collections import Counter

import httpx
import hypothesis
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from tests.server.conftest import API_KEY, ServerProcess, metric

pytestmark = pytest.mark.slow  # a server of its own and schemathesis' fuzzing

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CMPL, CHAT, RESP = "/v1/completions", "/v1/chat/completions", "/v1/responses"
MAX_MODEL_LEN = 64
MAX_SEQS, MAX_QUEUED = 4, 8
MAX_BYTES = 256 * 1024
KEPT_MAX_TOKENS = 8
FUZZ_EXAMPLES = int(os.environ.get("INFER_FUZZ_EXAMPLES", "100"))
FUZZ_SEED = int(os.environ.get("INFER_FUZZ_SEED", "14"))
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def fuzz_server(model_args, tmp_path_factory):
    args = [
        *model_args,
        "--api-key", API_KEY,
        "--max-model-len", str(MAX_MODEL_LEN),
        "--max-num-seqs", str(MAX_SEQS),
        "--max-queued-requests", str(MAX_QUEUED),
        "--max-request-bytes", str(MAX_BYTES),
        "--scheduling-policy", "priority",
    ]  # fmt: skip
    proc = ServerProcess(args, tmp_path_factory.mktemp("fuzz") / "server.log").start(timeout=300)
    yield proc
    proc.stop()


def _bounded(case) -> None:
    """Cap the lengths that the server would accept: the cost of an example stays a few steps."""
    if not isinstance(case.body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens", "min_tokens", "max_output_tokens"):
        value = case.body.get(key)
        if type(value) is int and KEPT_MAX_TOKENS < value < MAX_MODEL_LEN:
            case.body[key] = KEPT_MAX_TOKENS
    if (
        case.path == CHAT
        and case.body.get("max_tokens") is None
        and not case.body.get("max_completion_tokens")
    ):
        case.body["max_completion_tokens"] = KEPT_MAX_TOKENS  # else a reply fills the context
    if case.path == RESP and not case.body.get("max_output_tokens"):
        case.body["max_output_tokens"] = KEPT_MAX_TOKENS  # likewise
    if case.path == CHAT and isinstance(case.body.get("messages"), list):
        for message in case.body["messages"]:  # else most chats stop at the template (a 400 each)
            if isinstance(message, dict) and message.get("content") is None:
                message["content"] = ""


def check_answer(resp, what: str) -> None:
    """A 2xx (a finished SSE stream when streamed) or a 4xx with the OpenAI error shape; nothing else."""
    seen = f"{what} -> {resp.status_code} {resp.text[:1000]!r}"
    assert resp.status_code < 500, seen
    if resp.status_code >= 400:
        error = resp.json()["error"]
        assert set(error) == ERROR_KEYS and isinstance(error["message"], str) and error["message"], seen
    elif any("text/event-stream" in v for v in resp.headers.get("content-type", [])) and RESP in what:
        events = [json.loads(line[6:]) for line in resp.text.split("\n") if line.startswith("data: ")]
        assert [e["sequence_number"] for e in events] == list(range(len(events))), seen
        assert events[-1]["type"] in ("response.completed", "response.incomplete", "response.failed"), seen
    elif any("text/event-stream" in v for v in resp.headers.get("content-type", [])):  # values are lists
        events = [line[6:] for line in resp.text.split("\n") if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", seen
        for event in map(json.loads, events[:-1]):
            assert "choices" in event or set(event["error"]) == ERROR_KEYS, seen
    elif what.startswith("POST /tokenize"):
        body = resp.json()
        assert body["count"] == len(body["tokens"]) and body["max_model_len"] == MAX_MODEL_LEN, seen
    elif what.startswith("POST /detokenize"):
        assert isinstance(resp.json()["prompt"], str), seen
    elif what.startswith(("POST /v1/responses", "GET /v1/responses")):
        body = resp.json()
        assert body["object"] == "response" and body["usage"]["output_tokens"] >= 0, seen
    elif what.startswith("POST"):
        body = resp.json()
        assert body["choices"] and body["usage"]["completion_tokens"] >= 0, seen


def _fuzz(url: str, op, mode: GenerationMode) -> Counter:
    """FUZZ_EXAMPLES requests generated for `op` in `mode`; the statuses seen."""
    statuses: Counter = Counter()

    @hypothesis.seed(FUZZ_SEED)
    @settings(
        max_examples=FUZZ_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(op.as_strategy(generation_mode=mode))
    def run(case):
        _bounded(case)
        resp = case.call(base_url=url, headers=AUTH, timeout=60)  # a hang fails here
        statuses[resp.status_code] += 1
        sent = resp.request.body[:2000] if resp.request.body else b""
        check_answer(resp, f"{case.method} {case.formatted_path} {sent!r}")

    run()
    return statuses


class Bystander(threading.Thread):
    """A client streaming plain completions, one after another, until stopped: each admitted one must
    end whole (BYSTANDER_TOKENS tokens, finish_reason "length", then [DONE]); a refusal at admission (the
    fuzz may fill every seat and the queue) must be a 429 or 503 that says why."""

    BYSTANDER_TOKENS = 4

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.stop = url, threading.Event()
        self.whole, self.refused, self.broken = 0, Counter(), []

    def run(self) -> None:
        body = {"prompt": "A bystander", "max_tokens": self.BYSTANDER_TOKENS, "ignore_eos": True}
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        with httpx.Client(base_url=self.url, headers=AUTH, timeout=60) as http:
            while not self.stop.is_set():
                with http.stream("POST", CMPL, json=body) as resp:
                    if resp.status_code in (429, 503):
                        self.refused[resp.status_code] += 1
                        assert resp.read() and resp.json()["error"]["message"]
                        self.stop.wait(0.05)
                        continue
                    events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
                chunks = [json.loads(e) for e in events[:-1]]
                reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
                usage = chunks[-1].get("usage") if chunks else None
                if (
                    resp.status_code == 200
                    and events[-1] == "[DONE]"
                    and reasons[-1] == "length"
                    and usage["completion_tokens"] == self.BYSTANDER_TOKENS
                ):
                    self.whole += 1
                else:
                    self.broken.append((resp.status_code, events[-3:]))


def test_fuzz_from_the_openapi_schema(fuzz_server):
    """Every operation of /openapi.json, with bodies that fit its schema (positive) and bodies that break it
    (negative: wrong types, missing fields, out-of-range values), while a bystander streams beside it."""
    schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    paths = {CMPL, CHAT, RESP, "/v1/models", "/health", "/metrics", "/tokenize", "/detokenize"}
    assert paths <= {op.path for op in operations}
    seen = {}
    bystander = Bystander(fuzz_server.url)
    bystander.start()
    try:
        for op in operations:
            seen[op.label, "positive"] = _fuzz(fuzz_server.url, op, GenerationMode.POSITIVE)
            if op.body:  # a GET has nothing a schema can break (a path parameter is any string)
                seen[op.label, "negative"] = _fuzz(fuzz_server.url, op, GenerationMode.NEGATIVE)
    finally:
        bystander.stop.set()
        bystander.join(timeout=120)
    print({k: dict(v) for k, v in seen.items()}, "bystander:", bystander.whole, dict(bystander.refused))
    # the fuzz reached the engine: some generated requests were accepted, not only refused
    assert all(seen[f"POST {path}", "positive"][200] > 0 for path in (CMPL, CHAT, RESP))
    assert not bystander.is_alive() and not bystander.broken, bystander.broken
    assert bystander.whole > 10 * len(operations)  # it kept being served the whole time


# What people send wrong that the schema cannot express (or the fuzzer rarely reaches), beyond what
# test_errors.py and test_hardening.py already cover: (route, raw body, content type, status, message part).
JSON = "application/json"
MSG = [{"role": "user", "content": "hi"}]


def _raw(body: dict) -> bytes:
    return json.dumps(body).encode()


HI = '{"prompt": "hi"}'
SENT_WRONG = [
    # bytes that are not JSON text
    (CMPL, b'{"prompt": "\xff\xfe", "max_tokens": 2}', JSON, 400, "not valid UTF-8 (byte 0xff at offset 12)"),
    (CMPL, b"[" * 5000 + b"]" * 5000, JSON, 400, "nested too deeply"),
    # JSON in another encoding than UTF-8 (RFC 8259), said so or not: Python's json would decode it
    (CMPL, _raw({"prompt": "hi"}), JSON + "; charset=latin-1", 415, "charset=latin-1 is not supported"),
    (CMPL, HI.encode("utf-16"), JSON + "; charset=UTF-16", 415, "charset=utf-16"),
    (CMPL, HI.encode("utf-16"), JSON, 415, "starts with bytes ff fe 7b 00"),
    (CMPL, HI.encode("utf-16-be"), JSON, 415, "as UTF-16 or UTF-32"),
    (CMPL, HI.encode("utf-32-le"), JSON, 415, "as UTF-16 or UTF-32"),
    (CMPL, b'{"prompt": "hi", "seed": 1' + b"0" * 5000 + b"}", JSON, 400, "5001 digits"),
    (CMPL, b"", JSON, 400, "the body is empty"),
    # JSON, but not said so (curl -d sends a form's content type)
    (CMPL, _raw({"prompt": "hi"}), "application/x-www-form-urlencoded", 400, "JSON with Content-Type"),
    (CMPL, _raw({"prompt": "hi"}), "text/plain", 400, "got Content-Type 'text/plain'"),
    (CMPL, _raw({"prompt": "hi"}), None, 400, "got no Content-Type"),
    # duplicated keys: the last one wins, as in Python's json and JavaScript's JSON.parse
    (CMPL, b'{"prompt": "hi", "max_tokens": 2, "max_tokens": 100000}', JSON, 400, "max_tokens (100000)"),
    # wrong types, each named
    (CMPL, _raw({"prompt": 5}), JSON, 400, "prompt.str: Input should be a valid string"),
    (CMPL, _raw({"prompt": "hi", "max_tokens": 1.5}), JSON, 400, "max_tokens: Input should be a valid int"),
    (CMPL, _raw({"prompt": "hi", "n": "two"}), JSON, 400, "n: Input should be a valid integer"),
    (CMPL, _raw({"prompt": "hi", "stream": "maybe"}), JSON, 400, "stream: Input should be a valid boolean"),
    (CMPL, _raw({"prompt": "hi", "stop": [None]}), JSON, 400, "stop.list[str].0"),
    (CHAT, _raw({"messages": "hi"}), JSON, 400, "messages: Input should be a valid list"),
    (CHAT, _raw({"messages": [{"role": "user", "content": 5}]}), JSON, 400, "messages.0.content"),
    # out of range: int64, negative, NaN / infinite floats the other tests do not send
    (CMPL, _raw({"prompt": "hi", "max_tokens": 2**63}), JSON, 400, "max_tokens: Input should be less than"),
    (CMPL, _raw({"prompt": "hi", "top_p": -0.5}), JSON, 400, "top_p"),
    (CMPL, b'{"prompt": "hi", "min_p": NaN}', JSON, 400, "min_p"),
    (CMPL, b'{"prompt": "hi", "frequency_penalty": -Infinity}', JSON, 400, "frequency_penalty"),
    (CMPL, _raw({"prompt": "hi", "logprobs": -1}), JSON, 400, "logprobs"),
    (CHAT, _raw({"messages": MSG, "logprobs": True, "top_logprobs": 21}), JSON, 400, "top_logprobs"),
    (CHAT, _raw({"messages": MSG, "logprobs": True, "top_logprobs": -1}), JSON, 400, "top_logprobs"),
    (CMPL, _raw({"prompt": "hi", "stop": ["a"] * 1000}), JSON, 400, "at most 128 items"),
    # a batch that can never be admitted is refused before a prompt is looked at (a 4 MiB batch of
    # tiny prompts took 5 s of tokenizing before its refusal): here the bad last id is never reached
    (CMPL, _raw({"prompt": [[1]] * 12 + [[10**7]]}), JSON, 400, "needs 13 sequences"),
    # keys of chat_template_kwargs that the server passes itself: a 400 without internal names
    (CHAT, _raw({"messages": MSG, "chat_template_kwargs": {"add_generation_prompt": False}}), JSON, 400,
     "chat_template_kwargs may not set add_generation_prompt"),
    (CHAT, _raw({"messages": MSG, "chat_template_kwargs": {"max_chars": 10**9, "messages": []}}), JSON, 400,
     "may not set max_chars, messages"),
    # a 100k-character prompt under the body bound: tokenized, then refused with the numbers
    (CMPL, _raw({"prompt": "x" * 100_000}), JSON, 400, "exceeds max_model_len (64)"),
    (CHAT, _raw({"messages": [{"role": "user", "content": "x" * 100_000}]}), JSON, 400, "max_model_len (64)"),
    (CMPL, _raw({"prompt": "x" * (MAX_BYTES + 1)}), JSON, 413, "--max-request-bytes"),
]  # fmt: skip


def test_what_people_send_wrong(fuzz_server):
    with httpx.Client(base_url=fuzz_server.url, timeout=60) as http:
        for route, raw, content_type, status, fragment in SENT_WRONG:
            headers = AUTH | ({"content-type": content_type} if content_type else {})
            resp = http.post(route, content=raw, headers=headers)
            assert resp.status_code == status, (raw[:80], resp.text)
            error = resp.json()["error"]
            assert set(error) == ERROR_KEYS and fragment in error["message"], (raw[:80], error)
            assert "infer." not in error["message"] and "Traceback" not in error["message"], error


def test_what_people_send_that_is_accepted(fuzz_server):
    with httpx.Client(base_url=fuzz_server.url, headers=AUTH, timeout=60) as http:
        # unknown fields are ignored (OpenAI's forward compatibility), nested or not
        resp = http.post(CMPL, json={"prompt": "hi", "max_tokens": 2, "frobnicate": {"x": [1, None]}})
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] <= 2
        # JSON under any application/*+json type (as FastAPI and OpenAI's API), UTF-8 said so or not
        for content_type in (
            JSON + "; charset=UTF-8",
            'application/json; charset="utf8"',
            "application/vnd.api+json",
        ):
            resp = http.post(
                CMPL, content=_raw({"prompt": "hi", "max_tokens": 2}), headers={"content-type": content_type}
            )
            assert resp.status_code == 200, (content_type, resp.text)
        # an empty prompt is the tokenizer's BOS alone, when it has one
        resp = http.post(CMPL, json={"prompt": "", "max_tokens": 2})
        assert resp.status_code == 200 or "empty" in resp.json()["error"]["message"], resp.text
        # n > 1, streamed, with usage: every choice ends, and usage counts them all
        body = {"messages": MSG, "n": 3, "max_tokens": 4, "ignore_eos": True, "stream": True}
        body |= {"stream_options": {"include_usage": True}}
        with http.stream("POST", CHAT, json=body) as resp:
            assert resp.status_code == 200
            events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        reasons = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in chunks if c["choices"]}
        assert reasons == {0: "length", 1: "length", 2: "length"}
        assert chunks[-1]["usage"]["completion_tokens"] == 12


def test_the_schema_describes_the_api(fuzz_server):
    schema = httpx.get(fuzz_server.url + "/openapi.json", timeout=10).json()
    request = schema["components"]["schemas"]["CompletionRequest"]
    assert request["required"] == ["prompt"]
    seed = request["properties"]["seed"]["anyOf"][0]
    assert seed["exclusiveMaximum"] == 2**63 and seed["minimum"] == -(2**63)  # exact, though floats
    post = schema["paths"][CMPL]["post"]
    assert "422" not in post["responses"]  # FastAPI's default; this server answers 400
    assert post["responses"]["4XX"]["content"][JSON]["schema"]["$ref"].endswith("/ErrorResponse")
    assert "text/event-stream" in post["responses"]["200"]["content"]
    assert "text/plain" in schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]


def test_engine_idle_and_healthy_after_the_fuzz(fuzz_server):
    text = fuzz_server.metrics()
    assert metric(text, "num_requests_running") == metric(text, "num_requests_waiting") == 0
    assert metric(text, "kv_cache_usage_perc") == 0
    assert httpx.get(fuzz_server.url + "/health", timeout=10).status_code == 200
    assert "Traceback" not in fuzz_server.log_tail(10**7)  # nothing failed behind a 2xx or a 4xx
