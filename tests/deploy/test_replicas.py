"""`infer serve --replicas 2` end to end: two replicas of the embedded model on a local Ray instance, one
server for the module, driven by the official `openai` client and httpx.

The same API as the single-process server (completions, streaming, chat, errors, /v1/models, /metrics),
a repeated prefix served by the replica that cached it, and a replica killed mid-stream: its request ends
with an error (never a hang), the other replica's finishes, and Ray Serve brings the dead one back.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'infer[ray]' to test it")

from tests.server.conftest import REPO, ServerProcess, free_port, metric  # noqa: E402

pytestmark = pytest.mark.slow  # two engine replicas on a local Ray instance

ENGINE_REPLICA = "ServeReplica:infer:EngineReplica"  # the process title Ray gives an engine replica
START_TIMEOUT_S = 240
# a prompt of several full KV blocks (16 tokens each) that every prefix test shares
PREFIX = (
    "In the beginning God created the heaven and the earth. And the earth was without form, and void; and "
    "darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters."
)


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
    return children


def descendants(pid: int) -> list[int]:
    children, found, todo = _children(), [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class ReplicaServer(ServerProcess):
    """`python -m infer serve --replicas 2 ...` on a free port; stop() leaves no Ray process behind."""

    def __init__(self, args: list[str], log_path: Path):
        env = {"PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0"}
        super().__init__(args, log_path, env=env, new_session=True)
        self.command = ["-m", "infer", "serve"]

    def start(self) -> ReplicaServer:
        return super().start(timeout=START_TIMEOUT_S)

    def engine_pids(self) -> list[int]:
        return sorted(p for p in descendants(self.proc.pid) if ENGINE_REPLICA in title(p))

    def stop(self) -> None:
        family = descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for pid in family + descendants(self.proc.pid):  # whatever outlived the Ray shutdown
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = ["--replicas", "2", "--routing-policy", "prefix_aware", "--dtype", "float32"]
    args += ["--num-kv-blocks", "512"]
    proc = ReplicaServer(args, tmp_path_factory.mktemp("replicas") / "server.log").start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_more_replicas_than_cores_are_refused_at_start():
    cores = len(os.sched_getaffinity(0))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "infer", "serve", "--replicas", str(cores + 1), "--port", str(free_port())],
        capture_output=True, text=True, timeout=120, cwd=REPO, env=env,
    )  # fmt: skip
    assert done.returncode == 2
    assert f"--replicas {cores + 1} needs at least {cores + 1} CPUs" in done.stderr


def test_models_lists_the_model_with_its_context(client):
    (card,) = client.models.list().data
    assert card.id == "embedded" and card.owned_by == "infer"
    assert card.model_extra["max_model_len"] > 0


def test_completion_matches_between_streaming_and_not(client):
    kwargs = {"model": "embedded", "prompt": "And the LORD said", "max_tokens": 12, "temperature": 0}
    full = client.completions.create(**kwargs)
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12 and full.usage.prompt_tokens > 0
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text  # greedy: the same text from whichever replica
    assert chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_streamed_and_not(client):
    messages = [{"role": "user", "content": "Recite Genesis 1:1"}]
    reply = client.chat.completions.create(model="embedded", messages=messages, max_tokens=8, temperature=0)
    assert reply.choices[0].message.role == "assistant" and reply.usage.completion_tokens >= 1
    stream = client.chat.completions.create(
        model="embedded", messages=messages, max_tokens=8, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == reply.choices[0].message.content


def test_structured_outputs_reach_the_replicas(client):
    """The ingress compiles the grammar (a bad one is its 400) and a replica's sampler follows it."""
    colors = ["red", "green", "blue"]
    kwargs = {"model": "embedded", "prompt": "The color is", "max_tokens": 8, "temperature": 1.0}
    resp = client.completions.create(**kwargs, n=4, extra_body={"structured_outputs": {"choice": colors}})
    assert all(c.text in colors and c.finish_reason == "stop" for c in resp.choices)
    with pytest.raises(openai.BadRequestError, match="unclosed group"):
        client.completions.create(**kwargs, extra_body={"structured_outputs": {"regex": "(ab"}})


