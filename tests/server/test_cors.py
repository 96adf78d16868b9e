"""CORS (vLLM's --allowed-origins, --allowed-methods, --allowed-headers, --allow-credentials): a browser's
preflight is answered before any API key is asked for, and answers carry the headers a page needs to read
them, errors included. No model is loaded: CORS does not depend on it."""

from __future__ import annotations

import argparse

import pytest
from fastapi.testclient import TestClient

from infer.server.app import create_app
from infer.server.args import add_server_args, parse_server_args

PAGE = "http://localhost:3000"
PREFLIGHT = {
    "Origin": PAGE,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}


def _client(*flags: str) -> TestClient:
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    args = parse_server_args(parser, ["--load-format", "dummy", "--api-key", "k", *flags])
    return TestClient(create_app(args))  # no `with`: the lifespan (which loads the model) never runs


def test_by_default_any_page_may_call_as_in_vllm():
    http = _client()
    resp = http.options("/v1/chat/completions", headers=PREFLIGHT)
    assert resp.status_code == 200  # not 401: a preflight carries no API key
    assert resp.headers["access-control-allow-origin"] == "*"
    assert "POST" in resp.headers["access-control-allow-methods"]
    assert "authorization" in resp.headers["access-control-allow-headers"].lower()
    # an error (no key here) is readable by the page too
    denied = http.post("/v1/chat/completions", headers={"Origin": PAGE}, json={})
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == "*"


@pytest.mark.parametrize("origins", ['["http://localhost:3000"]', "http://localhost:3000,http://a.example"])
def test_only_the_allowed_origins_methods_and_headers(origins):
    http = _client(
        "--allowed-origins",
        origins,
        "--allowed-methods",
        "GET,POST",
        "--allowed-headers",
        '["Authorization"]',
    )
    resp = http.options(
        "/v1/chat/completions", headers={**PREFLIGHT, "Access-Control-Request-Headers": "authorization"}
    )
    assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == PAGE
    assert set(resp.headers["access-control-allow-methods"].split(", ")) == {"GET", "POST"}

    other_page = http.options("/v1/chat/completions", headers={**PREFLIGHT, "Origin": "http://evil.example"})
    assert other_page.status_code == 400 and "access-control-allow-origin" not in other_page.headers
    other_method = http.options(
        "/v1/chat/completions", headers={**PREFLIGHT, "Access-Control-Request-Method": "DELETE"}
    )
    assert other_method.status_code == 400
    other_header = http.options(
        "/v1/chat/completions", headers={**PREFLIGHT, "Access-Control-Request-Headers": "x-secret"}
    )
    assert other_header.status_code == 400
    plain = http.get("/health", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in plain.headers


def test_credentials():
    http = _client("--allowed-origins", PAGE, "--allow-credentials")
    resp = http.options("/v1/models", headers=PREFLIGHT)
    assert resp.headers["access-control-allow-credentials"] == "true"
    assert resp.headers["access-control-allow-origin"] == PAGE


def test_a_list_that_is_not_a_list_of_strings_is_refused(capsys):
    with pytest.raises(SystemExit):
        _client("--allowed-origins", '["a", 1]')
    assert "list of strings" in capsys.readouterr().err
