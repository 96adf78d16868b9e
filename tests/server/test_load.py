"""Concurrency, cancellation, overload and shutdown: 64 concurrent streams, 12 disconnects that give every
KV block back, 429s while admitted requests complete, and a SIGTERM drain that exits 0 (also in a storm)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections import Counter

import httpx
import openai
import pytest

from infer.server.launch import ABORT_GRACE_S
from tests.server.conftest import API_KEY, ServerProcess, metric

pytestmark = pytest.mark.slow  # 64 concurrent streams, overload and shutdown storms, servers of their own

IGNORE_EOS = {"ignore_eos": True}
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def test_64_concurrent_streams_complete_with_exact_usage(aclient, model):
    prompts = [[10 + i, 20 + i, 30, 40 + i % 7] for i in range(64)]

    async def one(prompt):
        stream = await aclient.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=IGNORE_EOS,
        )
        text, reasons, usage = "", [], None
        async for chunk in stream:
            for c in chunk.choices:
                text += c.text
                reasons += [c.finish_reason] if c.finish_reason else []
            usage = chunk.usage or usage
        return text, reasons, usage

    async def main():
        return await asyncio.gather(*(one(p) for p in prompts))

    for (_, reasons, usage), prompt in zip(asyncio.run(main()), prompts, strict=True):
        assert reasons == ["length"]
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
            len(prompt),
            16,
            len(prompt) + 16,
        )


async def _wait_idle(server: ServerProcess, timeout: float = 30.0) -> str:
    """/metrics once no request runs or waits and no KV block is held (polled; nothing timed)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        text = await asyncio.to_thread(server.metrics)
        idle = metric(text, "num_requests_running") + metric(text, "num_requests_waiting") == 0
        if idle and metric(text, "kv_cache_usage_perc") == 0.0 or loop.time() > deadline:
            return text
        await asyncio.sleep(0.05)


def test_disconnects_abort_and_free_the_kv_cache(server, model):
    """12 streams closed after two chunks, and one non-streaming request whose client gives up."""
    aborted_before = metric(server.metrics(), "request_success_total", finished_reason="abort")
    max_len = httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"][0]["max_model_len"]
    body = {"model": model, "max_tokens": max_len - 8, "ignore_eos": True, "stream": True}

    async def stream_then_leave(http: httpx.AsyncClient, i: int) -> int:
        async with http.stream("POST", "/v1/completions", json={**body, "prompt": [7, 8, i]}) as resp:
            assert resp.status_code == 200
            chunks = 0
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                    if chunks == 2:
                        return chunks  # leaving the block closes the connection
        return chunks

    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as http:
            counts = await asyncio.gather(*(stream_then_leave(http, i) for i in range(12)))
            with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
                await http.post(
                    "/v1/completions", json={**body, "stream": False, "prompt": [9, 9]}, timeout=0.3
                )
        return counts, await _wait_idle(server)

    counts, text = asyncio.run(main())
    assert counts == [2] * 12
    assert metric(text, "num_requests_running") == 0 and metric(text, "num_requests_waiting") == 0
    assert metric(text, "kv_cache_usage_perc") == 0.0
    aborted = metric(text, "request_success_total", finished_reason="abort") - aborted_before
    assert aborted == 13


@pytest.fixture(scope="module")
def small_server(model_args, tmp_path_factory):
    """2 running, 4 queued at most, a KV pool of 12 blocks (192 tokens); keys from a config file."""
    folder = tmp_path_factory.mktemp("small_server")
    (folder / "serve.yaml").write_text("max-batch-size: 2\nmax_queued_requests: 4\nnum-gpu-blocks: 64\n")
    args = [
        *model_args,
        "--config",
        str(folder / "serve.yaml"),
        "--num-gpu-blocks",
        "12",
        "--max-model-len",
        "256",
    ]
    proc = ServerProcess(args, folder / "server.log").start()
    yield proc
    proc.stop()


