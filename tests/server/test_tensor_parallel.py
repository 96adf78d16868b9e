"""`--tensor-parallel-size 2` through the real server: the same tokens as one rank (structured outputs
too: rank 0 samples under the grammar), a rank that dies stops the server with an error (never a hang),
a clean stop leaves no process; and the launcher's way
(RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, as torchrun sets them), each rank its own command."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from infer.engine.llm import LLM
from infer.sampling_params import SamplingParams
from infer.structured_outputs.constraint import StructuredOutputs
from tests.server.conftest import REPO, ServerProcess, free_port

pytestmark = pytest.mark.slow  # servers of two ranks in their own processes

PROMPT = "In the beginning"


def children(pid: int) -> set[int]:
    """Child processes of `pid`, started from any of its threads."""
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        found |= {int(c) for c in (task / "children").read_text().split()}
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def model_flags(model_args: list[str]) -> tuple[str | None, list[str]]:
    model = model_args[model_args.index("--model") + 1] if "--model" in model_args else None
    return model, [*model_args, "--max-batch-size", "4"]


REGEX = "[a-z]{2,8}( [a-z]{2,8}){2}"  # structured outputs: rank 0 samples under the grammar


@pytest.fixture(scope="module")
def expected(model_args) -> str:
    model, _ = model_flags(model_args)
    with LLM(model, dtype="float32", num_kv_blocks=512) as llm:
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        return llm.generate(PROMPT, params)[0].text


@pytest.fixture(scope="module")
def expected_structured(model_args) -> str:
    model, _ = model_flags(model_args)
    with LLM(model, dtype="float32", num_kv_blocks=512) as llm:
        spec = StructuredOutputs(regex=REGEX)
        text = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, structured_outputs=spec))[
            0
        ].text
    assert re.fullmatch(REGEX, text)
    return text


def complete(url: str, extra: dict | None = None) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    out = client.completions.create(
        model="embedded",
        prompt=PROMPT,
        max_tokens=16,
        temperature=0,
        extra_body=extra or {"ignore_eos": True},
    )
    return out.choices[0].text


def test_two_ranks_serve_one_ranks_tokens_and_stop_cleanly(
    model_args, expected, expected_structured, tmp_path
):
    _, flags = model_flags(model_args)
    server = ServerProcess([*flags, "--tensor-parallel-size", "2"], tmp_path / "server.log").start()
    try:
        workers = children(server.proc.pid)
        assert len(workers) == 1, server.log_tail()
        assert complete(server.url) == expected
        assert complete(server.url, {"structured_outputs": {"regex": REGEX}}) == expected_structured
        server.signal(signal.SIGTERM)
        assert server.wait(30) == 0, server.log_tail()
        deadline = time.monotonic() + 15
        while any(alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(w) for w in workers)
    finally:
        server.stop()


@pytest.mark.parametrize("busy", [True, False])
def test_a_rank_that_dies_fails_its_requests_and_the_server(model_args, tmp_path, busy):
    _, flags = model_flags(model_args)
    server = ServerProcess([*flags, "--tensor-parallel-size", "2"], tmp_path / "server.log").start()
    try:
        (worker,) = children(server.proc.pid)
        if not busy:  # dies between requests: noticed without one
            os.kill(worker, signal.SIGKILL)
            assert server.wait(30) != 0
            assert "tensor-parallel rank 1" in server.log_tail()
            return
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=30)
        stream = client.completions.create(
            model="embedded", prompt=PROMPT, max_tokens=500, stream=True, extra_body={"ignore_eos": True}
        )
        next(iter(stream))  # the request is running
        os.kill(worker, signal.SIGKILL)
        with pytest.raises(openai.APIError):  # the stream ends with an error, it does not hang
            for _ in stream:
                pass
        assert server.wait(30) != 0
        assert "tensor-parallel" in server.log_tail()
    finally:
        server.stop()


def test_ranks_placed_by_a_launcher(model_args, expected, tmp_path):
    """Each rank runs the same command with the standard variables: rank 0 serves, rank 1 computes."""
    _, flags = model_flags(model_args)
    flags = [*flags, "--tensor-parallel-size", "2"]
    common = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    port = free_port()
    with open(tmp_path / "rank1.log", "w") as log:
        rank1 = subprocess.Popen(
            [sys.executable, "-m", "infer.server", *flags, "--port", str(port)],
            env={**os.environ, **common, "RANK": "1"},
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        server = ServerProcess(flags, tmp_path / "rank0.log", env={**common, "RANK": "0"}, port=port)
        try:
            server.start()
            assert complete(server.url) == expected
            server.signal(signal.SIGTERM)
            assert server.wait(30) == 0
            assert rank1.wait(30) == 0, (tmp_path / "rank1.log").read_text()[-3000:]
        finally:
            server.stop()
            if rank1.poll() is None:
                rank1.kill()


def test_more_ranks_than_cores_are_refused_before_loading():
    cores = len(os.sched_getaffinity(0))
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    proc = subprocess.run(
        [sys.executable, "-m", "infer.server", "--tensor-parallel-size", str(cores + 1)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env=env,
    )
    assert proc.returncode == 2
    assert f"needs a CPU core per rank; this machine gives {cores}" in proc.stderr
