"""A stored response is its owner's alone: every id the server makes is 128 random bits (no counter or
clock to count from), and with several API keys each key sees only the responses it stored (another's
answers 404, as an unknown id does). In-process (TestClient), embedded model; the key flags' parsing
without a model."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import re
import time

import pytest
from fastapi.testclient import TestClient

from infer.server.app import create_app
from infer.server.args import add_server_args, parse_server_args

KEY_A, KEY_B, KEY_C = "key-alice", "key-bob", "key-carol"
HEX_128 = r"[0-9a-f]{32}"
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _parse(argv: list[str]):
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    return parse_server_args(parser, argv)


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"# one key a line\n{KEY_A}\n\n  {KEY_B}  \n")
    args = _parse(["--api-key-file", str(keys), "--api-key", KEY_C, "--max-num-seqs", "4", "--enforce-eager"])
    with TestClient(create_app(args)) as client:
        deadline = time.monotonic() + 120
        while client.get("/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)  # the model loads in the background
        yield client


def _respond(http, key: str, **fields) -> dict:
    body = {"input": "Hi there.", "max_output_tokens": 2, "ignore_eos": True, **fields}
    resp = http.post("/v1/responses", json=body, headers=_auth(key))
    assert resp.status_code == 200, resp.text
    return resp.json()


def _ids(http) -> list[str]:
    """One of each id the server makes: completion, chat completion, tool call, response, output item."""
    auth = _auth(KEY_A)
    cmpl = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers=auth).json()
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "tools": [TOOL],
            "tool_choice": {"type": "function", "function": {"name": "f"}}}  # fmt: skip
    chat = http.post("/v1/chat/completions", json=chat, headers=auth).json()
    response = _respond(http, KEY_A)
    (call,) = chat["choices"][0]["message"]["tool_calls"]
    return [cmpl["id"], chat["id"], call["id"], response["id"], response["output"][0]["id"]]


@pytest.mark.slow  # loads the embedded model in-process
def test_every_id_is_128_random_bits(http):
    """Ids were `{prefix}-{counter}-{epoch ms}`: one's own id told the next one's, so another client's
    stored response could be read, continued and deleted by counting."""
    rounds = [_ids(http) for _ in range(4)]
    prefixes = ["cmpl-", "chatcmpl-", "call_", "resp-", "msg-"]
    for ids in rounds:
        for prefix, id_ in zip(prefixes, ids, strict=True):
            assert re.fullmatch(re.escape(prefix) + HEX_128, id_), id_
    secrets = [id_[-32:] for ids in rounds for id_ in ids]
    assert len(set(secrets)) == len(secrets)
    # not sequential: consecutive ids share no run of leading hex digits as a counter's would
    assert all(a[:6] != b[:6] for a, b in zip(secrets, secrets[1:], strict=False))
    bits = "".join(f"{int(s, 16):0128b}" for s in secrets)
    assert 0.4 < bits.count("1") / len(bits) < 0.6  # 2,560 bits: 10 standard deviations either side


@pytest.mark.slow  # loads the embedded model in-process
def test_another_keys_stored_response_is_not_found(http):
    """Key B cannot read, continue or delete key A's response: a 404 exactly as for an id never stored."""
    first = _respond(http, KEY_A)
    url = f"/v1/responses/{first['id']}"
    assert http.get(url, headers=_auth(KEY_A)).json() == first
    hidden_get = http.get(url, headers=_auth(KEY_B))
    hidden_delete = http.delete(url, headers=_auth(KEY_B))
    continued = http.post(
        "/v1/responses",
        json={"input": "Go on.", "previous_response_id": first["id"], "max_output_tokens": 1},
        headers=_auth(KEY_B),
    )
    assert (hidden_get.status_code, hidden_delete.status_code, continued.status_code) == (404, 404, 404)
    assert continued.json()["error"]["param"] == "previous_response_id"
    assert http.get(url, headers=_auth(KEY_C)).status_code == 404  # a key from --api-key as well

    second = _respond(http, KEY_A, previous_response_id=first["id"])  # its owner still can
    assert second["previous_response_id"] == first["id"] and second["usage"]["input_tokens"] > 0
    assert http.delete(url, headers=_auth(KEY_A)).json()["deleted"] is True
    gone = http.get(url, headers=_auth(KEY_A))
    assert gone.status_code == 404 and hidden_get.json() == gone.json()  # existence does not leak
    assert hidden_delete.json() == http.delete(url, headers=_auth(KEY_A)).json()


@pytest.mark.slow  # loads the embedded model in-process
def test_each_key_sees_its_own(http):
    mine = _respond(http, KEY_B)
    assert http.get(f"/v1/responses/{mine['id']}", headers=_auth(KEY_B)).json()["id"] == mine["id"]
    assert http.get(f"/v1/responses/{mine['id']}", headers=_auth(KEY_A)).status_code == 404


@pytest.mark.slow  # loads the embedded model in-process
@pytest.mark.parametrize("headers", [{}, _auth("key-mallory"), {"Authorization": KEY_A}])
def test_a_bad_key_is_401(http, headers):
    resp = http.get("/v1/models", headers=headers)
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"


def _owners(*keys: str) -> tuple[str, ...]:
    return tuple(hashlib.sha256(key.encode()).hexdigest() for key in keys)


def test_keys_from_flags_and_the_file(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# comment\n\nk1\n k2 \n#k3\nk,4\n")
    owners = _parse(["--api-key-file", str(keys)]).api_key_owners
    assert owners == _owners("k1", "k2", "k,4")  # a line is one key, commas and all
    assert _parse(["--api-key", "a,b", "--api-key", "c"]).api_key_owners == _owners("a", "b", "c")
    both = _parse(["--api-key", "a", "--api-key-file", str(keys), "--api-key", "a"]).api_key_owners
    assert both == _owners("a", "k1", "k2", "k,4")
    assert _parse([]).api_key_owners == ()
    config = tmp_path / "serve.yaml"
    config.write_text("api-key: [x, y]\n")
    assert _parse(["--config", str(config)]).api_key_owners == _owners("x", "y")
    assert _parse(["--config", str(config), "--api-key", "z"]).api_key_owners == _owners("z")  # flags win
    args = _parse(["--api-key", "secret-key"])
    assert "secret-key" not in repr(args) + repr(dataclasses.asdict(args))  # only its digest is kept


@pytest.mark.parametrize(
    "content, argv, message",
    [
        (None, ["--api-key-file", "{path}"], "cannot read --api-key-file"),
        ("", ["--api-key-file", "{path}"], "holds no key"),
        ("# only a comment\n\n", ["--api-key-file", "{path}"], "holds no key"),
        (None, ["--api-key", ""], "empty key"),
        (None, ["--api-key", "a,,b"], "empty key"),
        (None, ["--api-key", "a b"], "printable ASCII"),
    ],
)
@pytest.mark.parametrize("entry", ["python -m infer.server", "infer serve"])
def test_bad_keys_stop_the_start_with_exit_code_2(
    tmp_path, capsys, monkeypatch, content, argv, message, entry
):
    monkeypatch.setattr("infer.server.launch.run", lambda args: pytest.fail("the server started"))
    path = tmp_path / "keys.txt"
    if content is not None:
        path.write_text(content)
    argv = [a.format(path=path) for a in argv]
    if entry == "infer serve":
        from infer.cli import main

        code = main(["serve", *argv])
    else:
        from infer.server.__main__ import main

        code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