def test_overload_gets_429_while_admitted_requests_complete(small_server):
    client = openai.AsyncOpenAI(base_url=small_server.url + "/v1", api_key="none", max_retries=0)

    async def one(i: int):
        try:
            resp = await client.completions.create(
                model="embedded", prompt=[5, 6, 7, i], max_tokens=48, extra_body=IGNORE_EOS
            )
        except openai.RateLimitError as exc:
            assert exc.response.headers["retry-after"] == "1"
            assert exc.body["code"] == "rate_limit_exceeded" and "--max-queued-requests 4" in exc.message
            return 429
        assert resp.usage.completion_tokens == 48 and resp.choices[0].finish_reason == "length"
        return 200

    async def main():
        statuses = await asyncio.gather(*(one(i) for i in range(20)))
        return statuses, await one(99)

    statuses, after = asyncio.run(main())
    assert statuses.count(429) >= 1 and statuses.count(200) >= 6  # 2 running + 4 queued admitted at once
    assert after == 200  # the server is fine afterwards
    text = small_server.metrics()
    assert metric(text, "request_success_total", finished_reason="length") == statuses.count(200) + 1


def test_a_request_that_can_never_fit_is_a_400_even_when_the_queue_is_full(small_server):
    """A 429 would have its client retry in vain for as long as the server stays busy."""
    body = {"model": "embedded", "max_tokens": 150, "ignore_eos": True, "stream": True}

    async def main():
        async with (
            httpx.AsyncClient(base_url=small_server.url, timeout=60) as http,
            contextlib.AsyncExitStack() as held,
        ):
            for i in range(6):  # 2 running + 4 queued: the bound
                resp = await held.enter_async_context(
                    http.stream("POST", "/v1/completions", json={**body, "prompt": [5, i]})
                )
                assert resp.status_code == 200
            fits = await http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 4})
            never = await http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 300})
            chat = await http.post(
                "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 2000}]}
            )
        return fits, never, chat

    fits, never, chat = asyncio.run(main())
    assert fits.status_code == 429
    assert never.status_code == 400 and "max_model_len (256)" in never.json()["error"]["message"]
    assert chat.status_code == 400 and "max_model_len (256)" in chat.json()["error"]["message"]


def test_more_sequences_than_ever_admitted_is_a_400_not_a_429(small_server):
    resp = httpx.post(small_server.url + "/v1/completions", json={"prompt": "hi", "n": 7}, timeout=30)
    assert resp.status_code == 400 and "at most 6 at once" in resp.json()["error"]["message"]


def test_kv_pool_limit_is_a_400_with_the_numbers(small_server):
    resp = httpx.post(
        small_server.url + "/v1/completions", json={"prompt": [1] * 8, "max_tokens": 200}, timeout=30
    )
    assert resp.status_code == 400
    message = resp.json()["error"]["message"]
    assert "207" in message and "192" in message and "12 blocks" in message


def test_sigterm_drains_then_exits_0(model_args, tmp_path):
    proc = ServerProcess([*model_args, "--drain-timeout", "1.5"], tmp_path / "server.log").start()
    try:
        max_len = httpx.get(proc.url + "/v1/models").json()["data"][0]["max_model_len"]
        client = openai.AsyncOpenAI(base_url=proc.url + "/v1", api_key="none", max_retries=0)

        async def consume(stream) -> tuple[str, int]:
            reason, usage = None, None
            async for chunk in stream:
                for c in chunk.choices:
                    reason = c.finish_reason or reason
                usage = chunk.usage or usage
            return reason, usage.completion_tokens

        async def main():
            kwargs = dict(
                model="embedded", stream=True, stream_options={"include_usage": True}, extra_body=IGNORE_EOS
            )
            short = await client.completions.create(prompt=[1, 2, 3], max_tokens=6, **kwargs)
            long = await client.completions.create(prompt=[4, 5, 6], max_tokens=max_len - 4, **kwargs)
            proc.signal(signal.SIGTERM)  # both requests are running: their first tokens have arrived
            async with httpx.AsyncClient(base_url=proc.url, timeout=10) as http:
                for _ in range(100):  # the handler runs at the server's next tick (polled; nothing timed)
                    health = await http.get("/health")
                    if health.status_code != 200:
                        break
                    await asyncio.sleep(0.02)
                refused = await http.post("/v1/completions", json={"prompt": "late", "max_tokens": 2})
            return health, refused, await consume(short), await consume(long)

        health, refused, short, long = asyncio.run(main())
        assert health.status_code == 503 and refused.status_code == 503
        assert set(refused.json()["error"]) == {"message", "type", "param", "code"}
        assert short == ("length", 6)
        reason, num_tokens = long
        # cut by the drain timeout (a fast model may finish first: then it is complete, not lost)
        assert (reason == "abort" and num_tokens < max_len - 4) or long == ("length", max_len - 4)
        assert proc.wait(timeout=30) == 0
        log = proc.log_tail(20000)
        assert "SIGTERM: draining" in log and "drained" in log
    finally:
        proc.stop()


