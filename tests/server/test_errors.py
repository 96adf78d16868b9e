"""Bad input: each answered with the right status and an OpenAI-shaped error, the server still alive.
Plus the API key, 503 before the model is loaded, and the flags / config file."""

from __future__ import annotations

import argparse
import gc
import subprocess
import sys
import time

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from infer.server.app import create_app
from infer.server.args import add_server_args, parse_server_args
from tests.server.conftest import API_KEY, free_port, metric

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MSG = [{"role": "user", "content": "hi"}]
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"

# (route, body (a dict, or raw bytes), status, a piece of the message)
BAD_INPUTS = [
    (CMPL, b"{not json", 400, "not valid JSON"),
    (CMPL, b"[1, 2]", 400, "body"),
    (CMPL, {"max_tokens": 3}, 400, "prompt"),
    (CMPL, {"prompt": []}, 400, "empty"),
    (CMPL, {"prompt": [[]]}, 400, "empty"),
    (CMPL, {"prompt": "hi", "max_tokens": 100_000}, 400, "max_model_len"),
    (CMPL, {"prompt": [1] * 5000, "max_tokens": 1}, 400, "max_model_len"),
    (CMPL, {"prompt": [1, 2, 10**7]}, 400, "token ids"),
    (CMPL, {"prompt": [1, -2]}, 400, "token ids"),
    (CMPL, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    (CMPL, {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    (CMPL, {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    (CMPL, {"prompt": "hi", "top_k": -3}, 400, "top_k"),
    (CMPL, {"prompt": "hi", "min_p": 2}, 400, "min_p"),
    (CMPL, {"prompt": "hi", "n": 0}, 400, "n"),
    (CMPL, {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    (CMPL, {"prompt": "hi", "max_tokens": 3, "min_tokens": 5}, 400, "min_tokens"),
    (CMPL, {"prompt": "hi", "stop": [""]}, 400, "stop"),
    (CMPL, {"prompt": "hi", "priority": "high"}, 400, "priority"),
    (CMPL, {"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
    (CMPL, {"prompt": "hi", "frequency_penalty": -3}, 400, "frequency_penalty"),
    (CMPL, {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    (CMPL, {"prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    (CMPL, {"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    (CMPL, {"prompt": "hi", "logit_bias": {"-1": 1}}, 400, "logit_bias"),
    (CMPL, {"prompt": "hi", "logit_bias": {"10000000": 1}}, 400, "logit_bias"),
    (CMPL, {"prompt": "hi", "stream": True, "logit_bias": {"10000000": 1}}, 400, "logit_bias"),
    (CMPL, {"prompt": "hi", "stop_token_ids": [10000000]}, 400, "stop_token_ids"),
    (CHAT, {"messages": MSG, "logit_bias": {"10000000": 1}}, 400, "logit_bias"),
    (CMPL, {"prompt": "hi", "use_beam_search": True}, 400, "use_beam_search"),
    (CMPL, {"prompt": "hi", "guided_json": {"type": "foo"}}, 400, "guided_json"),
    (CMPL, {"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400, "exactly one"),
    (CMPL, {"prompt": "hi", "structured_outputs": {"choice": []}}, 400, "choice"),
    (CMPL, {"prompt": "hi", "guided_choice": "yes"}, 400, "choice"),
    (CMPL, {"prompt": "hi", "structured_outputs": {"json": 5}}, 400, "json"),
    (CMPL, {"prompt": "hi", "structured_outputs": {"grammar": "x ::: ="}}, 400, "grammar"),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_schema"}}, 400, "json_schema.schema"),
    (CHAT, {"messages": MSG, "response_format": {"type": "structural_tag"}}, 400, "response_format"),
    (CHAT, {"messages": MSG, "stream": True, "structured_outputs": {"regex": "(ab"}}, 400, "regex"),
    (CHAT, {"messages": MSG, "continue_final_message": True}, 400, "Cannot set both"),
    (CMPL, {"prompt": "hi", "logits_processors": ["x"]}, 400, "logits_processors"),
    (CHAT, {"messages": MSG, "length_penalty": 0.5}, 400, "length_penalty"),
    (CHAT, {"messages": MSG, "stream": True, "bad_words": [" "]}, 400, "bad_words"),
    (CMPL, {"prompt": "hi", "bad_words": ["x"] * 129}, 400, "bad_words"),
    (CMPL, {"prompt": "hi", "bad_words": [f"w{i}" for i in range(100)]}, 400, "token sequences"),
    (CMPL, {"prompt": "hi", "allowed_token_ids": [10000000]}, 400, "allowed_token_ids"),
    (CMPL, {"prompt": "hi", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    (
        CMPL,
        {"prompt": "hi", "allowed_token_ids": [3], "stop_token_ids": [3], "min_tokens": 1},
        400,
        "stop tokens",
    ),
    (CMPL, {"prompt": "hi", "truncate_prompt_tokens": -2}, 400, "truncate_prompt_tokens"),
    (
        CMPL,
        {"prompt": "hi", "truncate_prompt_tokens": 2, "truncation_side": "middle"},
        400,
        "truncation_side",
    ),
    (CMPL, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    (CMPL, {"prompt": "hi", "stream": True, "prompt_logprobs": 0}, 400, "prompt_logprobs"),
    (CMPL, {"prompt": "hi", "stream": True, "max_tokens": 100_000}, 400, "max_model_len"),
    (CMPL, {"prompt": "hi", "model": "gpt-4"}, 404, "gpt-4"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": [{"content": "hi"}]}, 400, "role"),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "text"),
    (CHAT, {"messages": MSG, "max_completion_tokens": 100_000}, 400, "max_model_len"),
    (CHAT, {"messages": MSG, "stream": True, "max_tokens": 100_000}, 400, "max_model_len"),
    (CHAT, {"messages": MSG, "model": "nope"}, 404, "nope"),
    ("/v1/nothing-here", {}, 404, "Not Found"),
]


def _assert_openai_error(resp: httpx.Response, status: int, fragment: str) -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and fragment in error["message"], error
    assert isinstance(error["type"], str) and error["type"]


def test_unknown_fields_are_ignored_and_logged(server):
    """As vLLM: a field this server does not know is ignored (forward compatibility) and named in the log;
    those that would change the output are refused (BAD_INPUTS), unless sent with the value it acts on."""
    body = {
        "prompt": "hi",
        "max_tokens": 2,
        "ignore_eos": True,
        "frobnicate_xyz": 1,
        "use_beam_search": False,
    }
    resp = httpx.post(server.url + CMPL, json=body, headers=AUTH, timeout=60)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 2
    deadline = time.monotonic() + 10
    while "ignored (unknown to this server): ['frobnicate_xyz']" not in server.log_tail():
        assert time.monotonic() < deadline, server.log_tail()
        time.sleep(0.1)


def test_bad_inputs_table(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        for route, body, status, fragment in BAD_INPUTS:
            if isinstance(body, bytes):
                resp = http.post(route, content=body, headers={"content-type": "application/json"})
            else:
                resp = http.post(route, json=body)
            _assert_openai_error(resp, status, fragment)
        assert http.get("/health").status_code == 200
        resp = http.post(CMPL, json={"prompt": "still alive", "max_tokens": 2, "ignore_eos": True})
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 2
    text = server.metrics()
    assert metric(text, "num_requests_running") == metric(text, "num_requests_waiting") == 0


def test_errors_through_the_official_client(client, model):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=model, prompt="hi", max_tokens=100_000)
    assert "max_model_len" in exc.value.message and exc.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="missing-model", messages=MSG)


def test_api_key(server):
    body = {"prompt": "hi", "max_tokens": 1}
    _assert_openai_error(httpx.post(server.url + CMPL, json=body), 401, "API key")
    wrong = {"Authorization": "Bearer nope"}
    _assert_openai_error(httpx.post(server.url + CMPL, json=body, headers=wrong), 401, "API key")
    _assert_openai_error(httpx.get(server.url + "/v1/models", headers=wrong), 401, "API key")
    assert httpx.get(server.url + "/health").status_code == 200  # health and metrics stay open
    assert httpx.get(server.url + "/metrics").status_code == 200
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def _parse(argv: list[str]):
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    return parse_server_args(parser, argv)


def test_503_until_the_model_is_loaded():
    app = create_app(_parse(["--load-format", "dummy"]))
    http = TestClient(app)  # no `with`: the lifespan (which loads the model) never runs
    _assert_openai_error(http.get("/health"), 503, "loading")
    _assert_openai_error(http.post(CMPL, json={"prompt": "hi"}), 503, "loading")
    _assert_openai_error(http.post(CHAT, json={"messages": MSG}), 503, "loading")


def test_seed_flags_map_onto_the_engine_config():
    seed_002 = (
        "--model M --max-batch-size 8 --batching-mode continuous --kv-cache-backend paged "
        "--num-gpu-blocks 2048 --chunked-prefill --prefill-chunk-size 512 --prefix-caching"
    )
    cfg = _parse(seed_002.split()).engine
    assert (cfg.model, cfg.max_num_seqs, cfg.num_kv_blocks, cfg.prefill_chunk_size) == ("M", 8, 2048, 512)
    assert cfg.enable_chunked_prefill and cfg.enable_prefix_caching and cfg.batching_mode == "continuous"
    flags = "--num-kv-blocks 64 --no-chunked-prefill --no-prefix-caching --scheduling-policy priority"
    args = _parse(
        [
            *flags.split(),
            "--batching-mode",
            "static",
            "--kv-cache-backend",
            "contiguous",
            "--max-num-seqs",
            "4",
        ]
    )
    cfg = args.engine
    assert (cfg.num_kv_blocks, cfg.max_num_seqs, cfg.policy, cfg.batching_mode) == (
        64,
        4,
        "priority",
        "static",
    )
    assert not cfg.enable_chunked_prefill and not cfg.enable_prefix_caching
    assert cfg.kv_cache_backend == "contiguous"
    default = _parse([])
    assert default.engine.enable_prefix_caching and default.engine.enable_chunked_prefill
    assert default.engine.kv_cache_backend == "paged" and default.engine.batching_mode == "continuous"
    assert (default.host, default.port, default.model_name, default.cuda_graphs) == (
        "127.0.0.1",
        8000,
        "embedded",
        False,
    )


def test_config_file_with_flags_overriding(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("max-batch-size: 8\nnum_gpu_blocks: 1024\nprefix-caching: false\nport: 9000\n")
    args = _parse(["--config", str(path), "--port", "9001"])
    assert (args.engine.max_num_seqs, args.engine.num_kv_blocks, args.port) == (8, 1024, 9001)
    assert not args.engine.enable_prefix_caching
    path.write_text("max-batch-sise: 8\n")
    with pytest.raises(ValueError, match="unknown key 'max-batch-sise'"):
        _parse(["--config", str(path)])
    path.write_text("kv-cache-backend: pagd\n")
    with pytest.raises(ValueError, match="kv-cache-backend must be one of"):
        _parse(["--config", str(path)])


def test_cuda_graphs_refused_without_cuda(monkeypatch, capsys):
    import torch

    from infer.server.__main__ import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["--cuda-graphs"]) == 2
    assert "--cuda-graphs needs a CUDA GPU" in capsys.readouterr().err
    from infer import cli

    assert cli.main(["serve", "MODEL", "--cuda-graphs"]) == 2
    assert "--cuda-graphs needs a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        _parse(["--max-num-seqs", "64", "--max-num-batched-tokens", "32"])


def test_infer_serve_subcommand(monkeypatch, tmp_path):
    from infer import cli

    seen = []
    monkeypatch.setattr("infer.server.launch.run", lambda args: seen.append(args) or 0)
    path = tmp_path / "serve.yaml"
    path.write_text("max-batch-size: 4\nport: 9000\n")
    assert cli.main(["serve", "MODEL", "--config", str(path), "--port", "9001"]) == 0
    (args,) = seen
    assert (args.engine.model, args.engine.max_num_seqs, args.port) == ("MODEL", 4, 9001)


@pytest.mark.slow  # a server process that fails to load
def test_a_model_that_cannot_load_exits_1(tmp_path):
    port = str(free_port())
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.run(
            [sys.executable, "-m", "infer.server", "--model", str(tmp_path / "missing"), "--port", port],
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=120,
        )
    assert proc.returncode == 1
    assert "could not load the model" in log.read_text()


def _ready(http: TestClient) -> TestClient:
    """http once the model, loading in the background, serves (at most 120 s)."""
    deadline = time.monotonic() + 120
    while http.get("/health").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    return http


def _check_flag(tmp_path, flag: str, value: str, bad: str) -> None:
    """--flag from a --config file reaches the engine's config; a value not among its choices exits."""
    config = tmp_path / "serve.yaml"
    config.write_text(f"{flag}: {value}\n")
    assert getattr(_parse(["--config", str(config)]).engine, flag.replace("-", "_")) == value
    with pytest.raises(SystemExit):
        _parse([f"--{flag}", bad])


@pytest.mark.slow  # loads the embedded model in-process
def test_quantization_flag_reaches_the_engine_and_server_info(tmp_path):
    _check_flag(tmp_path, "quantization", "int8", "int3")
    with TestClient(create_app(_parse(["--quantization", "int4"]))) as http:
        info = _ready(http).get("/server_info").json()
        quant = info["quantization"]
        assert info["engine"]["quantization"] == "int4" and quant["method"] == "int4"
        assert quant["bits"] == 4 and quant["lm_head"] == "int8" and quant["layers"] > 0
        reply = http.post(CMPL, json={"prompt": "In the beginning", "max_tokens": 4})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4


@pytest.mark.slow  # loads the embedded model in-process
def test_kv_cache_dtype_flag_reaches_the_cache_and_server_info(tmp_path):
    _check_flag(tmp_path, "kv-cache-dtype", "fp8_e5m2", "int8")
    gc.unfreeze()  # an in-process engine earlier in this session froze it already
    with TestClient(create_app(_parse(["--kv-cache-dtype", "fp8", "--kv-cache-memory-gb", "0.05"]))) as http:
        info = _ready(http).get("/server_info").json()
        frozen = gc.get_freeze_count()
        gc.unfreeze()  # the test process's own heap goes back to the collector
        assert frozen > 10_000  # the loaded heap, out of the collector's reach (LLMEngine.warm_up)
        assert info["engine"]["kv_cache_dtype"] == "fp8" and info["kv_cache_dtype"] == "float8_e4m3fn"
        # the embedded model: 6 layers x 2 kv heads x 64 dims x 2 (K and V) bytes a token in fp8
        assert info["kv_capacity_tokens"] == int(0.05 * 2**30) // (16 * 6 * 2 * 64 * 2) * 16
        reply = http.post(CMPL, json={"prompt": "In the beginning", "max_tokens": 4})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
