"""AsyncPoolingEngine with a stand-in engine: requests waiting together share one encode call, results go
back to their own request, and one request's failing input fails that request alone."""

from __future__ import annotations

import asyncio
import threading

import pytest

from infer.engine.async_pooling import AsyncPoolingEngine
from infer.runner.pooling_runner import PoolingInput

BAD = 666


class RecordingEngine:
    def __init__(self):
        self.calls: list[list[list[int]]] = []

    def encode(self, inputs: list[PoolingInput]) -> list[list[float]]:
        self.calls.append([x.token_ids for x in inputs])
        if any(x.token_ids == [BAD] for x in inputs):
            raise ValueError("a bad input")
        return [[float(sum(x.token_ids))] for x in inputs]


def _run(jobs: list[list[list[int]]]):
    """Start an engine whose build waits until every job is queued, then await them all."""
    release, engine = threading.Event(), RecordingEngine()

    def build():
        release.wait(10)
        return engine

    async def main():
        pooling = AsyncPoolingEngine(build)
        pooling.start()
        tasks = [asyncio.create_task(pooling.encode([PoolingInput(ids) for ids in job])) for job in jobs]
        await asyncio.sleep(0)  # every task has queued its job
        assert pooling.num_waiting == sum(len(job) for job in jobs)
        release.set()
        await pooling.ready()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert pooling.num_waiting == 0
        pooling.shutdown()
        return results

    return asyncio.run(main()), engine.calls


def test_waiting_requests_share_one_forward_and_get_their_own_results():
    results, calls = _run([[[1, 2]], [[3], [4, 5]], [[6]]])
    assert calls == [[[1, 2], [3], [4, 5], [6]]]
    assert results == [[[3.0]], [[3.0], [9.0]], [[6.0]]]


def test_a_failing_input_fails_its_own_request_alone():
    results, calls = _run([[[1]], [[BAD]], [[2], [3]]])
    assert results[0] == [[1.0]] and results[2] == [[2.0], [3.0]]
    assert isinstance(results[1], RuntimeError)
    assert calls[0] == [[1], [BAD], [2], [3]]  # together first, then each request on its own
    assert calls[1:] == [[[1]], [[BAD]], [[2], [3]]]


def test_a_failed_build_is_raised_by_ready():
    def build():
        raise ValueError("no such model")

    async def main():
        pooling = AsyncPoolingEngine(build)
        pooling.start()
        with pytest.raises(ValueError, match="no such model"):
            await pooling.ready()

    asyncio.run(main())