def test_sigterm_under_a_storm_exits_0_and_every_stream_ends_clearly(model_args, tmp_path):
    """SIGTERM while long streams run and other clients keep leaving mid-stream: the server still exits 0
    (within the drain timeout plus the abort grace), every long stream ends complete or with finish_reason
    "abort" and [DONE], and every request refused meanwhile gets a 503 that says why."""
    drain = 2.0
    args = [*model_args, "--drain-timeout", str(drain), "--max-num-seqs", "4"]
    proc = ServerProcess(args, tmp_path / "server.log").start()
    try:
        max_len = httpx.get(proc.url + "/v1/models").json()["data"][0]["max_model_len"]

        async def stream(http: httpx.AsyncClient, i: int) -> tuple:
            body = {"prompt": [4, 5, i], "max_tokens": max_len - 8, "ignore_eos": True, "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                reason, done = None, False
                async for line in resp.aiter_lines():
                    done = done or line == "data: [DONE]"
                    if line.startswith("data: {"):
                        reason = json.loads(line[6:])["choices"][0]["finish_reason"] or reason
            return reason, done

        async def leave_again_and_again(http: httpx.AsyncClient, i: int) -> Counter:
            seen: Counter = Counter()
            body = {"prompt": [6, 7, i], "max_tokens": 200, "ignore_eos": True, "stream": True}
            while True:
                try:
                    async with http.stream("POST", "/v1/completions", json=body) as resp:
                        if resp.status_code != 200:
                            error = json.loads(await resp.aread())["error"]
                            assert resp.status_code == 503 and "shutting down" in error["message"], error
                            seen[503] += 1
                            return seen
                        async for line in resp.aiter_lines():
                            if line.startswith("data: {"):
                                break  # leave after the first chunk
                    seen["left"] += 1
                except httpx.TransportError:  # the server exited between two tries
                    seen["gone"] += 1
                    return seen

        async def main():
            async with httpx.AsyncClient(base_url=proc.url, timeout=60) as http:
                streams = [asyncio.create_task(stream(http, i)) for i in range(3)]
                storm = [asyncio.create_task(leave_again_and_again(http, i)) for i in range(4)]
                for _ in range(200):  # until the long streams run (polled; nothing timed)
                    text = await asyncio.to_thread(proc.metrics)
                    if metric(text, "generation_tokens_total") > 3 * 16:
                        break
                    await asyncio.sleep(0.05)
                sent = time.monotonic()
                proc.signal(signal.SIGTERM)
                code = await asyncio.to_thread(proc.wait, drain + 30)
                elapsed = time.monotonic() - sent
                return code, elapsed, await asyncio.gather(*streams), await asyncio.gather(*storm)

        code, elapsed, streams, storm = asyncio.run(main())
        assert code == 0, proc.log_tail()
        assert elapsed < drain + ABORT_GRACE_S + 10, elapsed  # not a hang (the slack is for a busy machine)
        for reason, done in streams:
            assert reason in ("abort", "length") and done
        assert sum(s["left"] for s in storm) >= 4  # the storm did storm
        log = proc.log_tail(50000)
        assert "SIGTERM: draining" in log and "Traceback" not in log
    finally:
        proc.stop()
