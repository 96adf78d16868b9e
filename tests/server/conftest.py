"""A real server on loopback (a subprocess running `python -m infer.server`), driven by the official client.

The model is the embedded one (a small Llama with a chat template) once its weights exist; before that, a
tiny random Llama with a byte tokenizer and a minimal chat template stands in, so the suite always runs.
Tests only assert what holds for any model: counts, shapes, equalities between two runs.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from infer.models.loader import EMBEDDED_MODEL

API_KEY = "test-key"
REPO = Path(__file__).resolve().parents[2]
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m infer.server ARGS` on a free loopback port; `start()` returns once /health is 200."""

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        port: int = 0,
        new_session: bool = False,
    ):
        self.port = port or free_port()
        self.env = env or {}
        self.new_session = new_session
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [*args, "--port", str(self.port)]
        self.log_path = log_path
        self.command = ["-m", "infer.server"]  # what python runs, before the args
        self.health_statuses: list[int] = []  # every /health status seen while waiting

    def start(self, timeout: float = 90.0) -> ServerProcess:
        self.log = open(self.log_path, "w")  # noqa: SIM115 (closed by stop())
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        self.proc = subprocess.Popen(
            [sys.executable, *self.command, *self.args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=env,
            start_new_session=self.new_session,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                status = httpx.get(self.url + "/health", timeout=2).status_code
            except httpx.TransportError:
                time.sleep(0.1)
                continue
            self.health_statuses.append(status)
            if status == 200:
                return self
            time.sleep(0.05)
        tail = self.log_tail()  # before stop() closes the log
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout}s:\n{tail}")

    def log_tail(self, n: int = 4000) -> str:
        self.log.flush()
        return self.log_path.read_text()[-n:]

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `infer:NAME` whose labels include `labels`."""
    total, found = 0.0, False
    for line in text.splitlines():
        if not line.startswith(f"infer:{name}{{"):
            continue
        label_text, value = line[len(f"infer:{name}") :].rsplit(" ", 1)
        if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            total, found = total + float(value), True
    assert found, f"no sample of infer:{name} {labels}"
    return total


@pytest.fixture(scope="session")
def model_args(tmp_path_factory) -> list[str]:
    """The model flags for every test server: the embedded model, or a tiny stand-in."""
    if (EMBEDDED_MODEL / "config.json").is_file():
        return ["--dtype", "float32", "--num-kv-blocks", "512"]
    from tests.models.tiny_models import save_byte_tokenizer, save_tiny_model

    _, path = save_tiny_model("llama", tmp_path_factory.mktemp("server_model"))
    save_byte_tokenizer(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = TINY_CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return [
        "--model",
        str(path),
        "--served-model-name",
        "embedded",
        "--dtype",
        "float32",
        "--num-kv-blocks",
        "512",
    ]


@pytest.fixture(scope="session")
def server(model_args, tmp_path_factory):
    """The shared server: a batch size of 8, priority policy (equal priorities = fcfs), an API key."""
    args = [
        *model_args,
        "--max-batch-size",
        "8",
        "--scheduling-policy",
        "priority",
        "--api-key",
        API_KEY,
        "--max-queued-requests",
        "256",
    ]
    proc = ServerProcess(args, tmp_path_factory.mktemp("server") / "server.log").start()
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture
def aclient(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def model(client) -> str:
    return client.models.list().data[0].id
