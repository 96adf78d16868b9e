"""Structured outputs under a flood of distinct grammars: compilations run --max-grammar-compilations at a
time with at most --max-queued-grammars more waiting, the overflow gets an OpenAI-shaped 429 with
Retry-After at once, and requests without a grammar keep being served meanwhile. In-process (TestClient),
embedded model; the compilations are held on a gate, so the counts do not depend on timings."""

from __future__ import annotations

import argparse
import threading
import time

import pytest
from fastapi.testclient import TestClient

from infer.server.app import create_app
from infer.server.args import add_server_args, parse_server_args

CMPL = "/v1/completions"


def _parse(argv: list[str]):
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    return parse_server_args(parser, argv)


def _wait_for(condition, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout  # a guard against a hang, not a measure
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"waited {timeout} s for {what}")
        time.sleep(0.02)


@pytest.mark.slow  # loads the embedded model in-process
def test_distinct_grammars_beyond_the_queue_get_429_while_plain_requests_run():
    queued, extra = 2, 3
    args = _parse(["--max-grammar-compilations", "1", "--max-queued-grammars", str(queued)])
    with TestClient(create_app(args)) as http:
        _wait_for(lambda: http.get("/health").status_code == 200, "the model to load")
        pool = http.app.state.server.llm.grammars._pool
        gate, compile = threading.Event(), pool._compile
        pool._compile = lambda prepared: (gate.wait(120), compile(prepared))[1]

        responses: list = []
        lock = threading.Lock()

        def post(body) -> None:
            resp = http.post(CMPL, json=body)
            with lock:
                responses.append(resp)

        bodies = [
            {"prompt": "x", "max_tokens": 2, "structured_outputs": {"regex": f"[a-z]{{{n}}}"}}
            for n in range(1, 1 + 1 + queued + extra)
        ]
        threads = [threading.Thread(target=post, args=(body,)) for body in bodies]
        for thread in threads:
            thread.start()
        _wait_for(lambda: len(responses) == extra and pool.num_in_flight == 1 + queued, "the overflow")
        for resp in responses:
            assert resp.status_code == 429 and resp.headers["Retry-After"] == "1", resp.text
            error = resp.json()["error"]
            assert error["type"] == "rate_limit_error" and "--max-queued-grammars 2" in error["message"]

        plain = http.post(CMPL, json={"prompt": "x", "max_tokens": 2})  # while every compilation waits
        assert plain.status_code == 200 and pool.num_in_flight == 1 + queued
        admitted = [b for b in bodies if b["structured_outputs"]["regex"] in _in_flight(pool)]
        again = threading.Thread(target=post, args=(admitted[0],))  # the same grammar: shared, not refused
        again.start()

        gate.set()
        for thread in [*threads, again]:
            thread.join(120)
        statuses = sorted(resp.status_code for resp in responses)
        assert statuses == [200] * (1 + queued + 1) + [429] * extra
        assert http.post(CMPL, json=bodies[-1]).status_code == 200  # room again


@pytest.mark.slow  # loads the embedded model in-process
def test_a_compilation_past_its_time_is_a_400_naming_the_field():
    args = _parse(["--grammar-compile-timeout", "0.5"])
    with TestClient(create_app(args)) as http:
        _wait_for(lambda: http.get("/health").status_code == 200, "the model to load")
        pool = http.app.state.server.llm.grammars._pool
        gate, compile = threading.Event(), pool._compile
        pool._compile = lambda prepared: (gate.wait(120), compile(prepared))[1]
        schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}}
        body = {"prompt": "x", "max_tokens": 2, "response_format": schema}
        resp = http.post(CMPL, json=body)  # held past its 0.5 s
        error = resp.json()["error"]
        assert resp.status_code == 400 and error["param"] == "response_format", error
        assert error["message"].startswith("response_format: grammar did not compile within 0.5 s")
        gate.set()
        _wait_for(lambda: pool.num_in_flight == 0, "the held compilation to return")
        pool._compile = compile
        assert http.post(CMPL, json=body).status_code == 200  # compiled afresh, in time


def _in_flight(pool) -> set[str]:
    return {key[1] for key in pool._in_flight}  # (kind, text, options)


def test_the_grammar_bounds_are_flags():
    args = _parse(
        [
            "--grammar-cache-mb", "8", "--max-grammar-compilations", "2", "--max-queued-grammars", "0",
            "--grammar-compile-timeout", "2.5",
        ]
    )  # fmt: skip
    engine = args.engine
    assert (engine.grammar_cache_mb, engine.max_grammar_compilations) == (8, 2)
    assert (engine.max_queued_grammars, engine.grammar_compile_timeout) == (0, 2.5)
    for argv, fragment in [
        (["--max-grammar-compilations", "0"], "max_grammar_compilations"),
        (["--max-queued-grammars", "-1"], "max_queued_grammars"),
        (["--grammar-cache-mb", "-1"], "grammar_cache_mb"),
        (["--grammar-compile-timeout", "0"], "grammar_compile_timeout"),
    ]:
        with pytest.raises(ValueError, match=fragment):
            _parse(argv)