def test_errors_are_openai_shaped(server, client):
    resp = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": -1}, timeout=30)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="max_model_len|context"):  # the engine's own limits
        client.completions.create(model="embedded", prompt="hi " * 2000, max_tokens=1)


def test_a_repeated_prefix_goes_to_the_replica_that_cached_it(server, client):
    first = client.completions.create(model="embedded", prompt=PREFIX + " Cold.", max_tokens=1)
    assert first.usage.prompt_tokens >= 48  # at least three full blocks to share
    shared = (first.usage.prompt_tokens - 4) // 16 * 16  # the full blocks before the suffix differs
    for i in range(4):  # round-robin or least-loaded would send half of these to the other, cold replica
        warm = client.completions.create(model="embedded", prompt=f"{PREFIX} Warm {i}.", max_tokens=1)
        assert warm.usage.prompt_tokens_details.cached_tokens >= shared - 16
    text = httpx.get(server.url + "/metrics", timeout=10).text
    assert metric(text, "router_decisions_total", reason="prefix") >= 4


def test_metrics_aggregate_requests_and_report_each_replica(server, client):
    client.completions.create(model="embedded", prompt="Blessed are", max_tokens=4)
    deadline = time.monotonic() + 30  # replicas report their scheduler every second, Ray relays it
    while True:
        text = httpx.get(server.url + "/metrics", timeout=10).text
        replicas = {line.split('replica="')[1].split('"')[0] for line in text.splitlines()
                    if line.startswith("infer:num_requests_running{")}  # fmt: skip
        queried = len(replicas) == 2 and metric(text, "prefix_cache_queries_total") > 0
        if queried or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(replicas) == 2
    assert metric(text, "time_to_first_token_seconds_count") >= 1
    assert metric(text, "request_success_total", finished_reason="length") >= 1
    assert metric(text, "prefix_cache_queries_total") > 0


def test_a_killed_replica_fails_its_stream_and_is_restarted(server, client):
    """Two long streams, one per replica (no shared prefix: the least loaded takes each); SIGKILL one
    replica: its stream ends with an error, the other's finishes; then Ray Serve starts a new replica."""
    pids = server.engine_pids()
    assert len(pids) == 2
    results: dict[int, str] = {}
    first_chunk = [threading.Event(), threading.Event()]

    def consume(i: int) -> None:
        try:
            stream = client.completions.create(
                model="embedded", prompt=f"Request {i}: {'And it came to pass ' * (i + 1)}", max_tokens=600,
                temperature=0, stream=True, extra_body={"ignore_eos": True},
            )  # fmt: skip
            reason = None
            for chunk in stream:
                first_chunk[i].set()
                if chunk.choices and chunk.choices[0].finish_reason:
                    reason = chunk.choices[0].finish_reason
            results[i] = f"finished:{reason}"
        except openai.APIError as exc:
            results[i] = f"error:{type(exc).__name__}"
        finally:
            first_chunk[i].set()

    threads = [threading.Thread(target=consume, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.3)  # the second request sees the first one's load
    assert all(e.wait(60) for e in first_chunk)
    os.kill(pids[0], signal.SIGKILL)
    for t in threads:
        t.join(120)  # never a hang
    assert not any(t.is_alive() for t in threads), f"a stream hung: {results}\n{server.log_tail()}"
    assert sorted(r.split(":")[0] for r in results.values()) == ["error", "finished"], results
    assert "finished:length" in results.values()

    deadline = time.monotonic() + 180  # Ray Serve replaces the dead replica (a model load)
    while time.monotonic() < deadline:
        pids_now = server.engine_pids()
        if len(pids_now) == 2 and pids[0] not in pids_now:
            break
        time.sleep(1)
    assert len(pids_now) == 2 and pids[0] not in pids_now, server.log_tail()
    for _ in range(4):  # and both replicas serve again
        reply = client.completions.create(model="embedded", prompt="And God said", max_tokens=2)
        assert reply.choices[0].finish_reason == "length"
