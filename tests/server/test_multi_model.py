"""Several models in one server (infer.server.model_manager): load on the first request, the LRU idle model
unloaded under --models-max / --models-memory-gb, never a model with a request running, keep_alive, POST
/models/load and /models/unload, a corrupt model's error. llama.cpp's router tests (test_router.py) carry
over: the LRU eviction, a busy model kept, concurrent requests for one model loading it once, a request
after an unload loading it again.

The server runs in this process (uvicorn on a thread, a real loopback socket, so that a stream stays open
while other requests come), on three copies of a tiny random Llama; the manager's own accounting (models
loaded, bytes held, engines built) is read directly.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from infer.config import EngineConfig
from infer.server import model_manager
from infer.server.app import create_app
from infer.server.args import add_server_args, parse_server_args
from infer.server.model_specs import estimated_bytes, parse_keep_alive
from tests.server.conftest import TINY_CHAT_TEMPLATE, free_port

NAMES = ("alpha", "beta", "gamma")
ENGINE_FLAGS = ["--dtype", "float32", "--num-kv-blocks", "64", "--enforce-eager", "--keep-alive", "-1"]


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    """Three tiny random Llamas, each in its folder, with a byte tokenizer and a chat template."""
    from tests.models.tiny_models import save_byte_tokenizer, save_tiny_model

    root = tmp_path_factory.mktemp("models")
    _, path = save_tiny_model("llama", tmp_path_factory.mktemp("tiny"))
    save_byte_tokenizer(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TINY_CHAT_TEMPLATE}))
    model_config = json.loads((path / "config.json").read_text())
    model_config["max_position_embeddings"] = 1024  # room for a long stream
    (path / "config.json").write_text(json.dumps(model_config))
    for name in NAMES:
        shutil.copytree(path, root / name)
    return root


def _parse(argv: list[str]):
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    return parse_server_args(parser, argv)


class InProcessServer:
    """The app under uvicorn on a thread of this process, on a free loopback port."""

    def __init__(self, argv: list[str]):
        self.app = create_app(_parse(argv))
        self.manager = self.app.state.models
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        config = uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> InProcessServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        self.http = httpx.Client(base_url=self.url, timeout=120)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)
        return self

    def __exit__(self, *exc) -> None:
        self.http.close()
        self.server.should_exit = True
        self.thread.join(60)

    def complete(self, model: str, **fields) -> httpx.Response:
        body = {"model": model, "prompt": "In the beginning", "max_tokens": 4, "ignore_eos": True, **fields}
        return self.http.post("/v1/completions", json=body)

    def statuses(self) -> dict[str, str]:
        return {m["id"]: m["status"]["value"] for m in self.http.get("/v1/models").json()["data"]}

    def wait_for(self, name: str, status: str) -> None:
        deadline = time.monotonic() + 60
        while self.statuses()[name] != status:
            assert time.monotonic() < deadline, f"{name} never became {status}: {self.statuses()}"
            time.sleep(0.02)


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


# -- flags, no model loaded ------------------------------------------------------------------------------


def test_keep_alive_durations_as_ollama_reads_them():
    assert parse_keep_alive("5m") == 300
    assert parse_keep_alive("1h30m") == 5400
    assert parse_keep_alive("300ms") == pytest.approx(0.3)
    assert parse_keep_alive(10) == 10 and parse_keep_alive("10") == 10
    assert parse_keep_alive(0) == 0 and parse_keep_alive("0") == 0
    assert parse_keep_alive(-1) is None and parse_keep_alive("-1m") is None  # until evicted
    for bad in ("soon", "5 minutes", "5m3", True, float("inf")):
        with pytest.raises(ValueError, match="keep_alive"):
            parse_keep_alive(bad)


def test_models_dir_flags(models_dir, tmp_path):
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_server_args(parser)
    assert "--models-memory-gb G" in parser.format_help()  # --help renders (a bare % would break it)
    args = _parse(["--models-dir", str(models_dir), "--models-max", "2", "--keep-alive", "10m"])
    assert [s.name for s in args.models.specs] == list(NAMES)
    assert args.models.max_loaded == 2 and args.models.keep_alive_s == 600
    assert all(s.engine.model == str(models_dir / s.name) for s in args.models.specs)
    assert _parse([]).models is None  # one model: as it always was
    (tmp_path / "empty").mkdir()
    for argv, message in (
        (["--models-dir", str(models_dir), "--model", "x"], "--model"),
        (["--models-dir", str(tmp_path / "empty")], "holds no model"),
        (["--models-dir", str(tmp_path / "nowhere")], "not a folder"),
        (["--models-dir", str(models_dir), "--models-max", "0"], "--models-max"),
        (["--models-dir", str(models_dir), "--keep-alive", "later"], "--keep-alive"),
    ):
        with pytest.raises(ValueError, match=message):
            _parse(argv)


def test_models_file_gives_each_model_its_own_flags(models_dir, tmp_path):
    path = tmp_path / "models.yaml"
    path.write_text(
        f"chat: {models_dir / 'alpha'}\n"
        f"coder:\n  model: {models_dir / 'beta'}\n  max-model-len: 128\n  kv_cache_memory_gb: 0.5\n"
        "  quantization: int8\n  keep_alive: 30s\n"
    )
    specs = {s.name: s for s in _parse(["--models", str(path), "--dtype", "float32"]).models.specs}
    assert specs["chat"].engine.max_model_len is None and specs["chat"].engine.dtype == "float32"
    coder = specs["coder"]
    assert (coder.engine.max_model_len, coder.engine.kv_cache_memory_gb) == (128, 0.5)
    assert coder.engine.quantization == "int8" and coder.keep_alive_s == 30
    path.write_text(f"chat:\n  model: {models_dir / 'alpha'}\n  max_batch: 3\n")
    with pytest.raises(ValueError, match="unknown key 'max_batch'"):
        _parse(["--models", str(path)])


def test_estimate_counts_weights_at_the_loaded_dtype_and_the_kv_pool(models_dir):
    path = str(models_dir / "alpha")
    weights = (models_dir / "alpha" / "model.safetensors").stat().st_size  # a float32 checkpoint
    config = json.loads((models_dir / "alpha" / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    # 64 blocks x 16 tokens x (keys + values) x layers x KV heads x head_dim x 4 bytes
    pool = 64 * 16 * 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
    assert estimated_bytes(EngineConfig(model=path, dtype="float32", num_kv_blocks=64)) == weights + pool
    bf16 = EngineConfig(model=path, dtype="bfloat16", num_kv_blocks=64)
    assert estimated_bytes(bf16) == weights // 2 + pool // 2
    assert estimated_bytes(EngineConfig(model=path, kv_cache_memory_gb=0.5)) == weights + 2**29


def test_unknown_model_is_a_404_listing_the_served_ones(models_dir):
    with InProcessServer(["--models-dir", str(models_dir), *ENGINE_FLAGS]) as server:
        error = _error(server.complete("delta"), 404)
        assert error["code"] == "model_not_found" and all(f"`{n}`" in error["message"] for n in NAMES)
        assert _error(server.http.post("/models/load", json={"model": "delta"}), 404)["param"] == "model"
        assert _error(server.complete(None), 400)["param"] == "model"
        models = server.client.models.list().data
        assert [m.id for m in models] == list(NAMES)
        assert all(m.status == {"value": "unloaded"} for m in models)  # nothing loads before it is asked
        assert all(m.task == "generate" for m in models)  # what each is for, read without loading it
        assert server.manager.num_loads == 0


# -- loading, eviction, keep_alive -----------------------------------------------------------------------


def test_requests_alternating_between_three_models_all_answer(models_dir):
    with InProcessServer(["--models-dir", str(models_dir), *ENGINE_FLAGS]) as server:
        for name in (*NAMES, *NAMES):
            resp = server.complete(name)
            assert resp.status_code == 200, resp.text
            assert resp.json()["model"] == name and resp.json()["usage"]["completion_tokens"] == 4
        chat = server.client.chat.completions.create(
            model="beta", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert chat.model == "beta" and chat.usage.completion_tokens <= 3
        assert server.statuses() == dict.fromkeys(NAMES, "loaded")
        assert server.manager.num_loads == 3  # each once
        metrics = server.http.get("/metrics").text
        samples = [s for f in text_string_to_metric_families(metrics) for s in f.samples]
        assert samples and all(s.labels["model"] == s.labels["model_name"] for s in samples)
        for name in NAMES:  # vLLM's label and the request field's, each model's own series
            success = [
                s for s in samples if s.name == "infer:request_success_total" and s.labels["model"] == name
            ]
            assert {s.labels["finished_reason"]: s.value for s in success}["length"] >= 2
        tokens = server.http.post("/tokenize", json={"model": "gamma", "prompt": "abc"}).json()
        assert tokens["count"] == 3


def test_models_max_unloads_the_least_recently_used_idle_model(models_dir, monkeypatch):
    collections = []  # full garbage collections at unload: none needed, reference counting frees it all
    monkeypatch.setattr(model_manager, "gc", SimpleNamespace(collect=lambda: collections.append(1)))
    with InProcessServer(["--models-dir", str(models_dir), "--models-max", "2", *ENGINE_FLAGS]) as server:
        for name in ("alpha", "beta", "alpha"):  # beta is now the least recently used
            assert server.complete(name).status_code == 200
        llm = server.manager.entries["beta"].state.llm
        kv, weight = llm.runner.kv_caches[0][0], next(llm.runner.model.parameters())
        held = [weakref.ref(x) for x in (llm, kv, weight)]
        del llm, kv, weight
        assert server.complete("gamma").status_code == 200
        server.wait_for("beta", "unloaded")
        assert server.statuses() == {"alpha": "loaded", "beta": "unloaded", "gamma": "loaded"}
        assert server.manager.num_loaded == 2
        assert [ref() for ref in held] == [None] * 3  # the engine, its KV pool and its weights are freed
        assert collections == []
        assert server.complete("beta").status_code == 200  # loads again, alpha now the LRU
        server.wait_for("alpha", "unloaded")
        assert server.manager.num_loads == 4


def test_memory_bound_unloads_the_lru_idle_model_and_refuses_what_cannot_fit(models_dir, tmp_path):
    one = estimated_bytes(EngineConfig(model=str(models_dir / "alpha"), dtype="float32", num_kv_blocks=64))
    bound_gb = 2.5 * one / 2**30  # two models fit, not three
    path = tmp_path / "models.yaml"
    big = f"huge:\n  model: {models_dir / 'gamma'}\n  num_kv_blocks: 1000\n"  # ~16x the pool: never fits
    path.write_text("".join(f"{n}: {models_dir / n}\n" for n in NAMES) + big)
    argv = ["--models", str(path), "--models-memory-gb", f"{bound_gb:.12f}", *ENGINE_FLAGS]
    with InProcessServer(argv) as server:
        manager = server.manager
        for name in ("alpha", "beta", "gamma"):
            assert server.complete(name).status_code == 200
            assert manager.num_bytes <= manager.max_bytes
        server.wait_for("alpha", "unloaded")
        assert manager.num_loaded == 2 and manager.num_bytes <= manager.max_bytes
        resp = server.complete("huge")
        error = _error(resp, 503)
        assert resp.headers["Retry-After"] and "more than the bound" in error["message"]
        expected = {"alpha": "unloaded", "beta": "loaded", "gamma": "loaded", "huge": "unloaded"}
        assert server.statuses() == expected


def test_a_model_with_a_stream_running_is_never_unloaded(models_dir):
    """Once alpha's stream has sent its first chunk its engine is held at a gate, so the stream is surely
    running while beta asks for the only slot."""
    with InProcessServer(["--models-dir", str(models_dir), "--models-max", "1", *ENGINE_FLAGS]) as server:
        assert server.http.post("/models/load", json={"model": "alpha"}).status_code == 200
        llm, hold, gate = server.manager.entries["alpha"].state.llm, threading.Event(), threading.Event()
        step = llm.step

        def gated_step():
            if hold.is_set():
                assert gate.wait(60)
            return step()

        llm.step = gated_step  # the engine thread looks it up at every step
        body = {"model": "alpha", "prompt": "In", "max_tokens": 800, "ignore_eos": True, "stream": True}
        with server.http.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # streaming
            hold.set()
            resp = server.complete("beta")  # alpha is the only model and it is busy: no room
            error = _error(resp, 503)
            assert resp.headers["Retry-After"] == "1" and "alpha" in error["message"]
            busy = _error(server.http.post("/models/unload", json={"model": "alpha"}), 409)
            assert busy["code"] == "model_busy"
            assert server.statuses()["alpha"] == "loaded"
            gate.set()
            chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # the stream ran to its end
        resp = server.complete("beta")
        assert resp.status_code == 200, resp.text  # alpha idle now: unloaded for beta
        assert server.statuses() == {"alpha": "unloaded", "beta": "loaded", "gamma": "unloaded"}


def test_other_models_serve_while_one_loads(models_dir, monkeypatch):
    """beta's load is held at a gate: alpha answers meanwhile, and beta's request once the gate opens."""
    import asyncio

    from infer.server import model_manager
    from infer.server.server_state import ServerState

    gate = threading.Event()

    class GatedState(ServerState):
        async def load(self, on_fatal=None) -> None:
            if self.args.model_name == "beta":
                await asyncio.to_thread(gate.wait, 60)
            await super().load(on_fatal)

    monkeypatch.setattr(model_manager, "ServerState", GatedState)
    with InProcessServer(["--models-dir", str(models_dir), *ENGINE_FLAGS]) as server:
        assert server.complete("alpha").status_code == 200
        with ThreadPoolExecutor(1) as pool:
            beta = pool.submit(server.complete, "beta")
            server.wait_for("beta", "loading")
            assert server.complete("alpha").status_code == 200  # served while beta loads
            assert not beta.done()
            gate.set()
            assert beta.result().status_code == 200


def test_concurrent_first_requests_load_the_model_once(models_dir):
    with InProcessServer(["--models-dir", str(models_dir), *ENGINE_FLAGS]) as server:
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda _: server.complete("gamma"), range(6)))
        assert [a.status_code for a in answers] == [200] * 6
        assert server.manager.num_loads == 1


def test_a_corrupt_model_answers_with_an_error_and_the_others_keep_serving(models_dir, tmp_path):
    folder = tmp_path / "models"
    shutil.copytree(models_dir / "alpha", folder / "alpha")
    shutil.copytree(models_dir / "beta", folder / "broken")
    (folder / "broken" / "model.safetensors").write_bytes(b"\x00 not a safetensors file" * 100)
    with InProcessServer(["--models-dir", str(folder), *ENGINE_FLAGS]) as server:
        assert server.complete("alpha").status_code == 200
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda _: server.complete("broken"), range(3)))
        for resp in answers:
            error = _error(resp, 500)
            assert error["code"] == "model_load_failed" and "`broken`" in error["message"]
            assert str(folder) not in error["message"]  # no server paths in what a client reads
        assert server.manager.num_loads == 2  # alpha, and broken once for its three requests
        card = server.http.get("/v1/models/broken").json()
        assert card["status"]["value"] == "unloaded" and card["status"]["error"]
        assert server.complete("alpha").status_code == 200
        assert server.manager.num_loaded == 1


def test_keep_alive_zero_unloads_after_the_request(models_dir):
    with InProcessServer(["--models-dir", str(models_dir), *ENGINE_FLAGS]) as server:
        assert server.complete("alpha", keep_alive=0).status_code == 200
        server.wait_for("alpha", "unloaded")
        assert server.complete("beta", keep_alive="10m").status_code == 200
        assert server.manager.entries["beta"].keep_alive_s == 600 and server.statuses()["beta"] == "loaded"
        assert _error(server.complete("beta", keep_alive="soon"), 400)["param"] == "keep_alive"
        assert server.complete("beta").status_code == 200  # without one: the default again (-1: kept)
        assert server.manager.entries["beta"].keep_alive_s is None
    with InProcessServer(["--models-dir", str(models_dir), *ENGINE_FLAGS, "--keep-alive", "0"]) as server:
        assert server.complete("gamma").status_code == 200  # the flag's default: unloaded after each
        server.wait_for("gamma", "unloaded")
        assert server.manager.num_loaded == 0 and server.manager.num_bytes == 0


def test_load_and_unload_endpoints(models_dir):
    with InProcessServer(["--models-dir", str(models_dir), *ENGINE_FLAGS]) as server:
        resp = server.http.post("/models/load", json={"model": "beta"})
        assert resp.status_code == 200 and resp.json()["success"] is True
        assert resp.json()["model"]["status"] == {"value": "loaded"}
        assert server.http.post("/models/load", json={"model": "beta"}).status_code == 200  # already: no-op
        assert server.manager.num_loads == 1
        listed = server.http.get("/models").json()["data"]
        assert {m["id"]: m["status"]["value"] for m in listed}["beta"] == "loaded"
        resp = server.http.post("/models/unload", json={"model": "beta"})
        assert resp.status_code == 200 and resp.json()["model"]["status"] == {"value": "unloaded"}
        assert server.manager.num_loaded == 0 and server.manager.num_bytes == 0
        assert server.complete("beta").status_code == 200  # a request after the unload loads it again
        assert server.manager.num_loads == 2
        assert _error(server.http.post("/models/load", json={}), 400)


@pytest.mark.slow
def test_infer_serve_models_dir_end_to_end(models_dir, tmp_path):
    """The command as a user runs it: /health is 200 before any model loads, the openai client lists them,
    a request loads one, SIGTERM stops it cleanly."""
    from tests.server.conftest import ServerProcess

    argv = ["--models-dir", str(models_dir), "--models-max", "1", *ENGINE_FLAGS]
    server = ServerProcess(argv, tmp_path / "server.log").start()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        assert [(m.id, m.status["value"]) for m in client.models.list().data] == [
            (name, "unloaded") for name in NAMES
        ]
        answer = client.completions.create(model="gamma", prompt="In", max_tokens=2)
        assert answer.model == "gamma" and answer.usage.completion_tokens <= 2
        assert client.models.retrieve("gamma").status == {"value": "loaded"}
        server.signal(signal.SIGTERM)  # drains, then stops the loaded engine: exit 0
        assert server.wait(60) == 0
    finally:
        server.stop()
    log = (tmp_path / "server.log").read_text()
    assert "3 models, none loaded yet: alpha, beta, gamma" in log and "drained" in log
