"""AsyncEngine: the step loop on its own thread, streams to asyncio callers.

The HTTP event loop never runs a forward and the engine thread never waits on a socket. The two
threads meet only through a command queue (add, abort: applied between steps, so the engine is
touched by one thread alone) and `call_soon_threadsafe` (outputs back to each request's asyncio.Queue).

The engine is built on the engine thread too, so that the process runs torch
on one thread only. With OpenMP (libgomp), a second thread running parallel torch ops while the first
is still alive makes more OpenMP threads than cores; libgomp then stops spinning between parallel regions
and every small matmul pays a futex wake-up: ~+120 us per GEMV here, a decode step of the embedded model
14 ms instead of 8 (a model loaded on an executor thread, then stepped on the engine thread).

An idle engine woken by a request first waits until requests stop coming for BURST_QUIET_S (at most
BURST_MAX_S), so that a burst starts as one step. Without it, a step started on the first few requests of
a burst takes both cores at once, the client and the event loop then deliver the rest late (measured:
waves of 8 requests arrived as 6, then 2 some 20 ms later, during the 6's prefill), and the late ones
prefill beside the early ones' decodes: a slow gap for each of those, which is what an ITL p99 reports.
With it every wave prefills in one step (docs/optimizations.md, "The server around the engine"); a lone
request's first token costs the 0.5 ms wait. A busy engine never waits.

The engine thread gives the GIL up at every torch op and must get it back after: beside a thread of the
process that runs Python (the event loop validating a large body, a chat template rendered on a worker
thread), it waits for that thread to drop the GIL, which Python does every switch interval (5 ms by
default): a decode step of many small ops then takes many times its length. `start` lowers the interval
to GIL_SWITCH_INTERVAL_S, which bounds each such wait; a thread alone keeps the GIL whatever the interval.

A short request (a prompt the scheduler would prefill first, alone: at most half the step's token budget)
that arrives while the engine runs a long step (prefill chunks, or a flood's wide decode step) stops that
step halfway through a layer (LLMEngine's "Interrupted steps"): its first token then waits for half a
layer, not for the whole step. The event loop counts such arrivals; the engine thread notes the count
when it takes its commands, and a step asks whether it moved since.

An engine that cannot go on (`LLMEngine.fatal_error`: a tensor-parallel rank died) ends every request
with RequestFailed, refuses new ones, and calls `on_fatal`: the server then exits non-zero. The idle
thread looks at it every IDLE_CHECK_S, so a death between requests is noticed too.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

from infer.config import EngineConfig
from infer.core.slo import Objectives
from infer.engine.llm_engine import LLMEngine, StepOutput
from infer.engine.stop_strings import automaton
from infer.sampling_params import SamplingParams

logger = logging.getLogger("infer.engine")
IDLE_CHECK_S = 1.0
BURST_QUIET_S = 0.0005  # an idle engine woken by a request waits for this long a silence (docstring)
BURST_MAX_S = 0.004  # and no longer than this in all
GIL_SWITCH_INTERVAL_S = 0.0005  # the longest the engine thread waits for the GIL after a torch op (docstring)


class AsyncEngine:
    def __init__(
        self,
        config: EngineConfig | None = None,
        factory: Callable[[], LLMEngine] | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
    ):
        """Give a config or a factory: `start` builds the engine on the engine thread. `on_fatal` runs on
        the event loop if the engine stops for good (see the module docstring)."""
        self.engine: LLMEngine | None = None
        self.on_fatal = on_fatal
        self.dead: BaseException | None = None
        self._factory = factory or (lambda: LLMEngine(config or EngineConfig()))
        self._built: asyncio.Future | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, asyncio.Queue] = {}
        self._ids = itertools.count()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._arrivals = ShortArrivals()

    def start(self) -> None:
        """Start the engine thread (which first builds the engine); call from the event loop that will
        consume the streams. Requests may be sent at once: they wait for the engine."""
        self._loop = asyncio.get_running_loop()
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
        self._built = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, name="infer-engine", daemon=True)
        self._thread.start()

    async def ready(self) -> None:
        """Wait until the engine is built; raises what building it raised."""
        await self._built

    def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join()

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    async def add(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        req_id: str | None = None,
        priority: int = 0,
        slo: Objectives | None = None,
        group_id: str | None = None,
    ) -> AsyncIterator[StepOutput]:
        """Queue a request and return the iterator of its outputs once the engine has accepted it.

        Raises ValueError if the engine refuses it. Closing the iterator early (a client that went away)
        aborts the request; so does a cancellation while waiting for the engine's answer. A request the
        engine fails alone (finish_reason "error") raises RequestFailed from the iterator. group_id: shared
        by the engine requests of one API request (its n choices) or one client: admitted in waves of a
        fair share, their decodes beside other requests bounded by the step's cost."""
        await self.ready()  # a model that failed to load fails the request here, instead of a hang
        matcher = None
        if params is not None and params.structured_outputs is not None:  # compiled here, not in a step
            compiled = self.engine.grammars.compiled(params.structured_outputs)
            matcher = (await asyncio.wrap_future(compiled)).deep_copy()
        if params is not None and params.stop:  # the stop strings' automaton, built here, not in a step
            with contextlib.suppress(TypeError):  # not strings: the engine refuses them, naming why
                await asyncio.to_thread(automaton, tuple(params.stop))
        req_id = req_id if req_id is not None else f"req-{next(self._ids)}"
        stream: asyncio.Queue = asyncio.Queue()
        added = self._loop.create_future()
        self._streams[req_id] = stream
        if self._is_short(prompt):
            self._arrivals.sent += 1
        self._send(("add", (prompt, params, req_id, priority, slo, matcher, group_id), added))
        try:
            await added
        except BaseException:
            self._streams.pop(req_id, None)
            self.abort(req_id)  # a no-op if it was refused; ends it if it was accepted meanwhile
            raise
        return self._outputs(req_id, stream)

    async def _outputs(self, req_id: str, stream: asyncio.Queue) -> AsyncIterator[StepOutput]:
        finished = False
        try:
            while not finished:
                out = await stream.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                if out.finish_reason == "error":
                    raise RequestFailed(req_id, out.error)
                yield out
        finally:
            self._streams.pop(req_id, None)
            if not finished:
                self.abort(req_id)

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        req_id: str | None = None,
        priority: int = 0,
        slo: Objectives | None = None,
    ) -> AsyncIterator[StepOutput]:
        """`add`, then yield the request's outputs as they come."""
        outputs = await self.add(prompt, params, req_id, priority, slo)
        async with aclosing(outputs):
            async for out in outputs:
                yield out

    def _is_short(self, prompt: str | list[int]) -> bool:
        """Whether the scheduler would prefill the prompt first, alone (Scheduler._is_short's rule, before
        there is a Request: a text's UTF-8 bytes bound its tokens from above)."""
        size = len(prompt.encode()) if isinstance(prompt, str) else len(prompt)
        return size <= self.engine.scheduler_config.max_num_batched_tokens // 2

    def abort(self, req_id: str) -> None:
        self._send(("abort", req_id, None))

    def _send(self, command) -> None:
        self._commands.put(command)
        self._wakeup.set()
        if self.dead is not None and command[2] is not None:  # the thread is gone: answer for it
            _settle(command[2], RequestFailed(command[1][2], f"the engine stopped: {self.dead}"))

    # -- the engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.engine = self._factory()
        except BaseException as exc:  # reported by ready(); the thread ends
            self._loop.call_soon_threadsafe(_settle, self._built, exc)
            return
        self._loop.call_soon_threadsafe(_settle, self._built, None)
        engine = self.engine
        engine.newcomer_waiting = self._arrivals  # not a closure over self: no cycle to keep both alive
        while not self._stopping:
            idle = not engine.has_unfinished()
            self._apply_commands()
            if engine.fatal_error is not None:
                self._die(engine.fatal_error)
                break
            if not engine.has_unfinished():
                self._wakeup.wait(IDLE_CHECK_S)
                self._wakeup.clear()
                continue
            if idle:  # work just reached an idle engine, however it was noticed: let its burst arrive
                self._gather_burst()
                self._apply_commands()
            try:
                outputs = engine.step()
            except Exception as exc:  # a failed step fails its requests, not the server
                if engine.fatal_error is None:
                    self._fail_all(exc)
                continue
            if outputs:  # one wake-up of the event loop per step, not one per request
                self._loop.call_soon_threadsafe(self._put_all, [(out.req_id, out) for out in outputs])
        try:
            engine.close()  # writes the trace file, when tracing
        except OSError as exc:
            logger.error("could not write the engine trace: %s", exc)
        engine.shutdown()

    def _gather_burst(self) -> None:
        """Wait until commands stop arriving for BURST_QUIET_S (at most BURST_MAX_S); the caller applies
        them, so that a burst reaching an idle engine starts as one step (see the module docstring)."""
        deadline = time.monotonic() + BURST_MAX_S
        while True:
            self._wakeup.clear()
            left = deadline - time.monotonic()
            if left <= 0 or not self._wakeup.wait(min(BURST_QUIET_S, left)):
                return

    def _die(self, exc: BaseException) -> None:
        """The engine cannot go on: fail every request, answer the commands still queued, report."""
        self.dead = exc
        self._fail_all(exc, "the engine stopped")
        while True:
            try:
                kind, payload, future = self._commands.get_nowait()
            except queue.Empty:
                break
            if future is not None:
                self._loop.call_soon_threadsafe(_settle, future, RequestFailed(payload[2], str(exc)))
        if self.on_fatal is not None:
            self._loop.call_soon_threadsafe(self.on_fatal, exc)

    def _apply_commands(self) -> None:
        self._arrivals.taken = self._arrivals.sent  # those counted so far are in the queue
        while True:
            try:
                kind, payload, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                try:
                    self.engine.add_request(*payload)
                except Exception as exc:
                    self._loop.call_soon_threadsafe(_settle, future, exc)
                else:
                    self._loop.call_soon_threadsafe(_settle, future, None)
            else:  # the stream gets its final "abort" output, so a consumer never waits forever
                for out in self.engine.abort(payload):
                    self._deliver(out.req_id, out)

    def _put_all(self, items: list[tuple[str, object]]) -> None:
        """On the event loop, which owns the streams: hand each (req_id, output or error) to its stream."""
        for req_id, item in items:
            stream = self._streams.get(req_id)
            if stream is not None:
                stream.put_nowait(item)

    def _deliver(self, req_id: str, item) -> None:
        self._loop.call_soon_threadsafe(self._put_all, [(req_id, item)])

    def _fail_all(self, exc: BaseException, why: str = "engine step failed") -> None:
        """A step failed outside any one request's work (LLMEngine attributes the rest): a bug in the
        engine's own bookkeeping, so no request's state can be trusted."""
        logger.error("%s; ending every request", why, exc_info=exc)
        req_ids = list(self.engine.requests)
        self.engine.abort(req_ids)
        for req_id in req_ids:
            self._deliver(req_id, RequestFailed(req_id, f"{type(exc).__name__}: {exc}"))


class ShortArrivals:
    """Short requests sent to the engine thread (counted on the event loop), and their count when the
    engine thread last took its commands: called, whether one came since (the module docstring)."""

    def __init__(self) -> None:
        self.sent = 0
        self.taken = 0

    def __call__(self) -> bool:
        return self.sent != self.taken


class RequestFailed(RuntimeError):
    """The engine could not complete this request. `detail` is for logs; clients get a generic 500."""

    def __init__(self, req_id: str, detail: str | None):
        super().__init__(f"the engine failed request {req_id}")
        self.req_id, self.detail = req_id, detail


def _settle(future: asyncio.Future, exc: BaseException | None) -> None:
    if future.done():  # the caller went away before the engine answered
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)
