"""GET /debug/trace: the last seconds of the engine trace with --trace (behind --api-key), an OpenAI-shaped
404 without it; the trace file written when the server shuts down. In-process (TestClient), embedded model."""

from __future__ import annotations

import argparse
import json
import time

import pytest
from fastapi.testclient import TestClient

from infer.server.app import create_app
from infer.server.args import add_server_args, parse_server_args

KEY = "trace-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _parse(argv: list[str]):
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    return parse_server_args(parser, argv)


def _error(resp, status: int) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.slow  # loads the embedded model in-process
def test_debug_trace_with_trace_on(tmp_path):
    path = tmp_path / "trace.json"
    args = _parse(["--trace", str(path), "--trace-steps", "1000", "--api-key", KEY])
    assert args.engine.trace_path == str(path) and args.engine.trace_steps == 1000
    with TestClient(create_app(args)) as http:
        deadline = time.monotonic() + 60
        while http.get("/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)  # the model loads in the background
        body = {"prompt": "In the beginning", "max_tokens": 4, "ignore_eos": True}
        assert http.post("/v1/completions", json=body, headers=AUTH).status_code == 200
        resp = http.get("/debug/trace?seconds=60", headers=AUTH)
        assert resp.status_code == 200 and resp.headers["content-type"] == "application/json"
        events = resp.json()["traceEvents"]
        assert sum(e["name"] == "step" for e in events) >= 4  # a prefill and three decodes, at least
        ends = [e for e in events if e["ph"] == "e" and e["name"] == e["id"]]
        assert [e["args"]["finish_reason"] for e in ends] == ["length"]
        assert {e["name"] for e in events if e["ph"] == "C"} == {"requests", "kv_blocks", "tokens"}
        assert len(http.get("/debug/trace", headers=AUTH).json()["traceEvents"]) >= len(events)
        _error(http.get("/debug/trace?seconds=60"), 401)
        assert _error(http.get("/debug/trace?seconds=-1", headers=AUTH), 400)["param"] == "seconds"
        _error(http.get("/debug/trace?seconds=inf", headers=AUTH), 400)
    written = json.loads(path.read_text())["traceEvents"]  # at shutdown
    assert sum(e["name"] == "step" for e in written) == sum(e["name"] == "step" for e in events)


def test_debug_trace_is_a_404_when_tracing_is_off():
    http = TestClient(create_app(_parse([])))  # no `with`: no model needed to answer this
    error = _error(http.get("/debug/trace?seconds=5"), 404)
    assert "--trace" in error["message"] and error["type"] == "not_found_error"
