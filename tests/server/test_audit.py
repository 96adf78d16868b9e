"""Regressions of an audit of the recent request features (structured outputs, prompt logprobs, echo,
truncation, n and seeds): one client's request never kills, stalls or fails the server for others."""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest

from tests.server.conftest import ServerProcess

pytestmark = pytest.mark.slow  # a server of its own

CMPL = "/v1/completions"


@pytest.fixture(scope="module")
def audit_server(model_args, tmp_path_factory):
    """A server of its own: a request that kills it must not take the shared one down with it."""
    log = tmp_path_factory.mktemp("audit") / "server.log"
    proc = ServerProcess([*model_args, "--max-batch-size", "8"], log).start()
    yield proc
    proc.stop()


def _rule_chain(n: int) -> str:
    """A Lark grammar of n rules, each referring to the next: "a" n times at most, then "b"."""
    rules = "\n".join(f'r{i}: "a" r{i + 1} | "b"' for i in range(n))
    return f'start: r0\n{rules}\nr{n}: "b"'


def _ref_chain(n: int) -> dict:
    """A JSON schema of n definitions, each an object whose one property is the next."""
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)}
    return {"$ref": "#/$defs/d0", "$defs": {**defs, f"d{n}": {"type": "integer"}}}


def test_a_deeply_nested_grammar_does_not_kill_the_server(audit_server):
    """llguidance compiles a grammar recursively, a stack frame or more per level of rules: 3,000 chained
    rules (90 KB, within the 1 MiB bound) overflowed the compiling thread's 8 MiB stack, and the whole
    server died of SIGSEGV. Such grammars compile now, and generate."""
    schema = {"type": "json_schema", "json_schema": {"name": "chain", "schema": _ref_chain(3000)}}
    cases = [
        ({"structured_outputs": {"grammar": _rule_chain(600)}}, "a*b?"),  # MAX_LARK_CHARS: 16 KiB
        ({"response_format": schema}, None),
    ]
    for extra, pattern in cases:
        body = {"prompt": "x", "max_tokens": 4, "temperature": 0, **extra}
        try:
            resp = httpx.post(audit_server.url + CMPL, json=body, timeout=120)
        except httpx.TransportError as exc:
            pytest.fail(f"the server died ({exc!r}):\n{audit_server.log_tail()}")
        assert resp.status_code == 200, resp.text
        text = resp.json()["choices"][0]["text"]
        assert pattern is None or re.fullmatch(pattern, text), text
    assert httpx.get(audit_server.url + "/health", timeout=10).status_code == 200


def test_a_slow_grammar_does_not_hold_back_other_grammars(audit_server):
    """llguidance builds a regular expression in time quadratic in its length: a 40 KB regex took ~8 s to
    refuse on the server's one grammar thread, and another client's json_object request waited as long
    behind it. Regexes (and a schema's patterns) are bounded now, and refused before compiling."""
    slow = {"prompt": "x", "max_tokens": 4, "structured_outputs": {"regex": "a?" * 20000}}
    refused = []
    thread = threading.Thread(
        target=lambda: refused.append(httpx.post(audit_server.url + CMPL, json=slow, timeout=300))
    )
    thread.start()
    time.sleep(0.5)  # the slow grammar would be compiling
    start = time.monotonic()
    body = {"prompt": "x", "max_tokens": 4, "temperature": 0, "response_format": {"type": "json_object"}}
    resp = httpx.post(audit_server.url + CMPL, json=body, timeout=300)
    waited = time.monotonic() - start
    thread.join()
    assert resp.status_code == 200, resp.text
    assert waited < 3.0, f"a json_object request waited {waited:.1f} s behind another client's grammar"
    assert (
        refused[0].status_code == 400 and "at most 8192 characters" in refused[0].json()["error"]["message"]
    )
    pattern = {"type": "string", "pattern": "a?" * 5000}
    body = {
        "prompt": "x",
        "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"schema": pattern}},
    }
    resp = httpx.post(audit_server.url + CMPL, json=body, timeout=60)
    assert resp.status_code == 400 and "patterns hold 10000 characters" in resp.json()["error"]["message"]
    choice = {"prompt": "x", "max_tokens": 4, "structured_outputs": {"choice": ["ab" * 1000]}}
    resp = httpx.post(audit_server.url + CMPL, json=choice, timeout=60)
    assert resp.status_code == 400 and "at most 1024 characters" in resp.json()["error"]["message"]
    lark = {"prompt": "x", "max_tokens": 4, "structured_outputs": {"grammar": _rule_chain(3000)}}
    resp = httpx.post(audit_server.url + CMPL, json=lark, timeout=60)
    assert resp.status_code == 400 and "at most 16384 characters" in resp.json()["error"]["message"]
