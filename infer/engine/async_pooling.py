"""AsyncPoolingEngine: a pooling model's forwards on a thread of their own, awaited from the event loop.

The event loop never runs a forward: an HTTP request's inputs go to a queue, and the engine thread
(which built the model, so that torch runs on one thread: see infer.engine.async_engine) takes every job
waiting when it wakes and runs them together, packed into batches under the token budget
(PoolingEngine.encode). Requests that arrive while a batch runs make the next one, so concurrent
clients share forwards rather than queueing one by one. A batch that fails is run again one job at a
time, so one request's failure is its own.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable

from infer.engine.pooling import PoolingEngine
from infer.runner.pooling_runner import PoolingInput

logger = logging.getLogger("infer.engine")


class AsyncPoolingEngine:
    def __init__(self, factory: Callable[[], PoolingEngine]):
        self.engine: PoolingEngine | None = None
        self._factory = factory
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._built: asyncio.Future | None = None
        self.num_waiting = 0  # inputs queued or running (the event loop's count)

    def start(self) -> None:
        """Start the engine thread, which first builds the engine; call from the event loop."""
        self._loop = asyncio.get_running_loop()
        self._built = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, name="infer-pooling", daemon=True)
        self._thread.start()

    async def ready(self) -> None:
        """Wait until the engine is built; raises what building it raised."""
        await self._built

    def shutdown(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()

    async def encode(self, inputs: list[PoolingInput]) -> list[list[float]]:
        """PoolingEngine.encode, run on the engine thread among other requests' inputs."""
        future = self._loop.create_future()
        self.num_waiting += len(inputs)
        try:
            self._jobs.put((inputs, future))
            return await future
        finally:
            self.num_waiting -= len(inputs)

    # -- the engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.engine = self._factory()
        except BaseException as exc:
            self._loop.call_soon_threadsafe(_settle, self._built, None, exc)
            return
        self._loop.call_soon_threadsafe(_settle, self._built, None, None)
        while True:
            jobs = [self._jobs.get()]
            while not self._jobs.empty():
                jobs.append(self._jobs.get())
            if any(job is None for job in jobs):
                for job in jobs:
                    if job is not None:
                        self._loop.call_soon_threadsafe(_settle, job[1], None, RuntimeError("shutting down"))
                return
            self._serve(jobs)

    def _serve(self, jobs: list) -> None:
        try:
            outputs = self.engine.encode([x for inputs, _ in jobs for x in inputs])
        except Exception:
            if len(jobs) > 1:  # one job's bad input fails that job alone
                for job in jobs:
                    self._serve([job])
                return
            logger.exception("a pooling batch failed")
            self._loop.call_soon_threadsafe(_settle, jobs[0][1], None, RuntimeError("the forward failed"))
            return
        start = 0
        for inputs, future in jobs:
            self._loop.call_soon_threadsafe(_settle, future, outputs[start : start + len(inputs)], None)
            start += len(inputs)


def _settle(future: asyncio.Future, result, exc: BaseException | None) -> None:
    if future.done():  # the client went away
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
